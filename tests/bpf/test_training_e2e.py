"""Training mode end to end: the tiny GPT-2 in a real training loop (scripts/train_workload.py, its own
process) with a corrupted batch at a known step, under the real `llmobs-agent attach --db`: the agent's
training monitor flags that step (one incident: the token detectors' per-token flags of training passes
open none), asks the workload for its last 5 dL/dE slices over the control block,
renders the heatmap and links it from the anomaly row.

Synchronised without sleeps: the workload reports on a pipe; the test waits (bounded) for the PNG to
appear in the store's artifacts directory while the workload keeps training (--until-stdin), then stops
the workload with a line on its stdin and the agent with SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from llmobs.diagnostics.heatmap import png_metadata
from llmobs.diagnostics.training import KIND
from llmobs.store.sink import DuckDBStore
from test_attach import Agent

from bench.held_workload import read_json_line

TRAIN = Path(__file__).resolve().parents[2] / "scripts" / "train_workload.py"
SPIKE_STEP, BATCH, SEQ = 60, 4, 32


def _wait_for_file(directory: Path, pattern: str, timeout: float) -> Path:
    deadline = time.monotonic() + timeout
    while True:
        found = sorted(directory.glob(pattern))
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no {pattern} in {directory} within {timeout} s"
        time.sleep(0.05)  # polling a file condition with a bound, not waiting for time to pass


def test_a_corrupted_batch_gets_one_incident_an_anomaly_row_and_its_dl_de_heatmap(tmp_path):
    db = tmp_path / "train.duckdb"
    ready_r, ready_w = os.pipe()
    args = ["--spike-step", str(SPIKE_STEP), "--batch", str(BATCH), "--seq", str(SEQ), "--until-stdin",
            "--wait-stdin", "--hold", "--ready-fd", str(ready_w)]  # fmt: skip
    workload = subprocess.Popen([sys.executable, str(TRAIN), *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, pass_fds=(ready_w,))  # fmt: skip
    os.close(ready_w)
    agent = None
    try:
        ready = read_json_line(ready_r)
        assert ready["phase"] == "ready" and ready["map"]
        agent = Agent("--pid", str(workload.pid), "--db", str(db))
        agent.wait_for("attached in")
        workload.stdin.write(b"go\n")
        workload.stdin.flush()
        png = _wait_for_file(Path(f"{db}.artifacts"), "dLdE-*.png", timeout=120)
        workload.stdin.write(b"stop\n")  # ends the training loop
        workload.stdin.flush()
        done = read_json_line(ready_r)
        assert done["phase"] == "done" and done["steps"] > SPIKE_STEP
        agent.proc.send_signal(signal.SIGINT)
        code, text = agent.finish()
        assert code == 0, text
    finally:
        if workload.poll() is None:
            workload.stdin.write(b"bye\n")
            workload.stdin.flush()
        out, _ = workload.communicate(timeout=60)
        os.close(ready_r)
        if agent is not None and agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()
    summary = json.loads(out.decode().strip().splitlines()[-1])
    spike_seq = summary["spike_step_seq"]
    with DuckDBStore(db, read_only=True) as store:
        rows = store.connection.execute(
            "SELECT step_seq, score, artifact, detail FROM anomalies WHERE kind = ? AND pid = ?",
            [KIND, workload.pid],
        ).fetchall()
        incidents = store.connection.execute(
            "SELECT incident_id, scope, first_seq, last_seq, tokens, rows, detectors, state, artifact"
            " FROM incidents WHERE pid = ?",
            [workload.pid],
        ).fetchall()
        linked = store.connection.execute(
            "SELECT kind, step_seq, count(*) FROM anomalies WHERE pid = ? AND incident_id IS NOT NULL"
            " GROUP BY ALL ORDER BY kind",
            [workload.pid],
        ).fetchall()
        losses = store.connection.execute(
            "SELECT count(DISTINCT step_seq), count(*) FROM token_steps WHERE pid = ?", [workload.pid]
        ).fetchall()[0]
    assert losses[0] >= SPIKE_STEP and losses[1] == losses[0] * BATCH * (SEQ - 1)  # every training token
    assert [r[0] for r in rows] == [spike_seq], (rows, summary["losses"][SPIKE_STEP - 3 : SPIKE_STEP + 3])
    _, score, artifact, detail = rows[0]
    assert score > 6 and Path(artifact) == png and png.exists()
    meta = png_metadata(png)
    assert meta["llmobs:shape"] == f"5x{BATCH * SEQ}x64"  # 5 steps x tokens x embedding dims
    assert meta["llmobs:step_seq"] == ",".join(str(s) for s in range(spike_seq - 4, spike_seq + 1))
    assert json.loads(detail)["step_mean_loss"] > 2 * json.loads(detail)["window_median"]
    # One bad batch is one incident: the step-level verdict's, closed, its whole pass's tokens, the
    # heatmap linked; the token detectors' per-token flags of training passes open none.
    assert incidents == [(f"{workload.pid}-{spike_seq}-pass", "pass", spike_seq, spike_seq, BATCH * (SEQ - 1),
                          1, "step_mad", "closed", str(png))]  # fmt: skip
    # linked: the step verdict's row, and token rows of that pass committed after it (if any)
    assert (KIND, spike_seq, 1) in linked and {seq for _kind, seq, _n in linked} == {spike_seq}
    assert not list(Path("/dev/shm").glob(f"llmobs.{workload.pid}.dLdE.*"))  # the dump left no tmpfs file
