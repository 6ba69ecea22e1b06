"""The detectors' float path for tiny batches (<= TINY_BATCH steps) against their numpy path: every
statistic and verdict bit for bit, and the same anomaly rows and open state from a live stream."""

from __future__ import annotations

import math

import numpy as np
import pytest
from llmobs.diagnostics import detectors
from llmobs.diagnostics.detectors import DetectorConfig, Scores, StreamingDetector
from numpy.lib.stride_tricks import sliding_window_view

CONFIGS = [
    DetectorConfig(detector="both"),
    DetectorConfig(detector="both", window=2, min_history=2),
    DetectorConfig(detector="both", window=9, min_history=3, alpha=0.2, mad_threshold=1.0),
    # flat windows: sd 0, inf / NaN scores
    DetectorConfig(detector="both", window=40, min_history=8, min_sd=0.0),
    # the > 128 pairwise sum
    DetectorConfig(detector="both", window=200, min_history=8, alpha=0.3, mad_threshold=0.5),
]


def _same(a, b) -> bool:
    """Exactly equal, NaN equal to NaN (bit for bit apart from the sign of zero)."""
    a, b = float(a), float(b)
    return (math.isnan(a) and math.isnan(b)) or a == b


def _losses(rng, n: int) -> np.ndarray:
    kind = rng.integers(4)
    if kind == 0:
        x = rng.normal(3.0, 0.5, n)
    elif kind == 1:
        x = np.full(n, 2.5)  # flat: the floor of the spread decides
    elif kind == 2:
        x = rng.lognormal(0.0, 2.0, n)  # wide range: rounding order shows in the sums
    else:
        x = np.round(rng.normal(3.0, 0.2, n), 1)  # ties: the medians' indexing shows
    spikes = rng.random(n) < 0.15
    x[spikes] += rng.uniform(1.0, 8.0, spikes.sum())
    return x


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"w{c.window}-sd{c.min_sd}")
def test_the_float_path_scores_every_step_as_the_numpy_path_bit_for_bit(config):
    rng = np.random.default_rng(config.window)
    flagged = {"ttest": 0, "mad": 0}
    for _trial in range(300):
        history = _losses(rng, int(rng.integers(0, config.window + 3)))[-config.window :]
        values = _losses(rng, int(rng.integers(1, detectors.TINY_BATCH + 1)))
        seen = len(history) + int(rng.integers(0, 3) * rng.integers(0, 40))
        w = config.window  # _score's windows, with the streaming path's p (exact where p < alpha)
        seq = np.concatenate([np.full(w, np.nan), history[-w:], values])
        start = w + min(len(history), w)
        windows = sliding_window_view(seq, w)[start - w : start - w + len(values)]
        seen_at = seen + np.arange(len(values))
        want = detectors._score_windows(windows, values, seen_at, config, every_p=False)
        got = detectors._score_scalar(history.tolist(), values.tolist(), seen, config)
        for name in Scores.__dataclass_fields__:
            w, g = getattr(want, name), getattr(got, name)
            assert len(g) == len(w)
            assert all(_same(x, y) for x, y in zip(w.tolist(), g, strict=True)), (name, w, g)
        flagged["ttest"] += int(want.ttest.sum())
        flagged["mad"] += int(want.mad_flag.sum())
    assert flagged["ttest"] > 10 and flagged["mad"] > 10  # the verdicts compared include flags


