"""Batch writes into the map's CUPTI ring, from the drain thread: one numpy pass per batch instead of
one ShmWriter.publish_cupti call per record (about half the cost per record here, see
bench/cupti_drain.py), and the CUPTI -> CLOCK_MONOTONIC conversion done on whole columns.

The ring protocol is the writer's (shm/writer.py, layout.CUPTI_RECORD): every claimed slot's seq word
reads 2*pos+1 before any of its fields change and 2*pos+2 only after all of them are written, and the
header's cupti_head is advanced after the odd marks; so a reader sees each record either committed
whole or in progress, never torn. Claims are serialised with the writer's own lock, so records written
here and by publish_cupti (the markers) never share a slot.
"""

from __future__ import annotations

import numpy as np
from llmobs.shm import layout

_HEAD_WORD = layout.HEADER.offsets["cupti_head"] // 8
_FIELDS = ("step_seq", "start_ns", "end_ns", "correlation_id", "name_hash", "kind", "device_id", "stream_id")


class CuptiRing:
    """The CUPTI ring of one ShmWriter, written in batches."""

    def __init__(self, writer):
        self.writer = writer
        self.cap = writer.cupti_capacity
        self.ring = np.ndarray(
            (self.cap,), layout.CUPTI_RECORD.dtype, buffer=writer.mm, offset=writer.cupti_offset
        )

    def publish(self, records: list[tuple], fit=None) -> int:
        """Write records (step_seq, start, end, correlation_id, name_hash, kind, device_id, stream_id);
        start/end are CUPTI ns mapped with `fit` (a clock.ClockFit) when given. Returns how many."""
        n = len(records)
        if not n:
            return 0
        cols = np.array(records, dtype=np.uint64).T
        batch = np.zeros(n, layout.CUPTI_RECORD.dtype)
        for name, col in zip(_FIELDS, cols, strict=True):
            batch[name] = col
        if fit is not None:
            start = to_monotonic(cols[1], fit)
            batch["start_ns"] = start
            batch["end_ns"] = start + (cols[2] - cols[1])  # durations as CUPTI measured them
        for lo in range(0, n, self.cap):  # more than the ring holds: the older part is overwritten anyway
            self._write(batch[lo : lo + self.cap])
        return n

    def _write(self, batch: np.ndarray) -> None:
        w, ring, cap = self.writer, self.ring, self.cap
        n = len(batch)
        with w._lock:
            pos = w.cupti_head
            positions = np.arange(pos, pos + n, dtype=np.uint64)
            slots = (positions & np.uint64(cap - 1)).astype(np.int64)
            ring["seq"][slots] = 2 * positions + 1  # in progress, before anything else changes
            w.cupti_head = pos + n
            w.words[_HEAD_WORD] = w.cupti_head
            batch["seq"] = 2 * positions + 1
            ring[slots] = batch
            ring["seq"][slots] = 2 * positions + 2  # committed


def to_monotonic(cupti_ns: np.ndarray, fit) -> np.ndarray:
    """ClockFit.to_monotonic_ns on a column, exact in integers where it matters: the ~1e18-sized base
    is removed before the float division by the slope."""
    base = np.uint64((fit.ref_mono_ns + fit.offset_ns) & ((1 << 64) - 1))
    delta = (cupti_ns.astype(np.uint64) - base).view(np.int64)  # two's complement: negative deltas too
    slope = 1.0 + fit.drift_ppm * 1e-6
    return (np.int64(fit.ref_mono_ns) + np.rint(delta / slope).astype(np.int64)).astype(np.uint64)
