"""`top`: the numbers (LiveStats) from known steps and totals, the table, and its three data paths:
a real map written by the real ShmWriter, an agent's snapshot file (fresh vs stale), and a store no
agent is writing."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
import torch
from llmobs import clock
from llmobs.commands import top
from llmobs.errors import ExitCode
from llmobs.pipeline.correlate import correlate
from llmobs.pipeline.live import LiveStats, read_snapshots, snapshot_path, write_snapshot
from llmobs.shm import layout
from llmobs.shm.writer import ShmWriter
from llmobs.store.sink import DuckDBStore


def _columns(pid: int, latencies_ms: list[float], losses: list[float], end_ns: int) -> dict:
    n = len(latencies_ms)
    latency = (np.array(latencies_ms) * 1e6).astype(np.int64)
    t_end = end_ns - np.arange(n)[::-1] * 10_000_000
    return {
        "pid": np.full(n, pid), "step_seq": np.arange(1, n + 1), "t_start_ns": t_end - latency,
        "t_end_ns": t_end, "latency_ns": latency, "loss": np.array(losses, dtype=np.float32),
        "model_id": ["m"] * n, "tenant": ["acme"] * (n - 1) + ["globex"],
    }  # fmt: skip


def test_live_stats_from_known_steps_and_totals():
    now = 100 * 10**9
    columns = _columns(7, [1, 2, 3, 4, 100], [1.0, 2.0, float("nan"), 3.0, 6.0], now)
    # probes finished attaching after step 1 started: its work was only partly seen, left out
    stats = LiveStats(7, attached_ns=int(columns["t_start_ns"][0]) + 1)
    stats.add_steps(columns)
    stats.add_aggregates(
        pa.table(
            {
                "pid": [7, 7, 7, 7, 7, 8],
                "step_seq": [1, 2, 2, 3, 3, 1],
                "probe": ["alloc_cpu", "alloc_cpu", "sched_switch", "alloc_cpu", "sgemm", "alloc_cpu"],
                "count": [3, 10, 2, 30, 5, 999],
                "sum_value": [0] * 6,
                "sum_duration_ns": [0, 0, 4_000_000, 0, 0, 0],
            }
        )  # fmt: skip
    )
    row = stats.row(now)
    assert row["tokens"] == 5 and row["model_id"] == "m" and row["tenants"] == ["acme", "globex"]
    # 5 steps ended in the last 10 s; the earliest start is the last step's (100 ms before now): a process
    # younger than the window is rated over its own age
    assert row["tokens_per_s"] == pytest.approx(5 / 0.1)
    assert row["p50_ms"] == pytest.approx(3.0)
    assert row["p99_ms"] == pytest.approx(np.percentile([1, 2, 3, 4, 100], 99))
    assert row["mean_loss"] == pytest.approx(3.0)  # NaN (no target) left out
    # per step over the 2 steps with totals of pid 7 (pid 8 is another process)
    assert row["per_step"]["alloc"] == 20 and row["per_step"]["compute"] == 2.5
    assert row["per_step"]["offcpu"] == 2_000_000 and row["work_steps"] == 2
    # a minute later nothing is recent: no tokens/s, but the last steps' latency still shows
    later = stats.row(now + 60 * 10**9)
    assert later["tokens_per_s"] == 0 and later["p50_ms"] == pytest.approx(3.0)


def test_shadow_rows_are_no_traffic():
    """A shadow model's scores (llmobs.shadow: the reader's `shadow` column) of tokens already counted
    change neither the token count nor the latency or loss figures."""
    now = 100 * 10**9
    live = _columns(7, [1, 2, 3], [1.0, 2.0, 3.0], now)
    mixed = {k: (np.concatenate([v, v]) if isinstance(v, np.ndarray) else v + v) for k, v in live.items()}
    mixed["loss"] = np.concatenate([live["loss"], np.full(3, 50.0, np.float32)])
    mixed["shadow"] = np.array([False] * 3 + [True] * 3)
    plain, with_shadow = LiveStats(7), LiveStats(7)
    plain.add_steps(live)
    with_shadow.add_steps(mixed)
    assert with_shadow.row(now) == plain.row(now) and plain.row(now)["tokens"] == 3


def test_render_aligns_columns_and_marks_unknowns():
    rows = [
        {"pid": 1, "model_id": "m", "tenants": ["a"], "tokens": 1234, "tokens_per_s": 5.25, "p50_ms": 1.0,
         "p99_ms": 2.0, "mean_loss": 0.5, "per_step": {}, "drops": None, "source": "map (no agent)"},
    ]  # fmt: skip
    lines = top.render(rows).splitlines()
    assert lines[0].split()[:4] == ["PID", "MODEL", "TENANTS", "TOKENS"]
    cells = lines[1].split()
    assert cells[:8] == ["1", "m", "a", "1,234", "5.2", "1.00", "2.00", "0.500"]
    assert cells[8:13] == ["-"] * 5  # no agent: no work per step, no drops known


def _publish(writer: ShmWriter, count: int, latency_ns: int, loss: float) -> None:
    tenant = writer.name(layout.NAME_TENANT, "acme")
    model = writer.name(layout.NAME_MODEL, "m1")
    for i in range(count):
        block = torch.zeros((1, 7), dtype=torch.float32)
        block[0, 0] = loss
        block[0, 4:] = torch.tensor([[0, 5, 5]], dtype=torch.int32).view(torch.float32)
        end = clock.monotonic_ns()
        writer.publish_steps(
            block, step_seq=writer.begin_step(1, 2, tenant, 0), t_start=end - latency_ns, t_end=end,
            trace_hi=[1], trace_lo=[2], tenant_hash=tenant, session_hash=0, model_hash=model, step=i,
            position=np.array([10 + i]), batch_row=np.array([0]), kv_len=-1, flags=layout.FLAG_HAS_TARGET,
        )  # fmt: skip


def test_top_reads_a_real_map_when_no_agent_is_attached(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOBS_RUN_DIR", str(tmp_path / "run"))
    writer = ShmWriter(shm_dir=str(tmp_path), model_id="m1")
    try:
        _publish(writer, 20, 3_000_000, 1.5)
        view = top.Top(argparse.Namespace(pid=[os.getpid()], db=None), shm_dir=str(tmp_path))
        rows = view.rows()
        _publish(writer, 5, 3_000_000, 4.0)
        again = view.rows()  # the same watcher: only the new steps are read, the totals grow
        view.close()
    finally:
        writer.close()
    assert len(rows) == 1 and rows[0]["source"] == "map (no agent)"
    assert rows[0]["tokens"] == 20 and rows[0]["tenants"] == ["acme"] and rows[0]["model_id"] == "m1"
    assert rows[0]["p50_ms"] == pytest.approx(3.0) and rows[0]["mean_loss"] == pytest.approx(1.5)
    assert rows[0]["drops"] == 0 and rows[0]["tokens_per_s"] > 0
    assert again[0]["tokens"] == 25 and again[0]["mean_loss"] == pytest.approx((20 * 1.5 + 5 * 4.0) / 25)


def test_top_prefers_a_fresh_agent_snapshot_and_skips_stale_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOBS_RUN_DIR", str(tmp_path))
    stats = {"pid": 4242, "model_id": "m", "tenants": ["a"], "tokens": 9, "tokens_per_s": 3.0, "p50_ms": 1.0,
             "p99_ms": 1.0, "mean_loss": 1.0, "per_step": {"alloc": 7.0}, "work_steps": 3}  # fmt: skip
    fresh = {"agent_pid": os.getpid(), "pid": 4242, "db": str(tmp_path / "s.duckdb"), "stats": stats,
             "updated_ns": clock.monotonic_ns(), "drops": {"ring_drops": 2, "map_lost": 1}}  # fmt: skip
    write_snapshot(snapshot_path(4242), fresh)
    stale = {**fresh, "pid": 4343, "updated_ns": clock.monotonic_ns() - 60 * 10**9}
    write_snapshot(snapshot_path(4343), stale)
    assert [s["pid"] for s in read_snapshots()] == [4242]
    rows = top.Top(argparse.Namespace(pid=None, db=str(tmp_path / "s.duckdb"))).rows()
    assert len(rows) == 1 and rows[0]["source"] == f"agent {os.getpid()}" and rows[0]["drops"] == 3
    assert "7.0" in top.render(rows).splitlines()[1].split()


def test_top_reads_a_store_no_agent_is_writing(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOBS_RUN_DIR", str(tmp_path / "run"))
    db = tmp_path / "s.duckdb"
    end = 50 * 10**9
    columns = _columns(11, [2.0] * 9 + [20.0], [1.0] * 10, end)
    columns.update(trace_id=["ab" * 16] * 10, step=np.arange(10), session=["s"] * 10)
    with DuckDBStore(db) as store:
        store.append({"token_steps": columns})
        aggregates = {"pid": [11] * 10, "step_seq": list(range(1, 11)), "probe": ["alloc_cpu"] * 10,
                      "count": [4] * 10, "sum_value": [0] * 10, "sum_duration_ns": [0] * 10,
                      "ts_ns": [end] * 10}  # fmt: skip
        store.append({"probe_aggregates": aggregates})
        correlate(store.connection)
    rows = top.Top(argparse.Namespace(pid=None, db=str(db))).rows()
    assert len(rows) == 1 and rows[0]["pid"] == 11 and rows[0]["tokens"] == 10
    assert rows[0]["p50_ms"] == pytest.approx(2.0) and rows[0]["per_step"]["alloc"] == 4
    assert rows[0]["mean_loss"] == pytest.approx(1.0) and not math.isnan(rows[0]["tokens_per_s"])


def test_top_once_on_a_missing_pid_is_one_clear_error(capsys):
    from llmobs.cli import main

    assert main(["top", "--once", "--pid", "999999999"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: no process with pid 999999999") and "Traceback" not in err


def _cli(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    """The real entry point in a child, with a run directory of its own (no other agent's snapshot)."""
    env = {**os.environ, "LLMOBS_RUN_DIR": str(tmp_path / "run")}
    return subprocess.run(
        [sys.executable, "-m", "llmobs.cli", *argv], capture_output=True, text=True, timeout=60, env=env
    )


TOP_HINT = "hint: e.g. `llmobs-agent top --interval 0.5 --iterations 10`; see `llmobs-agent top --help`"


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--interval", "0"], "error: --interval must be a positive number of seconds, not 0"),
        (["--interval", "-1.5"], "error: --interval must be a positive number of seconds, not -1.5"),
        (["--interval", "nan"], "error: --interval must be a positive number of seconds, not nan"),
        (["--interval", "inf"], "error: --interval must be a positive number of seconds, not inf"),
        (["--iterations", "0"], "error: --iterations must be at least 1, not 0"),
    ],
)
def test_top_argument_mistakes_are_usage_errors_said_before_the_store_is_opened(tmp_path, argv, error):
    """Exit 2 with exactly one error and one hint line from the real CLI. The --db named does not exist,
    so a store error (11) would mean the arguments were checked too late."""
    absent = tmp_path / "absent.duckdb"
    result = _cli(tmp_path, "top", "--db", str(absent), *argv)
    assert (result.returncode, result.stdout) == (ExitCode.USAGE, "")
    assert result.stderr.splitlines() == [error, TOP_HINT]
    assert not absent.exists()


def test_top_on_a_missing_store_is_still_a_store_error_from_the_real_cli(tmp_path):
    """The control of the test above: valid arguments over a missing store exit 11, not 2."""
    absent = tmp_path / "absent.duckdb"
    result = _cli(tmp_path, "top", "--once", "--db", str(absent), "--interval", "0.5")
    assert (result.returncode, result.stdout) == (ExitCode.STORE_ERROR, "")
    error, hint = result.stderr.splitlines()
    assert error == f"error: no store at {absent}" and hint.startswith("hint: ")


def test_snapshot_files_are_json(tmp_path):
    path = tmp_path / "attach.1.json"
    write_snapshot(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1} and not list(tmp_path.glob(".*tmp"))


def test_a_snapshot_makes_its_directory_when_missing_and_again_after_removal(tmp_path):
    path = tmp_path / "run" / "llmobs" / "attach.1.json"
    write_snapshot(path, {"a": 1})
    shutil.rmtree(tmp_path / "run")
    write_snapshot(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2} and not list(path.parent.glob(".*tmp"))
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(NotADirectoryError):  # the caller's OSError: said once, snapshots stop
        write_snapshot(blocked / "attach.1.json", {"a": 3})
