"""Ring records (llmobs.bpf.records.EVENT_DTYPE) -> the store's append form, fast: one batch of tables.

Why not the records.md decoded form (trace_id as 32 hex chars, probe/kind as plain strings): strings are
what makes appends slow (measured: a 32-char trace id per event halves DuckDB's append rate). This
decoder keeps the trace id as its two uint64 words, hands probe names as a dictionary (one string per
distinct probe, not per event) and groups events by table in numpy (one radix sort and one gather), so
each table gets one plain scan.

Two backends, to the same columns: the C module llmobs.store._event_split (store/c/event_split.c) reads
each record once and writes each field straight into its table's column, with the GIL released; without
it (no compiler at install) numpy transposes the records into a matrix of 8-byte words once, after which
every field is a contiguous (or 2-/4-strided) slice of one word row, and sorts that matrix by table.
Measured on this project's VM (bench.ingest's decode, the drain's copy included, five interleaved
rounds): 20.6 M events/s with C, 14.1 M with numpy (49 vs 71 ns an event).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from llmobs.bpf.records import EVENT_DTYPE, KINDS, sample_ratios, thinned_ids

try:
    from llmobs.store import _event_split
except ImportError:  # not built (no compiler at install): the numpy path decodes the same columns
    _event_split = None

_WORD = 8
# The store table each kind index (LLMOBS_KIND_*) goes to.
_PLAIN_COLUMNS = ("pid", "tid", "cpu", "ts_ns", "step_seq", "trace_hi", "trace_lo", "value", "duration_ns")
_TABLE_OF_KIND = {"mem": "mem_events", "gpu": "gpu_ops", "host": "host_events", "compute": "host_events"}
_TABLES = ("mem_events", "gpu_ops", "host_events")
# The columns event_split.c's split() fills, in its order, with the types the numpy path gives them.
_SPLIT_COLUMNS = (
    ("pid", "<i4"), ("tid", "<i4"), ("cpu", "<i2"), ("ts_ns", "<i8"), ("step_seq", "<i8"),
    ("trace_hi", "<u8"), ("trace_lo", "<u8"), ("value", "<i8"), ("duration_ns", "<i8"),
    ("probe", "<i2"), ("kind", "i1"),
)  # fmt: skip


def _c_reads(dtype: np.dtype) -> bool:
    """Whether the C module is built and reads `dtype`'s records: its fields at the same offsets and
    sizes (a record layout changed in Python but not in C must fall back, never misread)."""
    if _event_split is None or dtype.itemsize != 64:
        return False
    fields = tuple((name, dtype.fields[name][1], dtype.fields[name][0].itemsize) for name in dtype.names)
    return fields == tuple(_event_split.layout())


def decoder_backend() -> str:
    """Which decoder EventDecoder uses for ring records: "c" or "numpy" (doctor shows it)."""
    return "c" if _c_reads(EVENT_DTYPE) else "numpy"


def _field_slicer(dtype: np.dtype, name: str):
    """How to read field `name` out of the transposed word matrix: (word row, numpy type, start, step)."""
    field_dtype, offset = dtype.fields[name][:2]
    size = field_dtype.itemsize
    if offset // _WORD != (offset + size - 1) // _WORD:
        raise ValueError(f"field {name} straddles an 8-byte word; the fast decoder cannot slice it")
    return offset // _WORD, field_dtype, (offset % _WORD) // size, _WORD // size


class EventDecoder:
    """Decodes arrays of EVENT_DTYPE into {table: pyarrow.Table} for DuckDBStore.export."""

    def __init__(
        self,
        probe_names: Sequence[str],
        dtype: np.dtype = EVENT_DTYPE,
        sample_ratio: int = 1,
        backend: str | None = None,
        thin: int = 1,
    ):
        if dtype.itemsize % _WORD:
            raise ValueError("event records must be a whole number of 8-byte words")
        if backend not in (None, "c", "numpy"):
            raise ValueError(f"backend must be 'c' or 'numpy', not {backend!r}")
        c_reads = _c_reads(dtype)
        if backend == "c" and not c_reads:
            raise ValueError("the C decoder is not built, or does not read these records")
        self.backend = backend or ("c" if c_reads else "numpy")  # None: C where it reads these records
        self.dtype = dtype
        self.sample_ratio = sample_ratio
        self.thin = thin  # the program's probes.thin: its thinned probes' tagged events stand for `thin`
        self._words = dtype.itemsize // _WORD
        # A probe index past the agent's table (a newer BPF program, a damaged record) is stored as
        # "unknown": left as it was, it failed the dictionary's check and with it the whole commit.
        self._probe_names = pa.array([*probe_names, "unknown"], pa.string())
        self._unknown_probe = np.uint16(len(probe_names))
        self._thinned = thinned_ids(probe_names)
        self._kind_names = pa.array([*KINDS, "unknown"], pa.string())
        self._fields = {name: _field_slicer(dtype, name) for name in dtype.names}
        # kind index (LLMOBS_KIND_*) -> index into _TABLES; an unknown kind goes to host_events, as in
        # DuckDBStore's routing of records.md batches.
        self._table_of_kind = np.full(256, _TABLES.index("host_events"), dtype=np.int8)
        for kind_index, kind_name in enumerate(KINDS):
            self._table_of_kind[kind_index] = _TABLES.index(_TABLE_OF_KIND[kind_name])

    def _column(self, words: np.ndarray, name: str, as_type: str) -> np.ndarray:
        row, field_dtype, start, step = self._fields[name]
        values = words[row].view(field_dtype)[start::step]
        return (
            values.view(as_type)
            if np.dtype(as_type).itemsize == field_dtype.itemsize
            else values.astype(as_type)
        )

    def decode(self, events: np.ndarray) -> dict[str, pa.Table]:
        return self.decode_parts([events])

    def decode_parts(self, parts: Sequence[np.ndarray]) -> dict[str, pa.Table]:
        """Several arrays of records decoded as one, their events in order: each is transposed straight
        into its slice of the one word matrix, so decoding held drains together costs no concatenation
        copy (measured, 1 M events in drains of 20k: np.concatenate first cost ~55 ms, as much as the
        whole decode of the drains one by one; the transpose into slices costs what one transpose does)."""
        for events in parts:
            if events.dtype != self.dtype:
                raise TypeError(f"expected records of {self.dtype}, got {events.dtype}")
        total = sum(len(events) for events in parts)
        if not total:
            return {}
        if self.backend == "c":
            return self._decode_c(parts)
        words = np.empty((self._words, total), dtype="<u8")
        start = 0
        for events in parts:
            words[:, start : start + len(events)] = (
                np.ascontiguousarray(events).view("<u8").reshape(len(events), self._words).T
            )
            start += len(events)
        table_index = self._table_of_kind[self._column(words, "kind", "i1")]
        counts = np.bincount(table_index, minlength=len(_TABLES))
        if np.count_nonzero(counts) > 1:
            # Group the events by destination table with one stable (radix) sort of a small int and one
            # gather of the word matrix; each table is then a contiguous slice. Measured: ~5x cheaper
            # than a boolean mask per column per table.
            words = words.take(np.argsort(table_index, kind="stable"), axis=1)
        columns = {
            "pid": self._column(words, "pid", "<i4"),
            "tid": self._column(words, "tid", "<i4"),
            "cpu": self._column(words, "cpu", "<i2"),
            "ts_ns": self._column(words, "ts_ns", "<i8"),
            "step_seq": self._column(words, "step_seq", "<i8"),
            "trace_hi": self._column(words, "trace_id_hi", "<u8"),
            "trace_lo": self._column(words, "trace_id_lo", "<u8"),
            "value": self._column(words, "value", "<i8"),
            "duration_ns": self._column(words, "duration_ns", "<i8"),
            "probe": self._column(words, "probe", "<i2"),
            "kind": self._column(words, "kind", "i1"),
        }
        out: dict[str, pa.Table] = {}
        start = 0
        for index, count in enumerate(counts.tolist()):
            if count:
                part = {name: values[start : start + count] for name, values in columns.items()}
                out[_TABLES[index]] = self._table(part, with_kind=_TABLES[index] == "host_events")
                start += count
        return out

    def _decode_c(self, parts: Sequence[np.ndarray]) -> dict[str, pa.Table]:
        """decode_parts by event_split.c: count each table's records, then fill fresh columns of those
        sizes in one pass (the C checks every size again before writing)."""
        buffers = [np.ascontiguousarray(events) for events in parts]
        counts = _event_split.counts(buffers, self._table_of_kind)
        columns = [
            {name: np.empty(count, dtype) for name, dtype in _SPLIT_COLUMNS} if count else None
            for count in counts
        ]
        empty = tuple(np.empty(0, dtype) for _, dtype in _SPLIT_COLUMNS)
        _event_split.split(
            buffers,
            self._table_of_kind,
            tuple(tuple(table.values()) if table else empty for table in columns),
        )
        return {
            _TABLES[index]: self._table(table, with_kind=_TABLES[index] == "host_events")
            for index, table in enumerate(columns)
            if table
        }

    def _table(self, part: dict[str, np.ndarray], with_kind: bool) -> pa.Table:
        arrays = {name: pa.array(part[name]) for name in _PLAIN_COLUMNS}
        probes = part["probe"].view(np.uint16)  # this decode's own array: clamped in place
        np.minimum(probes, self._unknown_probe, out=probes)
        arrays["probe"] = pa.DictionaryArray.from_arrays(pa.array(part["probe"]), self._probe_names)
        ratios = sample_ratios(probes, part["step_seq"], self.sample_ratio, self.thin, self._thinned)
        arrays["sample_ratio"] = pa.array(ratios)
        if with_kind:
            # A kind this agent does not know (a newer BPF program) must not index past the dictionary.
            kinds = np.minimum(part["kind"].view(np.uint8), len(KINDS)).astype(np.int8)
            arrays["kind"] = pa.DictionaryArray.from_arrays(pa.array(kinds), self._kind_names)
        return pa.table(arrays)
