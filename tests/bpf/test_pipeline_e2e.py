"""The [store] issue's done-when, end to end: the real `llmobs-agent attach --db` on a real PyTorch
process (scripts/workload.py --model tiny) writes a DuckDB store in which

- the token steps equal what the workload published: the same count, and per forward pass (step_seq)
  the token and the loss the workload computed itself from generate()'s logits (--record);
- probe events are joined to the right steps: during the run every forward pass allocates
  1 + step_seq % 3 tensors of an unusual size (--alloc-bytes), and the store must show exactly that many
  alloc_cpu events of that size on each step, and a rollup counting at least that many allocations;
- the requests (two tenants, taken in turn) and their mean loss match the workload's record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
from test_attach import Agent, _assert_clean
from test_probes_target import leftovers

from bench.held_workload import HeldWorkload, read_json_line

WORKLOAD = Path(__file__).resolve().parents[2] / "scripts" / "workload.py"
REQUESTS, TOKENS = 6, 8
ALLOC_BYTES = 1_000_003  # no tensor of the tiny GPT-2 has this size: these allocations are ours


def _run(tmp_path: Path) -> tuple[list[dict], Path, str]:
    db, record = tmp_path / "store.duckdb", tmp_path / "record.jsonl"
    before = leftovers()
    args = ("--model", "tiny", "--requests", str(REQUESTS), "--max-new-tokens", str(TOKENS), "--threads", "1",
            "--tenant", "acme,globex", "--record", str(record),
            "--alloc-bytes", str(ALLOC_BYTES))  # fmt: skip
    with HeldWorkload(*args) as workload:
        agent = Agent("--pid", str(workload.pid), "--profile", "cpu,mem,host", "--db", str(db))
        agent.wait_for("attached in")
        workload.generate()
        agent.proc.send_signal(signal.SIGINT)
        code, text = agent.finish()
        assert code == 0, text
        _assert_clean(agent.pid, workload.pid, before)
    return [json.loads(line) for line in record.read_text().splitlines()], db, text


def test_store_holds_what_the_workload_published_joined_to_the_right_steps(tmp_path):
    records, db, agent_output = _run(tmp_path)
    assert len(records) == REQUESTS
    # per forward pass, from the workload's own record: (request, token index, token, loss, allocations)
    expected = {}
    for rec in records:
        assert len(rec["allocs"]) == TOKENS, rec
        for index, (step_seq, allocs) in enumerate(rec["allocs"]):
            expected[step_seq] = (rec, index, rec["tokens"][0][index], rec["losses"][0][index], allocs)

    conn = duckdb.connect(str(db), read_only=True)
    steps = conn.execute(
        "SELECT step_seq, step, token_id, loss, tenant, session FROM token_steps ORDER BY step_seq"
    ).fetchall()
    # count: every published token step, once
    assert len(steps) == REQUESTS * TOKENS == len(expected), agent_output
    assert [row[0] for row in steps] == sorted(expected)
    for step_seq, step, token_id, loss, tenant, session in steps:
        rec, index, token, own_loss, _ = expected[step_seq]
        assert (step, token_id, tenant, session) == (index, token, rec["tenant"], rec["session"])
        assert np.isclose(loss, own_loss, rtol=1e-4, atol=1e-5), (step_seq, loss, own_loss)

    # the known allocations of each forward pass, exactly, on its own step and nowhere else
    ours = dict(
        conn.execute(
            "SELECT step_seq, count(*) FROM mem_events WHERE probe = 'alloc_cpu' AND value = ? GROUP BY 1",
            [ALLOC_BYTES],
        ).fetchall()
    )
    assert ours == {step_seq: want[4] for step_seq, want in expected.items()}
    # the exact kernel totals and the rollups account for them on every step (plus the model's own)
    rollups = {
        row[0]: row[1:]
        for row in conn.execute(
            "SELECT step_seq, allocations, compute_calls, counts_exact, tokens FROM step_rollups"
        ).fetchall()
    }
    assert set(rollups) == set(expected)
    for step_seq, (allocations, compute_calls, exact, tokens) in rollups.items():
        assert exact and tokens == 1
        assert allocations >= expected[step_seq][4] and compute_calls > 0, (step_seq, rollups[step_seq])
    exact_allocs = dict(
        conn.execute(
            "SELECT step_seq, sum(count) FROM probe_aggregates WHERE probe = 'alloc_cpu' GROUP BY 1"
        ).fetchall()
    )
    sampled_allocs = dict(
        conn.execute(
            "SELECT step_seq, count(*) FROM mem_events WHERE probe = 'alloc_cpu' GROUP BY 1"
        ).fetchall()
    )
    for step_seq in expected:  # --sample 1: every event left the kernel, so the two counts agree
        assert exact_allocs[step_seq] == sampled_allocs[step_seq] == rollups[step_seq][0]

    # requests: two tenants in turn, their token counts and mean loss
    requests = conn.execute(
        "SELECT tenant, session, tokens, mean_loss FROM requests ORDER BY first_step_seq"
    ).fetchall()
    assert [(r[0], r[1], r[2]) for r in requests] == [
        (rec["tenant"], rec["session"], TOKENS) for rec in records
    ]
    for (_, _, _, mean_loss), rec in zip(requests, records, strict=True):
        assert np.isclose(mean_loss, np.mean(rec["losses"][0]), rtol=1e-4)
    assert f"token_steps {REQUESTS * TOKENS:,}" in agent_output
    assert "0 dropped (queue full), 0 failed" in agent_output


def test_sigkill_during_ingest_keeps_what_was_committed(tmp_path):
    """The agent killed with SIGKILL mid-run: the store reopens, and every token step in it is one the
    workload published, with its loss; the dead agent's snapshot is ignored by `top`."""
    from llmobs.pipeline.live import read_snapshots, snapshot_path
    from llmobs.shm.reader import ShmReader

    run_dir = tmp_path / "run"
    db = tmp_path / "store.duckdb"
    ready_r, ready_w = os.pipe()
    workload = subprocess.Popen(
        [sys.executable, str(WORKLOAD), "--model", "tiny", "--requests", "0", "--max-new-tokens", "8",
         "--threads", "1", "--ready-fd", str(ready_w)],
        stdout=subprocess.DEVNULL, pass_fds=(ready_w,),
    )  # fmt: skip
    os.close(ready_w)
    os.environ["LLMOBS_RUN_DIR"] = str(run_dir)  # the agent inherits it
    # and its writer holds a small commit 1 s, not 4 (the same commits, each sooner: the kill below
    # waits for two of them)
    os.environ["LLMOBS_STORE_MAX_HOLD_S"] = "1"
    try:
        assert read_json_line(ready_r)["phase"] == "ready"
        agent = Agent("--pid", str(workload.pid), "--db", str(db))
        agent.wait_for("attached in")
        snapshot = snapshot_path(workload.pid, run_dir)
        commits_with_steps = None  # the writer's commit count once token steps had been handed to it
        # Killed only after a commit that began after the first token steps were handed to the writer
        # (the snapshot is written after the steps it counts; a commit under way then may lack them, the
        # one after it cannot): the store must then hold them.
        for _ in range(600):
            if snapshot.exists():
                data = json.loads(snapshot.read_text())
                if commits_with_steps is None and data["stats"]["tokens"]:
                    commits_with_steps = data["store"]["commits"]
                elif commits_with_steps is not None and data["store"]["commits"] >= commits_with_steps + 2:
                    break
            select_timeout(0.05)
        else:
            raise AssertionError("no commit after the first token steps")
        agent.proc.kill()
        agent.proc.wait(timeout=30)
        with ShmReader(workload.pid) as reader:
            published = {row["step_seq"]: row["loss"] for row in reader.read_steps().rows()}
        assert read_snapshots(run_dir) == [] and snapshot.exists()  # left behind, but known dead
    finally:
        del os.environ["LLMOBS_RUN_DIR"], os.environ["LLMOBS_STORE_MAX_HOLD_S"]
        workload.terminate()
        workload.wait(timeout=30)
        os.close(ready_r)
    conn = duckdb.connect(str(db), read_only=True)
    stored = conn.execute("SELECT step_seq, loss FROM token_steps").fetchall()
    assert len(stored) > 0 and len({s for s, _ in stored}) == len(stored)
    for step_seq, loss in stored:
        assert step_seq in published and np.isclose(loss, published[step_seq], rtol=1e-6), step_seq


def select_timeout(seconds: float) -> None:
    """The poll period of a bounded wait on a file condition (not a synchronisation by sleeping)."""
    import select

    select.select([], [], [], seconds)
