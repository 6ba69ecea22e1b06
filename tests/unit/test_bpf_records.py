"""The numpy mirrors in llmobs.bpf.records agree with bpf/c/llmobs_events.h, and the sample hash
reproduces the kernel's (checked against the C code's constants by value)."""

from __future__ import annotations

import re

from llmobs.bpf.program import BPF_DIR
from llmobs.bpf.records import (
    AGG_KEY_DTYPE,
    AGG_VAL_DTYPE,
    COUNTERS,
    EVENT_DTYPE,
    KINDS,
    mix64,
    trace_hex,
    trace_kept,
)

_C_SIZES = {"u8": 1, "u16": 2, "u32": 4, "u64": 8}
HEADER = (BPF_DIR / "llmobs_events.h").read_text()


def _c_struct(name: str) -> list[tuple[str, int]]:
    body = re.search(rf"struct {name} \{{(.*?)\}};", HEADER, re.S).group(1)
    return [(field, _C_SIZES[ctype]) for ctype, field in re.findall(r"^\s*(u\d+) (\w+);", body, re.M)]


def _np_fields(dtype) -> list[tuple[str, int]]:
    return [(name, dtype.fields[name][0].itemsize) for name in dtype.names]


def test_event_struct_matches():
    assert _c_struct("llmobs_event") == _np_fields(EVENT_DTYPE)


def test_aggregate_structs_match():
    assert _c_struct("llmobs_agg_key") == _np_fields(AGG_KEY_DTYPE)
    assert _c_struct("llmobs_agg_val") == _np_fields(AGG_VAL_DTYPE)


def test_kind_and_counter_indices_match():
    for index, kind in enumerate(KINDS):
        assert re.search(rf"#define LLMOBS_KIND_{kind.upper()} {index}\b", HEADER)
    c_counters = re.findall(r"#define LLMOBS_CTR_(\w+) (\d+)", HEADER)
    assert len(c_counters) == len(COUNTERS)
    assert [int(i) for _, i in c_counters] == list(range(len(COUNTERS)))


def test_slot_counts_match():
    from llmobs.bpf.program import MAX_PROBES, START_SLOTS, TARGET_SLOTS, start_slot

    assert re.search(rf"#define LLMOBS_TARGET_SLOTS {TARGET_SLOTS}\b", HEADER)
    assert re.search(rf"#define LLMOBS_MAX_PROBES {MAX_PROBES}\b", HEADER)
    start_bits = int(re.search(r"#define LLMOBS_START_SLOTS \(1 << (\d+)\)", HEADER).group(1))
    assert 1 << start_bits == START_SLOTS
    # llmobs_slot(): what reset_maps zeroes after calibration must be where the handlers wrote
    assert "return ((tid << 6) ^ probe) & (LLMOBS_START_SLOTS - 1);" in HEADER
    assert start_slot(3, 5) == (3 << 6) ^ 5 and start_slot(1 << 20, 0) == 0


def test_mix64_known_values_and_constants():
    # splitmix64's finaliser: the constants in the C header are the ones used here
    assert "0xbf58476d1ce4e5b9ULL" in HEADER and "0x94d049bb133111ebULL" in HEADER
    assert mix64(0) == 0
    assert mix64(1) == 0x5692161D100B05E5
    assert mix64(1 << 64) == 0  # masked to 64 bits


def test_trace_kept_fraction():
    kept = sum(trace_kept(i * 7919, i, 16) for i in range(1, 16001))
    assert 800 < kept < 1200  # ~1/16 of 16000, far outside the bound only if the hash is broken
    assert all(trace_kept(i, i, 1) for i in range(10))


def test_trace_hex():
    out = trace_hex([0, 0x0123456789ABCDEF, 0], [0, 1, 5])
    assert list(out) == ["", "0123456789abcdef0000000000000001", "00000000000000000000000000000005"]


def test_thinning_matches():
    """llmobs_config holds what ProbeProgram.set_sampling packs (sample_n, mode, thin), and THINNED_PROBES
    are exactly the programs that record with thinning on (llmobs_point_as(..., 1))."""
    from llmobs.bpf.program import _CONFIG
    from llmobs.bpf.records import THINNED_PROBES

    assert [name for name, _ in _c_struct("llmobs_config")] == ["sample_n", "mode", "thin"]
    assert _CONFIG.format == "<QQQ" and all(size == 8 for _, size in _c_struct("llmobs_config"))
    thinning = {
        path.name.removesuffix(".bpf.c")
        for path in BPF_DIR.glob("*.bpf.c")
        if re.search(r"llmobs_point_as\([^;]*, 1\);", path.read_text())
    }
    assert thinning == set(THINNED_PROBES)
