"""NVML samples from the pipeline to a real DuckDB file (gpu_samples, the step_gpu join to token steps,
the migration of an older store), to `top` (snapshot and store) and to the OTLP gauges. The samples are
built as NvmlSource builds them (nvml_source.rows) at chosen times; NVML itself is stood in for in
test_nvml_source.py."""

from __future__ import annotations

import argparse
import os

import duckdb
import numpy as np
import pytest
from llmobs import clock
from llmobs.commands import top
from llmobs.gpu.nvml import DeviceSample, ProcessSample
from llmobs.gpu.nvml_source import rows
from llmobs.otlp.encoder import SpanIds
from llmobs.otlp.metrics import MetricsAggregator
from llmobs.otlp.source import ExportCursor
from llmobs.pipeline import Pipeline, ShmSource
from llmobs.store import schema
from llmobs.store.sink import DuckDBStore

PID = os.getpid()  # a live pid: the snapshot `top` reads must name a running agent (this test)
OTHER = 999_999
S = 1_000_000_000
UUID = "GPU-0000-h0"


def _steps(pid: int, ends: list[int], first_seq: int = 1) -> dict:
    n = len(ends)
    t_end = np.array(ends, np.int64)
    return {
        "pid": np.full(n, pid, np.int32), "step_seq": np.arange(first_seq, first_seq + n, dtype=np.int64),
        "trace_id": ["ab" * 16] * n, "batch_row": np.zeros(n, np.int32), "t_start_ns": t_end - 5_000_000,
        "t_end_ns": t_end, "latency_ns": np.full(n, 5_000_000, np.int64),
        "loss": np.full(n, 1.0, np.float32), "model_id": ["m"] * n, "tenant": ["acme"] * n,
    }  # fmt: skip


def _samples(pid: int, at: list[tuple[int, int, int]]) -> dict:
    """gpu_samples columns of `pid` on GPU 0: (ts_ns, sm_util or -1, process memory bytes) each."""
    devices = [DeviceSample(ts, 0, 90, 40, 8 << 30, 141 << 30) for ts, _, _ in at]
    processes = [ProcessSample(ts, 0, pid, sm, 10, mem) for ts, sm, mem in at]
    columns = [
        rows([d], [p], [(UUID, "NVIDIA H200")], {pid}) for d, p in zip(devices, processes, strict=True)
    ]
    return {k: _concat([c[k] for c in columns]) for k in columns[0]}


def _concat(parts: list):
    return np.concatenate(parts) if isinstance(parts[0], np.ndarray) else [x for p in parts for x in p]


@pytest.fixture
def t0() -> int:
    return clock.monotonic_ns()


