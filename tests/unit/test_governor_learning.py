"""The governor's coverage beyond uprobes, with synthetic sessions: the in-situ cost scale learned from
what a shed changed in the workload's CPU per step, the agent's own CPU counted when the workload waits
for a core, and tracepoints shed through their program's switch word (shared by its targets).

The synthetic workload charges each hit `true_scale` x its calibrated cost (what the kernel would
charge the workload), so the governor's learned scale must move from its prior towards true_scale."""

from __future__ import annotations

import pytest
from llmobs.bpf.profiles import PROBE_IDS, PROBES
from llmobs.governor import Governor, contention, learning
from test_governor import SyntheticSession

BY_NAME = {probe.name: probe for probe in PROBES}


class StepSession(SyntheticSession):
    """A workload making `steps_per_s` token steps; each hit costs true_scale x its calibrated cost."""

    def __init__(self, rates, costs_ns, true_scale: float, steps_per_s: float = 20.0, busy: float = 1.0):
        super().__init__(rates, costs_ns, busy=busy)
        self.true_scale = true_scale
        self.steps_per_s = steps_per_s
        self.steps = 1.0

    def advance(self, seconds: float) -> None:
        overhead = 0.0
        for name, rate in self.rates.items():
            if name not in self.shed:
                self.counts[name] += rate * seconds
                overhead += rate * self.calibration[name].cost_ns * 1e-9 * self.true_scale
        # the same steps take more CPU (not capped at a core: the synthetic session's busy + overhead)
        self.steps += self.steps_per_s * seconds
        self.cpu += (self.busy + overhead) * seconds

    def live_totals(self):
        step = int(self.steps)
        return {(self.pid, PROBE_IDS[name], step): [int(count), 0, 0] for name, count in self.counts.items()}


def drive(governor: Governor, session, seconds: int, start: int = 0) -> list:
    decisions = []
    for t in range(start, start + seconds):
        session.advance(1.0)
        decisions += governor.tick(float(t + 1))
    return decisions


def make(session, budget: float, **kw) -> tuple[Governor, list[str]]:
    lines: list[str] = []
    governor = Governor(budget, log=lines.append, cpu_seconds=lambda pid: session.cpu, **kw)
    governor.track(session)
    governor.tick(0.0)
    return governor, lines


def test_the_learning_rule() -> None:
    before = learning.Window(cpu_s=1.0, steps=100)  # 10 ms per step
    pending = learning.Pending(0.0, +1.0, 0.001, before, 0.0, 0.0)  # 1 ms per step predicted
    assert learning.learned_sample(pending, learning.Window(0.8, 100)) == pytest.approx(2.0)  # 2 ms saved
    assert learning.learned_sample(pending, learning.Window(1.5, 100)) == learning.SCALE_MIN  # got worse
    assert learning.learned_sample(pending, learning.Window(0.01, 100)) == learning.SCALE_MAX
    assert learning.learned_sample(pending, learning.Window(0.8, 3)) is None  # too few steps
    tiny = learning.Pending(0.0, +1.0, 0.0001, before, 0.0, 0.0)  # 1% of a step: below MIN_SIGNAL
    assert learning.learned_sample(tiny, learning.Window(0.8, 100)) is None
    restore = learning.Pending(0.0, -1.0, 0.001, before, 0.0, 0.0)
    assert learning.learned_sample(restore, learning.Window(1.03, 100)) == pytest.approx(
        0.5
    )  # 0.3 ms: clipped
    assert learning.learned_sample(restore, learning.Window(1.3, 100)) == pytest.approx(3.0)
    assert learning.updated_scale(2.0, 4.0) == pytest.approx(2.6)
    assert learning.updated_scale(8.0, 8.0) == learning.SCALE_MAX


@pytest.mark.parametrize("true_scale", [1.2, 4.0])
def test_the_scale_is_learned_from_what_a_shed_changed(true_scale: float) -> None:
    """From the 2.3 prior, sheds and restores move the scale towards the workload's own factor; a
    workload costlier than the prior gets its probes shed at a load the prior would have allowed."""
    session = StepSession({"alloc_cpu": 40_000.0, "linear": 4_000.0}, {"alloc_cpu": 1000.0, "linear": 700.0},
                          true_scale)  # fmt: skip
    governor, lines = make(session, 0.01, window_s=5.0, hold_s=10.0, min_interval_s=5.0, cost_scale=2.3)
    t = 0
    for _cycle in range(5):  # each restore (budget raised) and each shed (lowered) is one observation
        for budget in (0.01, 1.0):
            governor.set_budget(budget)
            drive(governor, session, 30, t)
            t += 30
    learned = governor.targets[session.pid]
    assert learned.learned, lines  # at least one clean observation
    assert abs(learned.scale - true_scale) < abs(2.3 - true_scale) / 2, (learned.scale, lines)
    assert any("cost scale 2.30 ->" in line for line in lines)


