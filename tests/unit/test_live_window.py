"""`top`'s window figures (LiveStats) at a server's rates: the steps kept in a fixed ring (StepRing), the
window's counts exact above the old 100k-step bound, a faster target rated over what the ring holds, and
each pass's tenant shares computed once and recomputed when a row joins it."""

from __future__ import annotations

import numpy as np
import pytest
from llmobs.pipeline import live
from llmobs.pipeline.live import WINDOW_S, LiveStats, StepRing
from llmobs.procfs import ProcFS

SECOND = 1_000_000_000


def _steps(first_seq: int, ends: np.ndarray, tenants: list[str], tokens: int = 1) -> dict:
    n = len(ends)
    return {
        "pid": np.full(n, 7), "step_seq": np.arange(first_seq, first_seq + n), "t_start_ns": ends - 1_000,
        "t_end_ns": ends, "latency_ns": np.full(n, 2_000_000), "loss": np.ones(n, np.float32),
        "model_id": ["m"] * n, "tenant": tenants, "tokens_in_pass": np.full(n, tokens),
    }  # fmt: skip


def _feed(stats: LiveStats, rate: int, seconds: int, batch: int, start_ns: int = SECOND) -> int:
    """`rate` steps a second, one pass each, in batches; returns the last step's end."""
    ends = start_ns + (np.arange(rate * seconds) * SECOND) // rate
    for i in range(0, len(ends), batch):
        part = ends[i : i + batch]
        stats.add_steps(_steps(i + 1, part, ["a" if k % 4 else "b" for k in range(i, i + len(part))]))
    return int(ends[-1])


def test_the_ring_keeps_the_newest_steps_in_order_across_its_wrap_and_oversized_batches():
    ring = StepRing(capacity=8)
    values = np.arange(1, 30, dtype=np.int64)
    for lo, hi in ((0, 3), (3, 10), (10, 11), (11, 29)):  # 3, then a wrap, one, then a batch over capacity
        part = values[lo:hi]
        ring.add(part, part * 10, part.astype(np.float64), np.full(len(part), 1, np.int32))
        held = ring.end[ring.newest(len(ring))]
        assert held.tolist() == values[max(hi - 8, 0) : hi].tolist()
        assert ring.latency[ring.newest(len(ring))].tolist() == (held * 10).tolist()
    assert ring.oldest_end() == 22 and len(ring) == 8 and ring.added == 29
    ring.add(np.array([30]), np.array([300]), np.array([30.0]), 4)  # one tenant code for the batch
    assert ring.tenant[ring.newest(2)].tolist() == [1, 4] and ring.oldest_end() == 23


def test_tokens_per_s_is_exact_at_a_gpu_servers_rate():
    """20k steps/s over 12 s: the window holds 200k steps (the deque it replaced kept 100k, and said
    10,000 tokens/s); every tenant's share of them exact."""
    stats = LiveStats(7)
    last = _feed(stats, rate=20_000, seconds=12, batch=2_000)
    row = stats.row(last)
    since = last - int(WINDOW_S * SECOND)
    window = [k for k in range(20_000 * 12) if SECOND + (k * SECOND) // 20_000 >= since]
    assert row["tokens_per_s"] == len(window) / WINDOW_S
    by_tenant = {r["tenant"]: r["tokens_per_s"] for r in row["by_tenant"]}
    assert by_tenant == {"a": sum(1 for k in window if k % 4) / WINDOW_S,
                         "b": sum(1 for k in window if not k % 4) / WINDOW_S}  # fmt: skip


def test_a_target_faster_than_the_ring_is_rated_over_the_span_the_ring_holds(monkeypatch):
    monkeypatch.setattr(live, "STEP_RING", 1_000)
    stats = LiveStats(7)
    last = _feed(stats, rate=500, seconds=4, batch=50)  # 2,000 steps: the ring holds the last 1,000 (2 s)
    row = stats.row(last)
    oldest = SECOND + (1_000 * SECOND) // 500
    assert row["tokens_per_s"] == pytest.approx(1_000 / ((last - oldest) / SECOND), rel=1e-12)
    assert sum(r["tokens_per_s"] for r in row["by_tenant"]) == pytest.approx(row["tokens_per_s"], rel=1e-12)


def test_a_row_joining_a_pass_after_a_snapshot_reshares_it_and_old_passes_leave_the_window():
    stats = LiveStats(7)
    now = 100 * SECOND
    stats.add_steps(_steps(5, np.array([now - 2 * SECOND]), ["a"], tokens=3))  # pass 5: a's 3 tokens
    first = {r["tenant"]: r["compute_share"] for r in stats.row(now)["by_tenant"]}
    assert first == {"a": 1.0}
    # a prefill chunk of tenant b joins pass 5 (1 token): the pass is shared 3:1 from now on
    stats.add_request_events({
        "kind": ["chunk"], "pid": np.array([7]), "step_seq": np.array([5]),
        "t_start_ns": np.array([now - 3 * SECOND]), "t_end_ns": np.array([now - 2 * SECOND]), "tenant": ["b"],
        "prefill_tokens": np.array([1]),
    })  # fmt: skip
    second = {r["tenant"]: r["compute_share"] for r in stats.row(now)["by_tenant"]}
    assert second == pytest.approx({"a": 0.75, "b": 0.25})
    later = stats.row(now + 20 * SECOND)  # pass 5 ended before this window: no compute, and not kept
    assert all(r["compute_s_per_s"] == 0 for r in later["by_tenant"]) and not stats._passes


def test_maps_containing_parses_only_the_lines_that_name_it(tmp_path):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "maps").write_text(
        "7f0000000000-7f0000001000 r--p 00000000 08:01 11 /usr/lib/libc.so.6\n"
        "7f0000002000-7f0000012000 rw-s 00000000 00:1a 12 /dev/shm/llmobs.42\n"
        "7f0000020000-7f0000021000 r-xp 00001000 08:01 13 /opt/x/libllmobs_otel_thread_ctx.so\n"
    )
    procfs = ProcFS(tmp_path)
    assert len(procfs.maps(42)) == 3
    assert [e.path for e in procfs.maps(42, containing="llmobs")] == [
        "/dev/shm/llmobs.42", "/opt/x/libllmobs_otel_thread_ctx.so"]  # fmt: skip


def test_latency_percentiles_of_a_large_window_come_from_a_random_draw_that_cannot_alias(monkeypatch):
    """Above PERCENTILE_STEPS the percentiles are read from a random draw of the window's steps: every
    20th step slow (5%) must read p50 fast and p99 slow, which every-20th-step sampling would not."""
    monkeypatch.setattr(live, "PERCENTILE_STEPS", 1_000)
    stats = LiveStats(7)
    ends = SECOND + np.arange(20_000, dtype=np.int64) * 100_000  # 20,000 steps in 2 s
    steps = _steps(1, ends, ["a"] * len(ends))
    steps["latency_ns"] = np.where(np.arange(len(ends)) % 20 == 0, 100_000_000, 1_000_000)
    stats.add_steps(steps)
    row = stats.row(int(ends[-1]))
    assert (row["p50_ms"], row["p99_ms"]) == (1.0, 100.0)
    monkeypatch.setattr(live, "PERCENTILE_STEPS", 20_000)  # at the bound: every step, exactly
    assert (stats.row(int(ends[-1]))["p50_ms"], stats.row(int(ends[-1]))["p99_ms"]) == (1.0, 100.0)