def test_pipeline_stores_gpu_samples_that_step_gpu_joins_to_their_steps(tmp_path, monkeypatch, t0):
    monkeypatch.setenv("LLMOBS_RUN_DIR", str(tmp_path / "run"))
    db = tmp_path / "s.duckdb"
    store = DuckDBStore(db)
    # steps of PID ending: before any sample; 0.5 s after A; 0.2 s after B; 1.8 s after B (too far)
    store.append({"token_steps": _steps(PID, [t0 - S // 1000, t0 + S // 2, t0 + 1_400_000_000, t0 + 3 * S])})
    store.append({"token_steps": _steps(OTHER, [t0 + S // 2])})  # another process: not PID's samples
    pipeline = Pipeline(store, PID, shm=ShmSource(PID, shm_dir=str(tmp_path)), detector=None)
    pipeline.add_gpu_samples(_samples(PID, [(t0, 70, 3 << 30), (t0 + 1_200_000_000, 40, 2 << 30)]))
    pipeline.poll()  # the first poll writes the snapshot `top` reads

    view = top.Top(argparse.Namespace(pid=None, db=None), shm_dir=str(tmp_path))
    shown = [r for r in view.rows() if r["pid"] == PID]
    assert len(shown) == 1 and shown[0]["gpu_util_pct"] == 40 and shown[0]["gpu_mem_bytes"] == 2 << 30
    cells = top.render(shown).splitlines()[1].split()
    assert cells[-4:-2] == ["40", "2,048"]  # GPU %, GPU MiB, then the source ("agent N")

    summary = pipeline.close()
    assert summary.rows_by_table["gpu_samples"] == 2 and not summary.store_error
    store.close()
    con = duckdb.connect(str(db), read_only=True)
    stored = con.execute(
        "SELECT pid, gpu_index, gpu_uuid, gpu_name, sm_util, mem_util, mem_used, gpu_util, gpu_mem_util,"
        " device_mem_used, device_mem_total FROM gpu_samples ORDER BY ts_ns"
    ).fetchall()
    assert stored == [(PID, 0, UUID, "NVIDIA H200", 70, 10, 3 << 30, 90, 40, 8 << 30, 141 << 30),
                      (PID, 0, UUID, "NVIDIA H200", 40, 10, 2 << 30, 90, 40, 8 << 30, 141 << 30)]  # fmt: skip
    joined = con.execute("SELECT pid, step_seq, sample_ns, sm_util FROM step_gpu ORDER BY pid, step_seq")
    assert joined.fetchall() == [(PID, 2, t0, 70), (PID, 3, t0 + 1_200_000_000, 40)]
    con.close()


def test_top_shows_a_dash_for_a_target_without_gpu_samples(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOBS_RUN_DIR", str(tmp_path / "run"))
    store = DuckDBStore(tmp_path / "s.duckdb")
    pipeline = Pipeline(store, PID, shm=ShmSource(PID, shm_dir=str(tmp_path)), detector=None)
    pipeline.poll()
    shown = [r for r in top.Top(argparse.Namespace(pid=None, db=None), shm_dir=str(tmp_path)).rows()
             if r["pid"] == PID]  # fmt: skip
    pipeline.close()
    store.close()
    assert shown[0]["gpu_util_pct"] is None and shown[0]["gpu_mem_bytes"] is None
    assert top.render(shown).splitlines()[1].split()[-4:-2] == ["-", "-"]


def test_an_older_store_gets_gpu_samples_by_migration_and_top_reads_both(tmp_path, t0):
    old = tmp_path / "old.duckdb"
    conn = duckdb.connect(str(old))
    assert schema.migrate(conn, target=5)[-1] == 5  # a store written before gpu_samples existed
    conn.execute(
        "INSERT INTO token_steps (pid, step_seq, trace_id, t_start_ns, t_end_ns, latency_ns)"
        " VALUES (?, 1, '', ?, ?, 1)",
        [PID, t0 - 1, t0],
    )
    conn.close()
    (row,) = top.store_rows(old)  # read-only: not migrated, no GPU numbers, no error
    assert row["gpu_util_pct"] is None and row["gpu_mem_bytes"] is None and row["tokens"] == 1

    with DuckDBStore(old) as store:  # a writer opens it: migration 6 runs, the old rows stay
        assert schema.current_version(store.connection) == schema.LATEST_VERSION >= 6
        store.append({"gpu_samples": _samples(PID, [(t0 - S // 2, 55, 1 << 30)])})
        assert store.query("SELECT step_seq, sm_util FROM step_gpu").to_pylist() == [
            {"step_seq": 1, "sm_util": 55}
        ]
    (row,) = top.store_rows(old)
    assert row["gpu_util_pct"] == 55 and row["gpu_mem_bytes"] == 1 << 30


def test_otlp_gauges_carry_each_process_gpu_newest_sample(tmp_path, t0):
    store = DuckDBStore(tmp_path / "s.duckdb")
    store.append({"token_steps": _steps(PID, [t0, t0 + S])})
    # the newer sample has no utilisation figure: utilisation keeps A's, memory takes B's
    store.append({"gpu_samples": _samples(PID, [(t0 - S // 2, 70, 3 << 30), (t0 + S // 2, -1, 2 << 30)])})
    store.append({"gpu_samples": _samples(OTHER, [(t0, 10, 1 << 30)])})  # a process with no steps here
    batch = ExportCursor(store.connection.cursor()).next_batch(limit=100, max_events_per_span=64, flush=True)
    assert [(g["pid"], g["ts_ns"]) for g in batch.gpu_samples] == [(PID, t0 - S // 2), (PID, t0 + S // 2)]
    assert batch.only(lambda trace: False).gpu_samples == batch.gpu_samples  # trace sampling keeps gauges
    aggregator = MetricsAggregator(SpanIds(), 1000, 123, {"service.name": "llmobs"})
    aggregator.observe(batch)
    request = aggregator.encode(now_wall_ns=456)
    store.close()
    metrics = {m.name: m for m in request.resource_metrics[0].scope_metrics[0].metrics}
    util, memory = metrics["llmobs.gpu.utilization"], metrics["llmobs.gpu.memory.used"]
    assert (util.unit, memory.unit) == ("1", "By")
    (u,) = util.gauge.data_points
    (m,) = memory.gauge.data_points
    assert u.as_double == pytest.approx(0.70) and u.time_unix_nano == t0 - S // 2 + 1000
    assert m.as_double == 2 << 30 and m.time_unix_nano == t0 + S // 2 + 1000
    attrs = {kv.key: kv.value for kv in u.attributes}
    assert attrs["process.pid"].int_value == PID and attrs["llmobs.gpu.index"].int_value == 0
    assert attrs["llmobs.gpu.uuid"].string_value == UUID