class TwoCoreSession(StepSession):
    """A workload keeping two cores busy whose probed calls are on one thread. `stalled`: the other
    thread waits for each trap at the next barrier, spinning (a torch intra-op pool): every hit costs
    two cores' time. Not stalled: the threads are independent, a hit costs its own thread only."""

    def __init__(self, rates, costs_ns, true_scale: float, stalled: bool):
        super().__init__(rates, costs_ns, true_scale, busy=2.0)
        self.stalled = stalled

    def advance(self, seconds: float) -> None:
        before = self.cpu
        super().advance(seconds)
        if self.stalled:  # the waiting core spins as long as the trap lasts
            self.cpu += self.cpu - before - self.busy * seconds


def test_a_hit_that_stalls_the_other_core_is_weighed_on_one_cores_work() -> None:
    """alloc_cpu at 15,000/s x 1 us: 1.5% of the issuing thread's time, and the same 1.5% of the whole
    workload's wall clock when the other core waits for it. The estimate says 1.5% (over the 1% budget,
    shed), not 1.5% of two cores' work (0.75%, under it: what the governor said before the stall term)."""
    session = TwoCoreSession({"alloc_cpu": 15_000.0}, {"alloc_cpu": 1000.0}, 1.0, stalled=True)
    governor, lines = make(session, 0.01, cost_scale=1.0)
    decisions = drive(governor, session, 3)
    assert [(d.action, d.probe) for d in decisions] == [("shed-last", "alloc_cpu")], lines
    assert decisions[0].before == pytest.approx(0.015, rel=0.02)
    assert governor.targets[session.pid].stall == pytest.approx(2.0, rel=0.02)
    assert governor.snapshot()["targets"][str(session.pid)]["stall_cores"] == pytest.approx(2.0, rel=0.02)


def test_one_busy_core_is_not_stalled() -> None:
    from llmobs.governor.governor import stall_cores

    assert stall_cores(0.03, 1.03) == 1.0  # a core's work plus its traps
    assert stall_cores(0.0, 0.4) == 1.0  # a mostly idle workload
    assert stall_cores(0.015, 2.03) == pytest.approx(2.0)  # two cores: each trap counted on both
    assert stall_cores(-1.0, 4.0) == 4.0


@pytest.mark.parametrize("stalled", [True, False])
def test_the_scale_is_learned_against_the_stalled_prediction(stalled: bool) -> None:
    """At two busy cores the governor predicts each shed's change as the hits' cost on both. Where the
    other core does wait (stalled), the scale it learns is the per-hit factor itself (1.2, not 2.4);
    where it does not, the scale comes down to about half of it, so the estimate stops doubling."""
    true_scale = 1.2
    rates, costs = {"alloc_cpu": 40_000.0, "linear": 4_000.0}, {"alloc_cpu": 1000.0, "linear": 700.0}
    session = TwoCoreSession(rates, costs, true_scale, stalled)
    governor, lines = make(session, 0.01, window_s=5.0, hold_s=10.0, min_interval_s=5.0, cost_scale=2.3)
    t = 0
    for _cycle in range(5):
        for budget in (0.01, 1.0):
            governor.set_budget(budget)
            drive(governor, session, 30, t)
            t += 30
    target = governor.targets[session.pid]
    # not stalled: the observed change is one core's, the prediction two cores' (stall = busy / (1 + traps))
    expected = true_scale if stalled else true_scale / 2
    unstalled_model = true_scale * 2 if stalled else true_scale  # what learning without the stall gives
    assert target.learned, lines
    assert abs(target.scale - expected) < abs(2.3 - expected) / 2, (target.scale, lines)
    assert abs(target.scale - expected) < abs(target.scale - unstalled_model), (target.scale, lines)


def test_no_learning_without_token_steps() -> None:
    session = SyntheticSession({"alloc_cpu": 20_000.0}, {"alloc_cpu": 1000.0})  # step 7 forever
    governor, _ = make(session, 0.01, cost_scale=2.3)
    drive(governor, session, 60)
    assert governor.targets[session.pid].scale == 2.3 and not governor.targets[session.pid].learned


def test_agent_share_of_the_runqueue_wait() -> None:
    assert contention.agent_share(0.0, 0.3, 2.0, 1.0) == 0.0  # spare cores: no wait, no cost
    assert contention.agent_share(0.2, 0.3, 1.3, 1.0) == pytest.approx(0.2)  # the agent is all the rest
    assert contention.agent_share(0.2, 0.3, 1.9, 1.0) == pytest.approx(0.2 * 0.3 / 0.9)  # others too
    assert contention.agent_share(5.0, 0.3, 1.3, 1.0) == pytest.approx(0.3)  # at most the agent's CPU


def test_the_counters_are_read_from_proc() -> None:
    import os

    assert contention.own_cpu_seconds() >= 0 and contention.host_busy_seconds() > 0
    assert contention.run_delay_seconds(os.getpid()) >= 0
    assert contention.run_delay_seconds(2**22 + 7) is None  # beyond pid_max: gone


