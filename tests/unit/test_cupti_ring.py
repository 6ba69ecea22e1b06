"""CuptiRing: batch writes into a real map's CUPTI ring, read back by the real reader."""

from __future__ import annotations

import numpy as np
from llmobs import clock
from llmobs.cupti.ring import CuptiRing, to_monotonic
from llmobs.shm.reader import ShmReader
from llmobs.shm.writer import ShmWriter


def _records(n, base=0):
    return [(7, 10_000 + i, 10_500 + i, base + i, 99, 10, 0, 3) for i in range(n)]


def test_batches_wrap_and_read_back_exactly(tmp_path):
    w = ShmWriter(shm_dir=str(tmp_path), cupti_capacity=16)
    try:
        ring = CuptiRing(w)
        w.publish_cupti(1, 2, 3, 4, 5, 6, 7, 8)  # a marker through the writer's own call shares the ring
        assert ring.publish(_records(10)) == 10
        with ShmReader(w.pid, shm_dir=str(tmp_path)) as r:
            r.refresh()
            got = r.read_cupti(0)
            assert got.lost == 0 and got.corrupt == 0 and len(got.records) == 11
            assert got.records["correlation_id"].tolist() == [4, *range(10)]
            cursor = got.next_cursor
            ring.publish(_records(12, base=100))  # wraps the 16-slot ring
            r.refresh()
            got = r.read_cupti(cursor)
        assert got.lost == 0 and got.corrupt == 0
        assert got.records["correlation_id"].tolist() == list(range(100, 112))
        assert set(got.records["kind"].tolist()) == {10} and w.cupti_head == 23
    finally:
        w.close()


def test_more_than_the_ring_keeps_the_newest(tmp_path):
    w = ShmWriter(shm_dir=str(tmp_path), cupti_capacity=8)
    try:
        CuptiRing(w).publish(_records(20))
        with ShmReader(w.pid, shm_dir=str(tmp_path)) as r:
            r.refresh()
            got = r.read_cupti(0)
        assert got.lost == 12 and got.records["correlation_id"].tolist() == list(range(12, 20))
    finally:
        w.close()


def test_column_clock_mapping_equals_clockfit():
    rng = np.random.default_rng(1)
    for offset in (1_700_000_000_000_000_000, -5_000_000_000, 0):
        drift = float(rng.normal(0, 20))
        fit = clock.ClockFit(ref_mono_ns=123_456_789_000, offset_ns=offset, drift_ppm=drift, residual_ns=1.0,
                             max_residual_ns=2.0, samples=8)  # fmt: skip
        mono = 123_456_789_000 + rng.integers(-(10**9), 10**11, 1000)
        foreign = np.array([fit.to_foreign_ns(int(m)) for m in mono], dtype=np.uint64)
        expected = [fit.to_monotonic_ns(int(f)) for f in foreign]
        assert to_monotonic(foreign, fit).astype(np.int64).tolist() == expected


def test_batch_times_are_mapped_and_durations_kept(tmp_path):
    w = ShmWriter(shm_dir=str(tmp_path))
    try:
        fit = clock.ClockFit(ref_mono_ns=1_000_000, offset_ns=5_000, drift_ppm=0.0, residual_ns=0.0,
                             max_residual_ns=0.0, samples=2)  # fmt: skip
        CuptiRing(w).publish([(1, 1_010_000, 1_012_345, 1, 1, 10, 0, 0)], fit)
        with ShmReader(w.pid, shm_dir=str(tmp_path)) as r:
            r.refresh()
            rec = r.read_cupti(0).records[0]
        assert int(rec["start_ns"]) == 1_005_000 and int(rec["end_ns"]) == 1_007_345
    finally:
        w.close()
