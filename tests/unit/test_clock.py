"""clock: wall-time offsets and foreign-clock fits, on the host's real clocks and on synthetic pairs."""

from __future__ import annotations

import random
import time

import pytest
from llmobs.clock import BracketedSample, WallClock, fit_clock, monotonic_ns, realtime_ns, sample_brackets


def test_monotonic_is_the_clock_of_time_monotonic_ns():
    # bpf_ktime_get_ns and time.monotonic_ns are both CLOCK_MONOTONIC: one must lie between two reads
    # of the other.
    before = time.monotonic_ns()
    ours = monotonic_ns()
    after = time.monotonic_ns()
    assert before <= ours <= after


def test_wall_clock_maps_monotonic_to_realtime_within_its_measured_error():
    wall = WallClock.measure(count=200)
    assert wall.samples == 200
    assert 0 <= wall.error_ns < 1_000_000  # a bracket of two clock reads takes well under 2 ms
    for _ in range(20):
        before = realtime_ns()
        converted = wall.to_wall_ns(monotonic_ns())
        after = realtime_ns()
        slack = wall.error_ns + wall.residual_ns + 1_000
        assert before - slack <= converted <= after + slack
    now = monotonic_ns()
    assert wall.to_monotonic_ns(wall.to_wall_ns(now)) == now


def test_wall_clock_keeps_the_tightest_bracket_and_reports_the_spread():
    samples = [
        BracketedSample(1_000, 1_000_000 + 1_500 + 400, 2_000),  # wide and off by 400 ns
        BracketedSample(10_000, 1_000_000 + 10_050, 10_100),  # tightest: offset exactly 1_000_000
        BracketedSample(20_000, 1_000_000 + 20_100 + 30, 20_200),  # narrow (2x) and 30 ns off
    ]
    wall = WallClock.from_samples(samples)
    assert wall.offset_ns == 1_000_000
    assert wall.error_ns == 50
    assert wall.residual_ns == 30  # the wide sample is not counted in the spread


def _synthetic_pairs(offset_ns, drift_ppm, count, seed, outliers=0):
    rng = random.Random(seed)
    base = 7_000_000_000_000  # a plausible CLOCK_MONOTONIC value (~2 h of uptime)
    samples = []
    for i in range(count):
        before = base + i * 1_000_000 + rng.randrange(0, 5_000)
        width = rng.randrange(200, 600)
        read_at = before + rng.randrange(0, width + 1)
        if i < outliers:  # a preempted reader: the foreign read happened far from the bracket's middle
            width = 2_000_000
            read_at = before + 1_900_000
        foreign = round(base + offset_ns + (1 + drift_ppm * 1e-6) * (read_at - base))
        samples.append(BracketedSample(before, foreign, before + width))
    rng.shuffle(samples)
    return samples, base


@pytest.mark.parametrize(
    ("offset_ns", "drift_ppm"),
    [(0, 0.0), (1_700_000_000_000_000_000 - 7_000_000_000_000, 37.5), (-3_000_000_000, -120.0)],
)
def test_fit_recovers_known_offset_and_drift(offset_ns, drift_ppm):
    samples, base = _synthetic_pairs(offset_ns, drift_ppm, count=400, seed=7, outliers=40)
    fit = fit_clock(samples)
    assert fit.samples == 200
    assert abs(fit.drift_ppm - drift_ppm) < 0.05
    # The map must be right to within the bracket jitter (reads are uniform in a <=600 ns bracket).
    for mono in (base, base + 123_456_789, base + 399_000_000):
        truth = round(base + offset_ns + (1 + drift_ppm * 1e-6) * (mono - base))
        assert abs(fit.to_foreign_ns(mono) - truth) < 400
        assert abs(fit.to_monotonic_ns(truth) - mono) < 400
    assert 0 < fit.residual_ns < 400
    assert fit.max_residual_ns >= fit.residual_ns


def test_fit_discards_preempted_brackets():
    samples, _ = _synthetic_pairs(5_000, 10.0, count=100, seed=3, outliers=30)
    assert fit_clock(samples, keep_fraction=0.5).max_residual_ns < 400
    # Keeping every bracket lets the preempted ones in, and the residual says so.
    assert fit_clock(samples, keep_fraction=1.0).max_residual_ns > 100_000


def test_fit_of_a_real_drifting_clock_read_through_real_brackets():
    # A foreign clock derived from the real monotonic clock, 100 ppm fast and offset by 12.345 s: the
    # brackets, their jitter and any preemption are real.
    def foreign():
        return round(monotonic_ns() * 1.0001) + 12_345_000_000

    samples = []
    deadline = monotonic_ns() + 30_000_000  # spread the samples over ~30 ms so drift is observable
    while monotonic_ns() < deadline:
        samples.extend(sample_brackets(foreign, count=8))
    fit = fit_clock(samples)
    assert abs(fit.drift_ppm - 100.0) < 5.0
    now = monotonic_ns()
    assert abs(fit.to_monotonic_ns(foreign()) - now) < 200_000


def test_fit_rejects_unusable_input():
    with pytest.raises(ValueError):
        fit_clock([BracketedSample(1, 2, 3)])
    with pytest.raises(ValueError):
        fit_clock([BracketedSample(1, 2, 3), BracketedSample(1, 5, 3)])
    with pytest.raises(ValueError):
        WallClock.from_samples([])