def test_only_the_agents_per_event_work_is_put_on_the_probes() -> None:
    """An agent busy with fixed work (0.3 cores, 4,000 events/s: at most 12 ms/s of it per event) while
    the workload waits: the probes are charged 4% of its share, and within the budget nothing is shed."""
    session = SyntheticSession({"linear": 4_000.0}, {"linear": 700.0})
    governor, lines = make(session, 0.01, cost_scale=1.0, contention=FakeContention(0.3, 1.3, 0.05))
    assert drive(governor, session, 3) == [], lines
    assert governor.targets[session.pid].agent_cores == pytest.approx(0.05 * 4_000 * 3e-6 / 0.3, rel=0.05)


class FakeContention:
    """The agent at `agent` cores, the host at `host`, the workload waiting `wait` cores."""

    def __init__(self, agent: float, host: float, wait: float):
        self.rates = (agent, host, wait)
        self.t = 0.0

    def tick(self):
        self.t += 1.0
        return self.rates[0] * self.t, self.rates[1] * self.t

    def wait(self, pid):
        return self.rates[2] * self.t


def test_the_agents_own_cpu_is_counted_when_the_workload_waits_for_it() -> None:
    """Probes well within budget (0.28%) but an agent whose 1% of a core (all of it per-event work at
    4,000 events/s: under AGENT_EVENT_NS_MAX each) is the only other thing running while the workload
    waits: over a 1% budget; the shed says why. With no wait, nothing happens."""
    for wait, expected in ((0.0, []), (0.05, ["shed-last"])):
        session = SyntheticSession({"linear": 4_000.0}, {"linear": 700.0})
        governor, lines = make(session, 0.01, cost_scale=1.0, contention=FakeContention(0.01, 1.01, wait))
        decisions = drive(governor, session, 3)
        assert [d.action for d in decisions] == expected, lines
        if expected:
            assert "the agent's own CPU competing: 0.010 cores" in decisions[0].reason
            assert decisions[0].before == pytest.approx(0.0028 + 0.01, rel=0.05)


class FakeProgram:
    """ProbeProgram's switch words, as the governor uses them."""

    def __init__(self):
        self.off: set[str] = set()
        self.calls: list[tuple[str, bool]] = []

    def set_probe_enabled(self, name: str, enabled: bool) -> bool:
        self.calls.append((name, enabled))
        (self.off.discard if enabled else self.off.add)(name)
        return True


class TracepointSession(SyntheticSession):
    def __init__(self, rates, program, pid):
        super().__init__(rates, {}, pid=pid)
        self.program = program

    def advance(self, seconds: float) -> None:
        for name, rate in self.rates.items():
            if name not in self.program.off and name not in self.shed:
                self.counts[name] += rate * seconds
        self.cpu += self.busy * seconds


def test_tracepoints_are_shed_by_their_switch_word_shared_by_the_programs_targets() -> None:
    """page faults at 50k/s x 250 ns = 1.25%: over a 1% budget, switched off in the program; a second
    target of the same program that sheds it too keeps it off until both have restored it."""
    program = FakeProgram()
    a = TracepointSession({"page_fault_user": 50_000.0, "sched_switch": 100.0}, program, pid=11)
    b = TracepointSession({"page_fault_user": 50_000.0, "sched_switch": 100.0}, program, pid=12)
    lines: list[str] = []
    cpu = {11: a, 12: b}
    governor = Governor(0.01, log=lines.append, cpu_seconds=lambda pid: cpu[pid].cpu, cost_scale=1.0,
                        hold_s=5.0, min_interval_s=2.0)  # fmt: skip
    governor.track(a)
    governor.track(b)
    assert governor.targets[11].costs["page_fault_user"].site_class == "tracepoint"
    governor.tick(0.0)
    for t in range(3):
        a.advance(1.0)
        b.advance(1.0)
        governor.tick(float(t + 1))
    assert program.off == {"page_fault_user"}, lines
    assert {d.pid for d in governor.decisions if d.probe == "page_fault_user"} == {11, 12}
    assert "sched_switch" not in program.off  # 100/s x 550 ns: within budget
    governor.set_budget(1.0)
    governor.untrack(b)  # b goes: a still holds it off
    assert program.off == {"page_fault_user"}
    for t in range(3, 30):
        a.advance(1.0)
        governor.tick(float(t + 1))
    assert program.off == set() and program.calls[-1] == ("page_fault_user", True), lines
    assert [d.action for d in governor.decisions if d.pid == 11][-1] == "restore"


def test_all_profiles() -> None:
    from llmobs.bpf.profiles import PROFILES, parse_profiles

    assert parse_profiles("all") == PROFILES
    assert len(PROBES) <= 64  # LLMOBS_MAX_PROBES: the switch words' array in bpf/c/llmobs_events.h
