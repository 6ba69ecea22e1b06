"""`run` with overhead.budget = 0: the governor is off (as `attach --budget 0`), from the start or by a
reload; a reload back to a budget starts it on every current target. The runtime the daemon builds
(llmobs.runtime.Agent, through service.new_agent's settings) runs on a synthetic attach session
(tests/unit/test_governor.py), so a shed and its undoing are observable."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from llmobs.daemon import config as cfg
from llmobs.runtime import Agent
from test_governor import RATES, SyntheticSession

COSTS = {"alloc_cpu": 1000.0, "free_cpu": 700.0, "linear": 700.0}


@pytest.fixture
def no_file(monkeypatch):
    monkeypatch.setattr(cfg, "DEFAULT_CONFIG_PATH", Path("/nonexistent/llmobs.toml"))


@pytest.mark.parametrize(
    ("env", "flags"), [({"LLMOBS_OVERHEAD_BUDGET": "0"}, {}), ({}, {"overhead.budget": "0"})]
)
def test_budget_zero_is_accepted_from_env_and_flag(no_file, env, flags):
    assert cfg.load(None, env=env, flags=flags).overhead_budget == 0.0


def test_budget_zero_means_no_governor_and_a_reload_switches_it(no_file):
    lines: list[str] = []
    config = cfg.load(None, env={"LLMOBS_OVERHEAD_BUDGET": "0"})
    service = Agent(budget=config.overhead_budget, cost_scale=config.cost_scale, log=lines.append, nvml=False)
    assert service.governor is None and service.telemetry is not None
    assert lines == ["governor: off (overhead.budget = 0): no probe is ever shed"]

    session = SyntheticSession(RATES, COSTS)  # 3.7% of the work in probe hits: over a 1% budget
    service.targets = {session.pid: SimpleNamespace(session=session)}
    service.set_budget(0.01)  # a SIGHUP that sets a budget: the governor starts, tracking the target
    governor = service.governor
    assert governor is not None and service.telemetry.governor is governor
    assert list(governor.targets) == [session.pid]
    governor.cpu_seconds, governor.cost_scale = (lambda pid: session.cpu), 1.0
    for second in range(3):
        session.advance(1.0)
        governor.tick(float(second))
    assert session.shed, "the governor shed nothing at 3.7% over a 1% budget"

    service.set_budget(0.0)  # a SIGHUP that sets 0: off, and what it shed comes back
    assert service.governor is None and service.telemetry.governor is None
    assert session.shed == {} and [c for c in session.calls if c[0] == "restore"]
    assert lines[-1] == "governor: off (overhead.budget = 0): every shed probe re-attached"


def test_cost_scale_defaults_to_the_measured_factor_and_reaches_the_governor(no_file):
    from llmobs.governor.governor import DEFAULT_COST_SCALE

    assert cfg.load(None, env={}).cost_scale == DEFAULT_COST_SCALE == 2.3
    config = cfg.load(None, env={"LLMOBS_OVERHEAD_COST_SCALE": "1.5"})
    service = Agent(budget=0.01, cost_scale=config.cost_scale, nvml=False)
    assert service.governor.cost_scale == 1.5
    assert cfg.load(None, env={}, flags={"overhead.cost_scale": "3"}).cost_scale == 3.0
