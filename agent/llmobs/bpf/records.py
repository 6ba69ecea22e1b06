"""The user-space mirror of bpf/llmobs_events.h: record dtypes, kinds, counters, the sample hash.

numpy decodes ring records in batches with these dtypes (one frombuffer per drain, no Python call
per event); tests/unit/test_bpf_records.py checks they match the C header.
"""

from __future__ import annotations

import numpy as np

KINDS = ("mem", "gpu", "host", "compute")  # index = LLMOBS_KIND_*
FLAG_TRACKED = 1
FLAG_TORN = 2
SAMPLE_MODES = {"trace": 0, "cpu": 1}

# indices of llmobs_counters (LLMOBS_CTR_*)
COUNTERS = ("ring_drops", "agg_overflow", "ctx_faults", "torn_reads", "start_lost", "sampled")

EVENT_DTYPE = np.dtype(
    [
        ("pid", "<u4"),
        ("tid", "<u4"),
        ("cpu", "<u4"),
        ("probe", "<u2"),
        ("kind", "u1"),
        ("flags", "u1"),
        ("ts_ns", "<u8"),
        ("step_seq", "<u8"),
        ("trace_id_hi", "<u8"),
        ("trace_id_lo", "<u8"),
        ("value", "<u8"),
        ("duration_ns", "<u8"),
    ]
)
assert EVENT_DTYPE.itemsize == 64

# A ring record: the kernel's 8-byte header (len | BUSY/DISCARD bits, page offset) + the event,
# rounded up to 8 bytes (64 + 8 = 72, already aligned).
RING_HEADER_BYTES = 8
RING_RECORD_DTYPE = np.dtype([("len", "<u4"), ("pg_off", "<u4"), ("event", EVENT_DTYPE)])
RING_BUSY_BIT = 1 << 31
RING_DISCARD_BIT = 1 << 30

AGG_KEY_DTYPE = np.dtype([("pid", "<u4"), ("probe", "<u4"), ("step_seq", "<u8")])
AGG_VAL_DTYPE = np.dtype([("count", "<u8"), ("sum_value", "<u8"), ("sum_duration_ns", "<u8")])

_MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """llmobs_mix64 of bpf/llmobs_events.h (splitmix64's finaliser)."""
    x &= _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x


def trace_kept(trace_id_hi: int, trace_id_lo: int, sample_n: int) -> bool:
    """Whether --sample-mode trace keeps this trace: the kernel's decision, reproduced."""
    if sample_n <= 1:
        return True
    return mix64(trace_id_hi ^ mix64(trace_id_lo)) % sample_n == 0


def trace_hex(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """32-char lowercase hex trace ids ("" where the id is 0); formats each distinct id once."""
    pairs = np.empty(len(hi), dtype=[("hi", "<u8"), ("lo", "<u8")])
    pairs["hi"] = hi
    pairs["lo"] = lo
    unique, inverse = np.unique(pairs, return_inverse=True)
    texts = np.array(
        ["" if (h == 0 and lo_ == 0) else f"{h:016x}{lo_:016x}" for h, lo_ in unique.tolist()], dtype=object
    )
    return texts[inverse.reshape(-1)] if len(hi) else np.array([], dtype=object)
