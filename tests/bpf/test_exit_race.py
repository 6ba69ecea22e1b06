"""No token step is lost when the target exits right after `attach` (issue 13, item 6).

A tiny PyTorch workload (libc10 loaded, so attach accepts it) waits for a line on stdin, publishes 8
token steps with `llmobs.request` and exits at once: its map is gone, or left for the agent, within
milliseconds of "attached in". The real CLI (`attach --pid P --db X`) must store all 8 steps every time.
Synchronised over pipes: the workload says "ready" on stdout, the test says "go" once the agent has
printed "attached in"; nothing waits on a sleep. Repetitions: LLMOBS_EXIT_RACE_RUNS (default 5; the
issue's done-when is 20 in a row: `LLMOBS_EXIT_RACE_RUNS=20 pytest tests/bpf/test_exit_race.py`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import duckdb
import pytest
from test_attach import Agent

RUNS = int(os.environ.get("LLMOBS_EXIT_RACE_RUNS", "5"))
TOKENS = 8

# The map is created before "ready" (llmobs.instrument publishes the model id), as in a real workload;
# the 8 steps come only after "go", and the process exits right after the last one.
WORKLOAD = f"""
import sys, torch, llmobs
torch.set_num_threads(1)
model = torch.nn.Linear(4, 16)
llmobs.instrument(model, model_id="exit-race")
print("ready", flush=True)
sys.stdin.readline()
ids = torch.tensor([[1, 2, 3]])
with llmobs.request(ids, tenant="race") as req:
    for i in range({TOKENS}):
        req.begin_step()
        logits = model(torch.ones(1, 4))
        req.step(logits, torch.tensor([i % 16]))
"""


def _stored_steps(db, pid: int) -> list[int]:
    # by pid: the agent also stores what other exited processes left in /dev/shm (its stale-map sweep)
    with duckdb.connect(str(db), read_only=True) as conn:
        sql = "SELECT step FROM token_steps WHERE pid = ? ORDER BY step"
        return [row[0] for row in conn.execute(sql, [pid]).fetchall()]


def _one_run(db) -> tuple[int, int, str]:
    workload = subprocess.Popen(
        [sys.executable, "-c", WORKLOAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert workload.stdout.readline().strip() == "ready"
        agent = Agent("--pid", str(workload.pid), "--db", str(db), "--profile", "cpu")
        agent.wait_for("attached in")
        workload.stdin.write("go\n")
        workload.stdin.close()
        assert workload.wait(timeout=60) == 0
        code, text = agent.finish(timeout=120)
    finally:
        if workload.poll() is None:
            workload.kill()
            workload.wait()
    return workload.pid, code, text


@pytest.mark.parametrize("run", range(RUNS))
def test_every_step_is_stored_when_the_target_exits_right_after_attach(tmp_path, run):
    db = tmp_path / "race.duckdb"
    pid, code, text = _one_run(db)
    assert code == 0, text
    steps = _stored_steps(db, pid)
    assert steps == list(range(TOKENS)), f"stored {len(steps)} of {TOKENS} token steps\n{text}"
    assert not os.path.exists(f"/dev/shm/llmobs.{pid}"), "the exited target's map was left behind"


def test_the_daemon_stores_every_step_of_a_process_that_lived_shorter_than_a_scan(tmp_path):
    """`run` with a discovery interval longer than the workload's life: the process is never attached
    (or, should a scan catch it, attached and drained); either way all 8 steps are stored, by the sweep of
    maps left by exited processes. The workload runs as `nobody` and the daemon selects only that user,
    so no other process on the host is touched."""
    from test_daemon_run import Daemon

    config = (
        f'[store]\npath = "{tmp_path / "store.duckdb"}"\n'
        f'[daemon]\nrun_dir = "{tmp_path / "run"}"\n'
        '[select]\nusers = ["nobody"]\n'
        "[discovery]\ninterval_s = 5.0\n"
        '[probes]\nprofiles = ["cpu"]\n'
    )
    daemon = Daemon(tmp_path, config)
    try:
        daemon.wait_line(r"running: store")
        nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
        workload = subprocess.Popen(
            [*nobody, sys.executable, "-c", WORKLOAD],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/",
        )  # fmt: skip
        assert workload.stdout.readline().strip() == "ready"
        workload.stdin.write("go\n")
        workload.stdin.close()
        assert workload.wait(timeout=60) == 0
        swept = r"stale maps: \d+ map\(s\) of exited processes removed, [1-9][\d,]* unread"
        daemon.wait_line(rf"{swept}|detach pid {workload.pid} ")
        assert daemon.stop() == 0, "\n".join(daemon.lines)
    finally:
        daemon.close()
    steps = _stored_steps(tmp_path / "store.duckdb", workload.pid)
    assert steps == list(range(TOKENS)), "\n".join(daemon.lines)
    assert not os.path.exists(f"/dev/shm/llmobs.{workload.pid}")
