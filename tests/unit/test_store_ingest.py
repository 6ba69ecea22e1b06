"""The fast ring-record decoder: every field of every record reaches the right table unchanged, and the
store holds exactly what the eBPF layer's own records.md decoder (llmobs.bpf.output) produces."""

from __future__ import annotations

import numpy as np
import pytest
from llmobs.bpf.output import events_table
from llmobs.bpf.profiles import PROBES
from llmobs.bpf.records import EVENT_DTYPE, KINDS
from llmobs.store import DuckDBStore
from llmobs.store.ingest import EventDecoder

NAMES = [p.name for p in PROBES]


def _records(n, seed, kinds=None):
    rng = np.random.default_rng(seed)
    ev = np.zeros(n, dtype=EVENT_DTYPE)
    ev["pid"] = rng.integers(1, 4_000_000, size=n)
    ev["tid"] = ev["pid"] + rng.integers(0, 3, size=n)
    ev["cpu"] = rng.integers(0, 64, size=n)
    ev["probe"] = rng.integers(0, len(NAMES), size=n)
    ev["kind"] = rng.integers(0, len(KINDS), size=n) if kinds is None else kinds
    ev["flags"] = 1
    ev["ts_ns"] = np.sort(rng.integers(10**12, 2 * 10**12, size=n))
    ev["step_seq"] = rng.integers(0, 10**6, size=n)
    ev["trace_id_hi"] = rng.integers(0, 2**63, size=n, dtype=np.int64).astype(np.uint64) * np.uint64(2)
    ev["trace_id_lo"] = rng.integers(0, 2**63, size=n, dtype=np.int64).astype(np.uint64) + np.uint64(2**63)
    ev["trace_id_hi"][:5] = 0  # untracked events carry a zero trace id
    ev["trace_id_lo"][:5] = 0
    ev["value"] = rng.integers(0, 2**40, size=n)
    ev["duration_ns"] = rng.integers(0, 10**6, size=n)
    return ev


_SELECT = """
    SELECT pid, tid, cpu, ts_ns, probe, kind, step_seq, trace_id, value, duration_ns, sample_ratio FROM (
        SELECT *, 'mem' AS kind, trace_hex(trace_hi, trace_lo) AS trace_id FROM mem_events
        UNION ALL BY NAME SELECT *, 'gpu' AS kind, trace_hex(trace_hi, trace_lo) AS trace_id FROM gpu_ops
        UNION ALL BY NAME SELECT *, trace_hex(trace_hi, trace_lo) AS trace_id FROM host_events)
    ORDER BY ts_ns, pid, probe, step_seq
"""


@pytest.mark.parametrize("kinds", [None, 0, 2])
def test_decoded_records_land_exactly_as_the_records_md_decoder_says(tmp_path, kinds):
    records = _records(5000, seed=4, kinds=kinds)
    decoded = EventDecoder(NAMES, sample_ratio=7).decode(records)
    table_of_kind = ("mem_events", "gpu_ops", "host_events", "host_events")
    expected_tables = {table_of_kind[k] for k in np.unique(records["kind"])}
    assert set(decoded) == expected_tables
    with DuckDBStore(tmp_path / "i.duckdb") as store:
        result = store.export(decoded)
        assert result.ok, result.error
        assert result.rows == len(records)
        stored = store.query(_SELECT).to_pylist()
    reference = events_table(records, sample_ratio=7).to_pylist()
    reference.sort(key=lambda r: (r["ts_ns"], r["pid"], r["probe"], r["step_seq"]))
    assert stored == reference


def test_decoder_rejects_other_record_layouts():
    with pytest.raises(TypeError):
        EventDecoder(NAMES).decode(np.zeros(3, dtype=[("a", "<u8")]))
    assert EventDecoder(NAMES).decode(np.zeros(0, dtype=EVENT_DTYPE)) == {}


def test_parts_decode_exactly_as_their_concatenation():
    # The writer decodes held drains together (no concatenation copy): same tables, same row order, as
    # one decode of the concatenated records, whatever the parts (a strided view, an empty drain).
    records = _records(3000, seed=11)
    strided = _records(1400, seed=12)[::2]
    parts = [records[:1000], np.zeros(0, dtype=EVENT_DTYPE), strided, records[1000:]]
    decoder = EventDecoder(NAMES, sample_ratio=3)
    together = decoder.decode_parts(parts)
    concatenated = decoder.decode(np.concatenate(parts))
    assert set(together) == set(concatenated) == {"mem_events", "gpu_ops", "host_events"}
    for table, expected in concatenated.items():
        assert together[table].equals(expected), table
    assert decoder.decode_parts([np.zeros(0, dtype=EVENT_DTYPE)] * 2) == {}
    with pytest.raises(TypeError):
        decoder.decode_parts([records, np.zeros(3, dtype=[("a", "<u8")])])


def test_the_bpf_layers_own_tables_append_as_they_are(tmp_path):
    # What `attach --out` writes today (records.md columns, unsigned types, hex trace ids) goes in unchanged.
    from llmobs.bpf.output import aggregates_table

    records = _records(2000, seed=9)
    totals = {(5, 1, 7): [10, 4096, 0], (5, 2, 7): [3, 0, 0], (5, 1, 0): [2, 64, 0]}
    with DuckDBStore(tmp_path / "b.duckdb") as store:
        assert store.export({"events": events_table(records, sample_ratio=3)}).ok
        assert store.export({"probe_aggregates": aggregates_table(totals)}).ok
        assert sum(store.count(t) for t in ("mem_events", "gpu_ops", "host_events")) == 2000
        rows = store.query("SELECT pid, step_seq, probe, count, sum_value FROM probe_aggregates ORDER BY ALL")
        assert rows.to_pylist() == [
            {"pid": 5, "step_seq": 0, "probe": NAMES[1], "count": 2, "sum_value": 64},
            {"pid": 5, "step_seq": 7, "probe": NAMES[1], "count": 10, "sum_value": 4096},
            {"pid": 5, "step_seq": 7, "probe": NAMES[2], "count": 3, "sum_value": 0},
        ]


def test_an_unknown_kind_goes_to_host_events_as_unknown(tmp_path):
    records = _records(10, seed=5, kinds=0)
    records["kind"][3] = 9  # from a newer BPF program
    decoded = EventDecoder(NAMES).decode(records)
    assert decoded["mem_events"].num_rows == 9 and decoded["host_events"].num_rows == 1
    with DuckDBStore(tmp_path / "k.duckdb") as store:
        assert store.export(decoded).ok
        assert store.query("SELECT kind, ts_ns FROM host_events").to_pylist() == [
            {"kind": "unknown", "ts_ns": int(records["ts_ns"][3])}
        ]
