"""What the CUPTI ring carries besides activity records: the collector's marker records, and the
activity kinds as plain ints, so the agent side decodes the ring without importing cupti-python.

A CUPTI ring record (llmobs_cupti_record, shm/layout.py) is an activity record when `kind` is a CUPTI
activity kind (< 2**16). Kinds from MARKER_BASE up are the collector talking to the agent in-band, in
the same ring and therefore in order with the records they describe:

  MARK_STATUS  why a collection was refused or failed: device_id = the LLMOBS_ACK_* status,
               name_hash = name-table hash of a one-line reason, step_seq = the step it happened at.
  MARK_CLOCK   the CUPTI -> CLOCK_MONOTONIC fit used for this collection: start_ns = ref_mono_ns,
               end_ns = offset_ns (two's complement), correlation_id = RMS residual in ns (rounded up),
               name_hash = IEEE-754 bits of drift_ppm, device_id = samples kept, stream_id = worst
               residual in ns (saturated at 2**32-1).
  MARK_END     the collection is over and everything it produced precedes this record in the ring:
               step_seq = last step collected, start_ns = first step collected, end_ns = activity
               records written, correlation_id = records CUPTI dropped, name_hash = records the
               collector dropped (queue full, unresolved when the ring wrote them is NOT a drop),
               device_id = records with no step (no external correlation), stream_id = 1 if CUPTI
               was lost to another owner mid-way, else 0.

The agent treats MARK_END as the collector's acknowledgement that the K steps are flushed; the
control block's done_step_seq only says the K steps have run.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

# CUPTI_ACTIVITY_KIND_* values (cupti.ActivityKind); stable across CUPTI 12 and 13.
KIND_MEMCPY = 1
KIND_MEMSET = 2
KIND_KERNEL = 3
KIND_DRIVER = 4
KIND_RUNTIME = 5
KIND_CONCURRENT_KERNEL = 10
KIND_SYNCHRONIZATION = 38
KIND_EXTERNAL_CORRELATION = 39
KIND_MEMORY2 = 49

# The kinds the collector enables (never GRAPH_TRACE: it replaces per-kernel records of graph
# launches by one record per graph, which would hide the kernels we want per step).
ENABLED_KINDS = (
    KIND_CONCURRENT_KERNEL,
    KIND_MEMCPY,
    KIND_MEMSET,
    KIND_MEMORY2,
    KIND_RUNTIME,
    KIND_DRIVER,
    KIND_SYNCHRONIZATION,
    KIND_EXTERNAL_CORRELATION,
)
KERNEL_KINDS = frozenset({KIND_KERNEL, KIND_CONCURRENT_KERNEL})
DEVICE_KINDS = frozenset({KIND_KERNEL, KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET})  # GPU time
API_KINDS = frozenset({KIND_RUNTIME, KIND_DRIVER})

KIND_NAMES = {
    KIND_MEMCPY: "memcpy",
    KIND_MEMSET: "memset",
    KIND_KERNEL: "kernel",
    KIND_DRIVER: "driver",
    KIND_RUNTIME: "runtime",
    KIND_CONCURRENT_KERNEL: "kernel",
    KIND_SYNCHRONIZATION: "sync",
    KIND_MEMORY2: "memory",
}

# CUpti_ExternalCorrelationKind: CUSTOM2, so PyTorch's profiler (which uses CUSTOM0/1 and
# UNKNOWN) never sees or pops our ids.
EXTERNAL_KIND_CUSTOM2 = 5

MARKER_BASE = 0x4C4C0000  # "LL" in the high half: far above any CUPTI activity kind
MARK_STATUS = MARKER_BASE + 1
MARK_CLOCK = MARKER_BASE + 2
MARK_END = MARKER_BASE + 3
NO_DEVICE = 0xFFFFFFFF  # device_id of records that belong to no device (API calls)

_U64_MASK = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1


def is_marker(kind: int) -> bool:
    return kind >= MARKER_BASE


def f64_bits(value: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def bits_f64(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits & _U64_MASK))[0]


def to_u64(value: int) -> int:
    """Two's complement of a signed value in a u64 field."""
    return value & _U64_MASK


def from_u64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass(frozen=True)
class ClockMark:
    ref_mono_ns: int
    offset_ns: int
    drift_ppm: float
    residual_ns: float
    max_residual_ns: float
    samples: int

    def fields(self) -> dict:
        """The MARK_CLOCK record's fields (publish_cupti keyword arguments)."""
        return {
            "step_seq": 0,
            "start_ns": self.ref_mono_ns,
            "end_ns": to_u64(self.offset_ns),
            "correlation_id": math.ceil(self.residual_ns),
            "name_h": f64_bits(self.drift_ppm),
            "kind": MARK_CLOCK,
            "device_id": self.samples,
            "stream_id": min(_U32_MAX, math.ceil(self.max_residual_ns)),
        }

    @classmethod
    def from_record(cls, rec) -> ClockMark:
        return cls(
            ref_mono_ns=int(rec["start_ns"]),
            offset_ns=from_u64(int(rec["end_ns"])),
            drift_ppm=bits_f64(int(rec["name_hash"])),
            residual_ns=float(rec["correlation_id"]),
            max_residual_ns=float(rec["stream_id"]),
            samples=int(rec["device_id"]),
        )


@dataclass(frozen=True)
class EndMark:
    first_step: int
    last_step: int
    written: int
    cupti_dropped: int
    collector_dropped: int
    unattributed: int
    lost_ownership: bool

    def fields(self) -> dict:
        return {
            "step_seq": self.last_step,
            "start_ns": self.first_step,
            "end_ns": self.written,
            "correlation_id": self.cupti_dropped,
            "name_h": self.collector_dropped,
            "kind": MARK_END,
            "device_id": min(_U32_MAX, self.unattributed),
            "stream_id": int(self.lost_ownership),
        }

    @classmethod
    def from_record(cls, rec) -> EndMark:
        return cls(
            first_step=int(rec["start_ns"]),
            last_step=int(rec["step_seq"]),
            written=int(rec["end_ns"]),
            cupti_dropped=int(rec["correlation_id"]),
            collector_dropped=int(rec["name_hash"]),
            unattributed=int(rec["device_id"]),
            lost_ownership=bool(rec["stream_id"]),
        )


def status_fields(status: int, step_seq: int, reason_hash: int) -> dict:
    return {
        "step_seq": step_seq,
        "start_ns": 0,
        "end_ns": 0,
        "correlation_id": 0,
        "name_h": reason_hash,
        "kind": MARK_STATUS,
        "device_id": status,
        "stream_id": 0,
    }
