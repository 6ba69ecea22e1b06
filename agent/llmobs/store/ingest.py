"""Ring records (llmobs.bpf.records.EVENT_DTYPE) -> the store's append form, fast: one batch of tables.

Why not the records.md decoded form (trace_id as 32 hex chars, probe/kind as plain strings): strings are
what makes appends slow (measured: a 32-char trace id per event halves DuckDB's append rate). This
decoder keeps the trace id as its two uint64 words, hands probe names as a dictionary (one string per
distinct probe, not per event) and splits events by kind in numpy (a mask per kind present), so each
table gets one plain scan.

The columns come out of the records by one transpose: the records are viewed as rows of 8-byte words
and transposed once, after which every field is a contiguous (or 2-/4-strided) slice of one word row,
instead of a strided gather per field.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from llmobs.bpf.records import EVENT_DTYPE, KINDS

_WORD = 8
# The store table each kind index (LLMOBS_KIND_*) goes to.
_PLAIN_COLUMNS = ("pid", "tid", "cpu", "ts_ns", "step_seq", "trace_hi", "trace_lo", "value", "duration_ns")
_TABLE_OF_KIND = {"mem": "mem_events", "gpu": "gpu_ops", "host": "host_events", "compute": "host_events"}


def _field_slicer(dtype: np.dtype, name: str):
    """How to read field `name` out of the transposed word matrix: (word row, numpy type, start, step)."""
    field_dtype, offset = dtype.fields[name][:2]
    size = field_dtype.itemsize
    if offset // _WORD != (offset + size - 1) // _WORD:
        raise ValueError(f"field {name} straddles an 8-byte word; the fast decoder cannot slice it")
    return offset // _WORD, field_dtype, (offset % _WORD) // size, _WORD // size


class EventDecoder:
    """Decodes arrays of EVENT_DTYPE into {table: pyarrow.Table} for DuckDBStore.export."""

    def __init__(self, probe_names: Sequence[str], dtype: np.dtype = EVENT_DTYPE, sample_ratio: int = 1):
        if dtype.itemsize % _WORD:
            raise ValueError("event records must be a whole number of 8-byte words")
        self.dtype = dtype
        self.sample_ratio = sample_ratio
        self._words = dtype.itemsize // _WORD
        self._probe_names = pa.array(list(probe_names), pa.string())
        self._kind_names = pa.array(list(KINDS), pa.string())
        self._fields = {name: _field_slicer(dtype, name) for name in dtype.names}

    def _column(self, words: np.ndarray, name: str, as_type: str) -> np.ndarray:
        row, field_dtype, start, step = self._fields[name]
        values = words[row].view(field_dtype)[start::step]
        return (
            values.view(as_type)
            if np.dtype(as_type).itemsize == field_dtype.itemsize
            else values.astype(as_type)
        )

    def decode(self, events: np.ndarray) -> dict[str, pa.Table]:
        if events.dtype != self.dtype:
            raise TypeError(f"expected records of {self.dtype}, got {events.dtype}")
        if not len(events):
            return {}
        words = np.ascontiguousarray(events).view("<u8").reshape(len(events), self._words).T.copy()
        probe = self._column(words, "probe", "<i2")
        kind = self._column(words, "kind", "i1")
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
            "probe": probe,
            "kind": kind,
        }
        present = np.flatnonzero(np.bincount(kind.astype(np.uint8), minlength=len(KINDS)))
        out: dict[str, list[pa.Table]] = {}
        for kind_index in present.tolist():
            if len(present) == 1:
                part = columns  # the common case (one profile's events): no copy at all
            else:  # a sequential compress per column: much cheaper than sorting 64-byte records
                mask = kind == kind_index
                part = {name: values[mask] for name, values in columns.items()}
            table_name = _TABLE_OF_KIND[KINDS[kind_index]]
            out.setdefault(table_name, []).append(self._table(part, with_kind=table_name == "host_events"))
        return {name: parts[0] if len(parts) == 1 else pa.concat_tables(parts) for name, parts in out.items()}

    def _table(self, part: dict[str, np.ndarray], with_kind: bool) -> pa.Table:
        arrays = {name: pa.array(part[name]) for name in _PLAIN_COLUMNS}
        arrays["probe"] = pa.DictionaryArray.from_arrays(pa.array(part["probe"]), self._probe_names)
        arrays["sample_ratio"] = pa.array(np.full(len(part["probe"]), self.sample_ratio, dtype=np.int32))
        if with_kind:
            arrays["kind"] = pa.DictionaryArray.from_arrays(pa.array(part["kind"]), self._kind_names)
        return pa.table(arrays)
