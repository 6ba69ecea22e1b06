"""Event batches -> Parquet columns (records.md names), aggregates table, companion paths."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
from llmobs.bpf.output import ParquetEventWriter, aggregates_table, companion_paths, events_table
from llmobs.bpf.profiles import PROBE_IDS
from llmobs.bpf.records import EVENT_DTYPE


def _events(n):
    events = np.zeros(n, dtype=EVENT_DTYPE)
    events["pid"] = 11
    events["tid"] = np.arange(n)
    events["probe"] = PROBE_IDS["sgemm"]
    events["kind"] = 3
    events["step_seq"] = np.arange(n) % 3
    events["trace_id_hi"] = np.where(events["step_seq"] == 0, 0, 0xABC)
    events["trace_id_lo"] = events["step_seq"]
    events["value"] = 100
    return events


def test_events_table_columns():
    table = events_table(_events(6), sample_ratio=4)
    assert table.column_names == [
        "pid",
        "tid",
        "cpu",
        "ts_ns",
        "probe",
        "kind",
        "step_seq",
        "trace_id",
        "value",
        "duration_ns",
        "sample_ratio",
    ]
    rows = table.to_pylist()
    assert {row["probe"] for row in rows} == {"sgemm"} and {row["kind"] for row in rows} == {"compute"}
    assert rows[0]["trace_id"] == "" and rows[1]["trace_id"] == "0000000000000abc0000000000000001"
    assert {row["sample_ratio"] for row in rows} == {4}


def test_codes_past_the_tables_are_unknown_not_a_failed_batch():
    # a newer BPF program's probe or kind, a damaged record: that event says "unknown", the rest of the
    # batch is written as ever (before, `take` failed and with it the whole batch)
    events = _events(4)
    events["probe"][1] = 0xFFFF
    events["kind"][2] = 200
    rows = events_table(events, sample_ratio=1).to_pylist()
    assert [row["probe"] for row in rows] == ["sgemm", "unknown", "sgemm", "sgemm"]
    assert [row["kind"] for row in rows] == ["compute", "compute", "unknown", "compute"]


def test_writer_roundtrip(tmp_path):
    path, aggs, summary = companion_paths(tmp_path / "out.parquet")
    assert aggs.name == "out.aggregates.parquet" and summary.name == "out.summary.json"
    writer = ParquetEventWriter(path, sample_ratio=1)
    for _ in range(5):
        writer.submit(_events(1000))
    writer.submit(_events(0))
    writer.close()
    assert writer.written == 5000 and writer.dropped == 0
    assert pq.read_table(path).num_rows == 5000


def test_writer_drops_and_counts_when_full(tmp_path):
    writer = ParquetEventWriter(tmp_path / "x.parquet", sample_ratio=1, max_batches=1)
    for _ in range(200):
        writer.submit(_events(10))
    writer.close()
    assert writer.written + writer.dropped == 2000
    assert pq.read_table(tmp_path / "x.parquet").num_rows == writer.written


def test_aggregates_table():
    table = aggregates_table(
        {(5, PROBE_IDS["alloc_cpu"], 2): [3, 300, 30], (5, PROBE_IDS["sgemm"], 1): [1, 2, 3]}
    )
    assert table.to_pylist() == [
        {"pid": 5, "step_seq": 1, "probe": "sgemm", "count": 1, "sum_value": 2, "sum_duration_ns": 3},
        {"pid": 5, "step_seq": 2, "probe": "alloc_cpu", "count": 3, "sum_value": 300, "sum_duration_ns": 30},
    ]
