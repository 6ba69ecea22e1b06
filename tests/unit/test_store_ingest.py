"""The fast ring-record decoder: every field of every record reaches the right table unchanged, and the
store holds exactly what the eBPF layer's own records.md decoder (llmobs.bpf.output) produces."""

from __future__ import annotations

import numpy as np
import pytest
from llmobs.bpf.output import events_table
from llmobs.bpf.profiles import PROBES
from llmobs.bpf.records import EVENT_DTYPE, KINDS
from llmobs.store import DuckDBStore, ingest
from llmobs.store.ingest import EventDecoder

NAMES = [p.name for p in PROBES]
# scripts/setup.sh builds the C decoder and fails where it cannot; a pip install without a compiler
# decodes with numpy only
BACKENDS = ["c", "numpy"] if ingest.decoder_backend() == "c" else ["numpy"]
needs_c = pytest.mark.skipif(ingest.decoder_backend() != "c", reason="the C decoder is not built here")


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kinds", [None, 0, 2])
def test_decoded_records_land_exactly_as_the_records_md_decoder_says(tmp_path, kinds, backend):
    records = _records(5000, seed=4, kinds=kinds)
    decoded = EventDecoder(NAMES, sample_ratio=7, backend=backend).decode(records)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_parts_decode_exactly_as_their_concatenation(backend):
    # The writer decodes held drains together (no concatenation copy): same tables, same row order, as
    # one decode of the concatenated records, whatever the parts (a strided view, an empty drain).
    records = _records(3000, seed=11)
    strided = _records(1400, seed=12)[::2]
    parts = [records[:1000], np.zeros(0, dtype=EVENT_DTYPE), strided, records[1000:]]
    decoder = EventDecoder(NAMES, sample_ratio=3, backend=backend)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unknown_kind_goes_to_host_events_as_unknown(tmp_path, backend):
    records = _records(10, seed=5, kinds=0)
    records["kind"][3] = 9  # from a newer BPF program
    decoded = EventDecoder(NAMES, backend=backend).decode(records)
    assert decoded["mem_events"].num_rows == 9 and decoded["host_events"].num_rows == 1
    with DuckDBStore(tmp_path / "k.duckdb") as store:
        assert store.export(decoded).ok
        assert store.query("SELECT kind, ts_ns FROM host_events").to_pylist() == [
            {"kind": "unknown", "ts_ns": int(records["ts_ns"][3])}
        ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_probe_index_past_the_table_is_stored_as_unknown_not_lost(tmp_path, backend):
    # One record naming no probe of ours (a newer BPF program, a damaged record) used to fail the whole
    # batch's decode, and with it every event of the commit.
    records = _records(50, seed=6, kinds=0)
    records["probe"][[7, 8]] = [len(NAMES), 0xFFFF]
    decoded = EventDecoder(NAMES, backend=backend).decode(records)
    with DuckDBStore(tmp_path / "p.duckdb") as store:
        assert store.export(decoded).ok
        stored = store.query("SELECT ts_ns, probe FROM mem_events ORDER BY ts_ns").to_pylist()
    assert len(stored) == 50
    unknown = [row["ts_ns"] for row in stored if row["probe"] == "unknown"]
    assert unknown == sorted(int(records["ts_ns"][i]) for i in (7, 8))


@needs_c
def test_c_and_numpy_decoders_agree_on_every_bit_pattern():
    # Every field at random over its whole range (cpu past 16 bits, probe past 15, top bits set, every
    # kind byte), in parts of uneven sizes: the C decoder's tables equal numpy's column for column.
    rng = np.random.default_rng(21)
    raw = rng.integers(0, 256, size=(4099, EVENT_DTYPE.itemsize), dtype=np.uint8)
    records = raw.view(EVENT_DTYPE).reshape(-1)
    parts = [records[:1], records[1:2048], np.zeros(0, dtype=EVENT_DTYPE), records[2048:]]
    c = EventDecoder(NAMES, sample_ratio=5, backend="c").decode_parts(parts)
    by_numpy = EventDecoder(NAMES, sample_ratio=5, backend="numpy").decode_parts(parts)
    assert set(c) == set(by_numpy) == {"mem_events", "gpu_ops", "host_events"}
    for table, expected in by_numpy.items():
        assert c[table].schema == expected.schema, table
        for name in expected.schema.names:
            assert c[table].column(name).equals(expected.column(name)), (table, name)


@needs_c
def test_the_c_split_checks_every_size_before_it_writes():
    from llmobs.store import _event_split

    records = _records(100, seed=3, kinds=0)
    table_of_kind = np.zeros(256, dtype=np.int8)
    sizes = (4, 4, 2, 8, 8, 8, 8, 8, 8, 2, 1)

    def columns(rows):  # every table given `rows` rows of room, filled with a sentinel
        return tuple(tuple(np.full(rows * size, 0xAB, dtype=np.uint8) for size in sizes) for _ in range(3))

    assert _event_split.counts([records], table_of_kind) == (100, 0, 0)
    short = columns(99)  # one row too few for table 0
    with pytest.raises(ValueError, match="columns\\[0\\] \\(pid\\)"):
        _event_split.split([records], table_of_kind, short)
    assert all((column == 0xAB).all() for table in short for column in table)
    with pytest.raises(ValueError, match="whole 64-byte records"):
        _event_split.split([records.view(np.uint8)[:-8]], table_of_kind, columns(100))
    with pytest.raises(ValueError, match="there are 3 tables"):
        _event_split.counts([records], np.full(256, 3, dtype=np.int8))
    with pytest.raises(ValueError, match="256 bytes"):
        _event_split.counts([records], np.zeros(255, dtype=np.int8))
    with pytest.raises(TypeError):
        _event_split.split([records], table_of_kind, columns(100)[:2])
    readonly = np.zeros(100 * 4, dtype=np.uint8)
    readonly.flags.writeable = False
    with pytest.raises((TypeError, BufferError, ValueError)):
        _event_split.split([records], table_of_kind, ((readonly,) + columns(100)[0][1:],) + columns(100)[1:])
    fits = columns(100)
    _event_split.split([records], table_of_kind, fits)
    assert fits[0][0].view("<i4").tolist() == records["pid"].astype("<i4").tolist()


def test_a_record_layout_the_c_decoder_does_not_read_falls_back_to_numpy():
    # The same fields in another order: the C module's offsets no longer match, so it must not be used.
    moved = np.dtype([(name, EVENT_DTYPE.fields[name][0]) for name in reversed(EVENT_DTYPE.names)])
    assert EventDecoder(NAMES, dtype=moved).backend == "numpy"
    with pytest.raises(ValueError, match="C decoder"):
        EventDecoder(NAMES, dtype=moved, backend="c")
    with pytest.raises(ValueError, match="backend"):
        EventDecoder(NAMES, backend="rust")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_thinned_probes_tagged_events_stand_for_thin_events_each(backend):
    """probes.thin: the kernel ships 1 in `thin` of page_fault_user's and linear's tagged events, so each of
    those carries sample_ratio x thin; their untagged events (all shipped) and other probes keep
    sample_ratio; with thin 1 nothing changes."""
    fault, linear, sgemm = NAMES.index("page_fault_user"), NAMES.index("linear"), NAMES.index("sgemm")
    records = _records(8, seed=9, kinds=2)
    records["probe"] = [fault, fault, fault, linear, linear, sgemm, sgemm, fault]
    records["step_seq"] = [5, 0, 6, 5, 0, 7, 0, 0]
    for thin in (64, 5, 1):
        decoded = EventDecoder(NAMES, sample_ratio=3, backend=backend, thin=thin).decode(records)
        for table in (decoded["host_events"], events_table(records, 3, thin)):
            assert table.column("sample_ratio").to_pylist() == [3 * thin, 3, 3 * thin, 3 * thin, 3, 3, 3, 3]
