"""`llmobs-agent demo` for real (tiny model, small run): exit 0, the phases on stderr, a report with one
table per request whose rows match the store, a Perfetto trace that parses with every token step, and
a PNG; and `top --once` against a live `attach --db` shows the agent's exact per-step work."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
from test_attach import Agent, _assert_clean
from test_probes_target import leftovers

from bench.held_workload import read_json_line

AGENT = [sys.executable, "-m", "llmobs.cli"]
WORKLOAD = Path(__file__).resolve().parents[2] / "scripts" / "workload.py"


def test_demo_tiny_end_to_end(tmp_path):
    out = tmp_path / "demo"
    before = leftovers()
    proc = subprocess.run(
        [*AGENT, "demo", "--model", "tiny", "--requests", "2", "--max-new-tokens", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for phase in ("loading model", "attaching probes", "generating done: 10/10 tokens", "correlating",
                  "writing report", "done in"):  # fmt: skip
        assert phase in proc.stderr, (phase, proc.stderr)
    text = proc.stdout
    assert "Request 1/2  tenant acme" in text and "Request 2/2  tenant globex" in text
    assert "store: 10 token steps (published 10, lost 0)" in text and "Slowest steps" in text
    conn = duckdb.connect(str(out / "llmobs.duckdb"), read_only=True)
    latencies = conn.execute("SELECT latency_ns FROM token_steps ORDER BY step_seq").fetchall()
    allocations = conn.execute("SELECT allocations FROM step_rollups ORDER BY step_seq").fetchall()
    conn.close()
    # each table row shows the store's latency and exact allocation count of that step
    rows = [line.split() for line in text.split("Slowest steps")[0].splitlines()]
    rows = [row for row in rows if len(row) == 10 and row[0].isdigit()]
    assert len(rows) == 10 and len(latencies) == 10
    for row, (latency,), (allocs,) in zip(rows, latencies, allocations, strict=True):
        assert row[5] == f"{latency / 1e6:.1f}" and row[6] == f"{allocs:,}" and allocs > 0
    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert sum(1 for e in events if e.get("cat") == "token" and e.get("ph") == "X") == 10
    assert (out / "tokens.png").read_bytes()[:4] == b"\x89PNG"
    assert text.startswith((out / "report.txt").read_text())
    left = leftovers()
    assert left["uprobe_events"] == before["uprobe_events"]
    assert sorted(left["programs"]) == sorted(before["programs"])


def test_top_once_shows_a_live_attach(tmp_path):
    before = leftovers()
    env = {**os.environ, "LLMOBS_RUN_DIR": str(tmp_path / "run")}
    ready_r, ready_w = os.pipe()
    workload = subprocess.Popen(
        [sys.executable, str(WORKLOAD), "--model", "tiny", "--requests", "0", "--threads", "1",
         "--ready-fd", str(ready_w)],
        stdout=subprocess.DEVNULL, pass_fds=(ready_w,),
    )  # fmt: skip
    os.close(ready_w)
    try:
        assert read_json_line(ready_r)["phase"] == "ready"
        os.environ["LLMOBS_RUN_DIR"] = env["LLMOBS_RUN_DIR"]  # the Agent helper inherits our environment
        try:
            agent = Agent("--pid", str(workload.pid), "--db", str(tmp_path / "s.duckdb"))
        finally:
            del os.environ["LLMOBS_RUN_DIR"]
        agent.wait_for("attached in")
        snapshot = tmp_path / "run" / f"attach.{workload.pid}.json"
        for _ in range(600):  # the agent rewrites its snapshot once a second; wait for per-step work in it
            if snapshot.exists() and json.loads(snapshot.read_text())["stats"]["work_steps"]:
                break
            select.select([], [], [], 0.05)
        shown = subprocess.run(
            [*AGENT, "top", "--once", "--pid", str(workload.pid)], capture_output=True, text=True, env=env,
            timeout=60,
        ).stdout  # fmt: skip
        # the process table's row (the per-tenant table under it starts with the pid too)
        line = next(row.split() for row in shown.splitlines() if row.split()[:1] == [str(workload.pid)])
        assert line[0] == str(workload.pid) and line[-2:] == ["agent", str(agent.pid)], shown
        assert line[4] != "-" and float(line[4]) > 0, shown  # tokens/s
        assert line[10] != "-" and float(line[10]) > 0, (shown, snapshot.read_text())  # GEMM calls per step
        by_db = subprocess.run(
            [*AGENT, "top", "--once", "--db", str(tmp_path / "s.duckdb")], capture_output=True, text=True,
            env=env, timeout=60,
        )  # fmt: skip
        assert by_db.returncode == 0 and f"agent {agent.pid}" in by_db.stdout, by_db.stderr
        agent.proc.send_signal(signal.SIGINT)
        code, text = agent.finish()
        assert code == 0, text
        _assert_clean(agent.pid, workload.pid, before)
        assert not snapshot.exists()
    finally:
        workload.terminate()
        workload.wait(timeout=30)
        os.close(ready_r)


def test_demo_refusals_are_one_line_with_distinct_codes(tmp_path):
    nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    proc = subprocess.run(
        [*nobody, *AGENT, "demo", "--model", "tiny", "--out", str(tmp_path / "d")],
        capture_output=True, text=True, timeout=60, cwd="/tmp",
    )  # fmt: skip
    assert proc.returncode == 4 and proc.stderr.startswith("error: attaching eBPF probes needs root")
    assert "Traceback" not in proc.stderr and not (tmp_path / "d").exists()
    bad = subprocess.run([*AGENT, "demo", "--requests", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --requests and --max-new-tokens")
