"""ActivityDecoder on records shaped like cupti-python's (the attribute names of its Activity* classes),
the same function the drain thread runs on live buffers."""

from __future__ import annotations

from types import SimpleNamespace as R

from llmobs.cupti import decode
from llmobs.cupti import protocol as p
from llmobs.shm.hashing import name_hash


def _decoder(offset=-1000):
    interned = []

    def intern(text):
        interned.append(text)
        return name_hash(text)

    d = decode.ActivityDecoder(intern, lambda ns: ns + offset, lambda kind, cbid: f"api{kind}_{cbid}")
    return d, interned


def ext(corr, step, kind=p.EXTERNAL_KIND_CUSTOM2):
    return R(kind=p.KIND_EXTERNAL_CORRELATION, external_kind=kind, correlation_id=corr, external_id=step)


def kernel(corr, name="k", start=10_000, end=12_000):
    return R(kind=p.KIND_CONCURRENT_KERNEL, name=name, start=start, end=end, correlation_id=corr, device_id=1,
             stream_id=13)  # fmt: skip


def test_every_kind_decodes_to_one_record_with_its_name():
    d, interned = _decoder()
    acts = [
        ext(1, 7),
        R(kind=p.KIND_RUNTIME, cbid=211, start=100, end=300, correlation_id=1, process_id=5, thread_id=6),
        R(kind=p.KIND_DRIVER, cbid=307, start=150, end=250, correlation_id=1, process_id=5, thread_id=6),
        kernel(1, "ampere_sgemm"),
        R(
            kind=p.KIND_MEMCPY,
            copy_kind=1,
            start=20_000,
            end=21_000,
            correlation_id=1,
            device_id=1,
            stream_id=13,
            bytes=4096,
        ),  # fmt: skip
        R(kind=p.KIND_MEMSET, start=22_000, end=22_500, correlation_id=1, device_id=1, stream_id=13),
        R(
            kind=p.KIND_SYNCHRONIZATION,
            type=3,
            start=30_000,
            end=31_000,
            correlation_id=1,
            stream_id=13,
            context_id=1,
        ),  # fmt: skip
        R(
            kind=p.KIND_MEMORY2,
            memory_operation_type=1,
            timestamp=40_000,
            correlation_id=1,
            device_id=1,
            stream_id=13,
            bytes=1 << 20,
        ),  # fmt: skip
    ]
    out = d.decode(acts)
    assert len(out) == 7
    assert all(r[0] == 7 for r in out)
    by_kind = {r[5]: r for r in out}
    k = by_kind[p.KIND_CONCURRENT_KERNEL]
    assert k == (7, 9_000, 11_000, 1, name_hash("ampere_sgemm"), p.KIND_CONCURRENT_KERNEL, 1, 13)
    assert by_kind[p.KIND_RUNTIME][6] == p.NO_DEVICE and by_kind[p.KIND_RUNTIME][7] == 0
    assert by_kind[p.KIND_MEMORY2][1] == by_kind[p.KIND_MEMORY2][2] == 39_000
    assert set(interned) == {"api5_211", "api4_307", "ampere_sgemm", "memcpy HtoD", "memset",
                             "sync stream_synchronize", "device alloc"}  # fmt: skip


def test_names_are_interned_once():
    d, interned = _decoder()
    d.decode([ext(i, 1) for i in range(50)] + [kernel(i, "same") for i in range(50)])
    assert interned == ["same"]


def test_pytorch_profiler_external_ids_are_not_ours():
    """CUSTOM0/1 belong to PyTorch's profiler: they never become our step."""
    d, _ = _decoder()
    out = d.decode([ext(1, 99, kind=3), ext(1, 5), kernel(1)])
    assert [r[0] for r in out] == [5]


def test_a_record_waits_for_its_correlation_then_keeps_its_order():
    d, _ = _decoder()
    assert d.decode([kernel(1, "a"), kernel(2, "b")]) == []
    assert len(d.pending) == 2
    out = d.decode([ext(1, 3), ext(2, 4), kernel(3, "c"), ext(3, 4)])
    assert [(r[0], r[4]) for r in out] == [(3, name_hash("a")), (4, name_hash("b")), (4, name_hash("c"))]
    assert not d.pending


def test_final_flush_writes_unresolved_as_untracked():
    d, _ = _decoder()
    d.decode([kernel(1)])
    out = d.decode([], final=True)
    assert [r[0] for r in out] == [0]
    assert d.unattributed == 1


def test_pending_is_bounded(monkeypatch):
    monkeypatch.setattr(decode, "MAX_PENDING", 10)
    d, _ = _decoder()
    out = d.decode([kernel(i) for i in range(25)])
    assert len(d.pending) == 10
    assert len(out) == 15 and d.unattributed == 15


def test_malformed_and_unknown_records_are_skipped_not_fatal():
    d, _ = _decoder()
    bad = [R(kind=p.KIND_CONCURRENT_KERNEL, name="x"), R(kind=77), R(nokind=1)]
    out = d.decode([*bad, ext(1, 2), kernel(1)], final=True)
    assert len(out) == 1 and out[0][0] == 2
    assert d.skipped == 3


def test_kernel_names_given_as_bytes_are_decoded():
    d, interned = _decoder()
    d.decode([ext(1, 2), kernel(1, b"void gemm<float>(float*)")])
    assert interned == ["void gemm<float>(float*)"]
