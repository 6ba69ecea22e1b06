"""The user-space mirror of bpf/c/llmobs_events.h: record dtypes, kinds, counters, the sample hash.

numpy decodes ring records in batches with these dtypes (one frombuffer per drain, no Python call
per event); tests/unit/test_bpf_records.py checks they match the C header.
"""

from __future__ import annotations

import numpy as np

KINDS = ("mem", "gpu", "host", "compute")  # index = LLMOBS_KIND_*
FLAG_TRACKED = 1
FLAG_TORN = 2
FLAG_THREAD = 4  # tagged from the thread's own OTEP 4947 record (llmobs_read_thread_tag)
SAMPLE_MODES = {"trace": 0, "cpu": 1}

# indices of llmobs_counters (LLMOBS_CTR_*)
COUNTERS = ("ring_drops", "agg_overflow", "ctx_faults", "torn_reads", "start_lost", "sampled", "thinned")
# Thinning (llmobs_config.thin, the probes.thin setting): these probes ship 1 in `thin` of their tagged
# events (step_seq != 0); the aggregates count every one. A shipped one stands for `thin` events: its
# sample_ratio is multiplied. The C programs that record with thinning on are these (a unit test checks).
DEFAULT_THIN = 64
THINNED_PROBES = ("linear", "page_fault_user")

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


def thinned_ids(probe_names) -> np.ndarray:
    """The indices of THINNED_PROBES in a probe table (the decoder's names, in probe id order)."""
    return np.array([i for i, name in enumerate(probe_names) if name in THINNED_PROBES], dtype=np.uint16)


def sample_ratios(probe: np.ndarray, step_seq: np.ndarray, sample_ratio: int, thin: int,
                  thinned: np.ndarray, dtype: str = "<i4") -> np.ndarray:  # fmt: skip
    """Each event's sample_ratio (how many events it stands for): the 1/N sampler's N, times `thin` for a
    thinned probe's tagged event (the kernel shipped 1 in `thin` of those)."""
    ratios = np.full(len(probe), sample_ratio, dtype=dtype)
    if thin > 1:
        for probe_id in thinned.tolist():
            ratios[(probe == probe_id) & (step_seq != 0)] *= thin
    return ratios


def mix64(x: int) -> int:
    """llmobs_mix64 of bpf/c/llmobs_events.h (splitmix64's finaliser)."""
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


def trace_runs(hi: np.ndarray, lo: np.ndarray) -> tuple[list[str], np.ndarray]:
    """(hex text of each run of equal trace ids, run index of each event). Events come in runs (a
    request's events are consecutive), so only the first event of a run is formatted."""
    hi = np.asarray(hi, dtype=np.uint64)
    lo = np.asarray(lo, dtype=np.uint64)
    if not len(hi):
        return [], np.zeros(0, dtype=np.int32)
    change = np.empty(len(hi), dtype=bool)
    change[0] = True
    change[1:] = (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])
    starts = np.flatnonzero(change)
    formatted: dict[tuple[int, int], str] = {(0, 0): ""}
    texts = []
    for pair in zip(hi[starts].tolist(), lo[starts].tolist(), strict=True):
        text = formatted.get(pair)
        if text is None:
            text = formatted[pair] = f"{pair[0]:016x}{pair[1]:016x}"
        texts.append(text)
    return texts, (np.cumsum(change) - 1).astype(np.int32)


def trace_hex(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """32-char lowercase hex trace ids ("" where the id is 0), as an object array."""
    texts, runs = trace_runs(hi, lo)
    return np.array(texts, dtype=object)[runs] if len(runs) else np.array([], dtype=object)