def _stream(rng, requests: int, steps: int) -> list[dict]:
    """Token-step batches of 1..TINY_BATCH steps from interleaved requests (some teacher-forced: one
    pass, one step_seq), in step order per request, NaN losses included."""
    series = []
    for r in range(requests):
        losses = _losses(rng, steps)
        losses[rng.random(steps) < 0.05] = np.nan
        forced = r % 3 == 2
        series.append((f"{r:032x}", losses, 1000 * (r + 1), forced))
    cursor = [0] * requests
    batches = []
    while any(c < steps for c in cursor):
        size = int(rng.integers(1, detectors.TINY_BATCH + 1))
        names = ("pid", "step_seq", "trace_id", "step", "position", "token_id", "target_id", "loss",
                 "batch_row", "t_end_ns")  # fmt: skip
        cols: dict[str, list] = {k: [] for k in names}
        for _ in range(size):
            live = [r for r in range(requests) if cursor[r] < steps]
            if not live:
                break
            r = live[int(rng.integers(len(live)))]
            trace, losses, first, forced = series[r]
            s = cursor[r]
            cursor[r] += 1
            for key, value in (("pid", 7), ("step_seq", first if forced else first + s), ("trace_id", trace),
                               ("step", s), ("position", 10 + s), ("token_id", s), ("target_id", s + 1),
                               ("loss", float(losses[s])), ("batch_row", r % 2),
                               ("t_end_ns", 5 + s)):  # fmt: skip
                cols[key].append(value)
        batches.append({k: (np.asarray(v) if k != "trace_id" else v) for k, v in cols.items()})
    return batches


@pytest.mark.parametrize("config", CONFIGS[:4], ids=lambda c: f"w{c.window}-sd{c.min_sd}")
def test_a_stream_of_tiny_batches_gives_the_numpy_paths_rows_and_state(monkeypatch, config):
    batches = _stream(np.random.default_rng(3), requests=5, steps=60)
    floats = StreamingDetector(config)
    got = [floats.add(b, now_ns=i) for i, b in enumerate(batches)]
    monkeypatch.setattr(detectors, "TINY_BATCH", 0)  # every batch through the numpy path
    arrays = StreamingDetector(config)
    want = [arrays.add(b, now_ns=i) for i, b in enumerate(batches)]
    assert sum(len(w["ts_ns"]) for w in want if w) > 5
    assert got == want  # every row: request key, kind, score, detail (mean, sd, p, median, MAD...)
    for field in ("steps", "tested", "anomalies", "evicted", "open"):
        assert getattr(floats.counters, field) == getattr(arrays.counters, field)
    assert list(floats._open) == list(arrays._open) and floats._forced_open == arrays._forced_open
    for key, state in floats._open.items():
        assert state.seen == arrays._open[key].seen
        assert state.history.tolist() == arrays._open[key].history.tolist()


def test_the_calibrated_detectors_tiny_path_gives_the_numpy_paths_rows_and_counters(monkeypatch):
    """The calibrated detector's request-relative z (its aftermath test) and aftermath bookkeeping for
    polls of <= TINY_BATCH steps, in Python floats, against the numpy path on the same stream."""
    polls = _stream(np.random.default_rng(11), requests=40, steps=60)  # positions 10-69: two buckets
    runs = []
    for tiny in (detectors.TINY_BATCH, 0):
        monkeypatch.setattr(detectors, "TINY_BATCH", tiny)
        detector = StreamingDetector(DetectorConfig(detector="calibrated", alarm_rate=1e-2))
        seen_z: list[np.ndarray] = []  # every step's z as the aftermath test gets it

        def recorded(scores, z, *rest, seen=seen_z, test=detector._aftermath):
            seen.append(z.copy())
            return test(scores, z, *rest)

        monkeypatch.setattr(detector, "_aftermath", recorded)
        rows = [detector.add(poll, now_ns=1) for poll in polls]
        runs.append((rows, detector.counters, np.concatenate(seen_z)))
    (tiny_rows, tiny_counters, tiny_z), (numpy_rows, numpy_counters, numpy_z) = runs
    assert np.array_equal(tiny_z, numpy_z, equal_nan=True) and np.isfinite(tiny_z).sum() > 1000
    assert tiny_rows == numpy_rows
    assert (tiny_counters.tested, tiny_counters.aftermath, tiny_counters.consequences) == (
        numpy_counters.tested, numpy_counters.aftermath, numpy_counters.consequences)  # fmt: skip
    assert sum(len(r["step"]) for r in tiny_rows if r) > 5 and tiny_counters.aftermath > 0
