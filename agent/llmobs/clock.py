"""The one module that owns time: every timestamp the agent stores is CLOCK_MONOTONIC nanoseconds.

CLOCK_MONOTONIC is the clock of `bpf_ktime_get_ns()` and of `time.monotonic_ns()` on Linux, so eBPF
events, token steps and the agent share it without conversion. Two other clocks must be mapped onto it:

- wall time (CLOCK_REALTIME), for exports that people read and for OTLP: `WallClock` holds one offset
  measured from *bracketed samples* (a realtime read between two monotonic reads); the tightest
  bracket wins, and its half-width is the error bound.
- a foreign device clock (CUPTI's `get_timestamp()`): `fit_clock` fits foreign = a + b * monotonic from
  bracketed pairs, giving an offset, a drift in ppm and the residual error of the fit.

Why brackets: a single pair of reads has an unknown delay between them (a preemption can put
milliseconds there). Reading the other clock *between* two monotonic reads bounds where, in monotonic
time, the reading happened; narrow brackets are trustworthy, wide ones are discarded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "BracketedSample",
    "ClockFit",
    "WallClock",
    "fit_clock",
    "monotonic_ns",
    "realtime_ns",
    "sample_brackets",
]


def monotonic_ns() -> int:
    """CLOCK_MONOTONIC in ns: the agent's base clock (the same clock as bpf_ktime_get_ns)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def realtime_ns() -> int:
    """CLOCK_REALTIME in ns (wall time, Unix epoch)."""
    return time.clock_gettime_ns(time.CLOCK_REALTIME)


@dataclass(frozen=True)
class BracketedSample:
    """One reading of another clock taken between two monotonic reads."""

    mono_before_ns: int
    foreign_ns: int
    mono_after_ns: int

    @property
    def width_ns(self) -> int:
        """How long the bracket lasted: the uncertainty of when `foreign_ns` was read."""
        return self.mono_after_ns - self.mono_before_ns

    @property
    def mono_mid_ns(self) -> float:
        """Best estimate of the monotonic time at which `foreign_ns` was read."""
        return self.mono_before_ns + self.width_ns / 2


def sample_brackets(
    read_foreign: Callable[[], int], count: int = 64, read_mono: Callable[[], int] = monotonic_ns
) -> list[BracketedSample]:
    """Take `count` bracketed samples of `read_foreign` (e.g. realtime_ns, or CUPTI's get_timestamp)."""
    samples = []
    for _ in range(count):
        before = read_mono()
        foreign = read_foreign()
        after = read_mono()
        samples.append(BracketedSample(before, foreign, after))
    return samples


@dataclass(frozen=True)
class WallClock:
    """monotonic <-> realtime, from the tightest of a set of bracketed samples.

    `error_ns` is the half-width of the bracket used (a hard bound on the offset's error if both
    clocks were steady during it); `residual_ns` is the measured spread: the largest disagreement,
    from the chosen offset, of the other narrow samples (those whose bracket is at most twice the
    tightest), which shows clock steps or preemptions the bound alone would hide.
    """

    offset_ns: int  # realtime - monotonic
    error_ns: int
    residual_ns: int
    samples: int
    measured_at_mono_ns: int

    @classmethod
    def measure(cls, count: int = 64) -> WallClock:
        """Measure the offset now on this host's real clocks."""
        return cls.from_samples(sample_brackets(realtime_ns, count))

    @classmethod
    def from_samples(cls, samples: Sequence[BracketedSample]) -> WallClock:
        if not samples:
            raise ValueError("WallClock needs at least one bracketed sample")
        best = min(samples, key=lambda s: s.width_ns)
        offset = round(best.foreign_ns - best.mono_mid_ns)
        narrow = [s for s in samples if s.width_ns <= max(2 * best.width_ns, 1)]
        residual = max(abs((s.foreign_ns - s.mono_mid_ns) - offset) for s in narrow)
        return cls(
            offset_ns=offset,
            error_ns=math.ceil(best.width_ns / 2),
            residual_ns=math.ceil(residual),
            samples=len(samples),
            measured_at_mono_ns=best.mono_before_ns,
        )

    def to_wall_ns(self, mono_ns: int) -> int:
        return mono_ns + self.offset_ns

    def to_monotonic_ns(self, wall_ns: int) -> int:
        return wall_ns - self.offset_ns


@dataclass(frozen=True)
class ClockFit:
    """A linear map between a foreign clock and CLOCK_MONOTONIC:

        foreign = ref_mono_ns + offset_ns + (1 + drift_ppm * 1e-6) * (mono - ref_mono_ns)

    `offset_ns` is foreign - monotonic at `ref_mono_ns` (the earliest kept monotonic read);
    `residual_ns` is the RMS distance of the samples from the line, `max_residual_ns` the worst one.
    """

    ref_mono_ns: int
    offset_ns: int
    drift_ppm: float
    residual_ns: float
    max_residual_ns: float
    samples: int

    @property
    def _slope(self) -> float:
        return 1.0 + self.drift_ppm * 1e-6

    def to_monotonic_ns(self, foreign_ns: int) -> int:
        """Convert a foreign timestamp (e.g. a CUPTI record's start) to CLOCK_MONOTONIC ns."""
        delta = (foreign_ns - self.ref_mono_ns) - self.offset_ns
        return self.ref_mono_ns + round(delta / self._slope)

    def to_foreign_ns(self, mono_ns: int) -> int:
        return self.ref_mono_ns + self.offset_ns + round(self._slope * (mono_ns - self.ref_mono_ns))


def fit_clock(samples: Sequence[BracketedSample], keep_fraction: float = 0.5) -> ClockFit:
    """Least-squares fit of a foreign clock against CLOCK_MONOTONIC from bracketed pairs.

    Only the narrowest `keep_fraction` of the brackets are used (at least two): a wide bracket means the
    reading thread was preempted, and its midpoint says little about when the foreign clock was read.
    Arithmetic is done on differences from the first kept sample, so float64 keeps sub-ns precision
    even though raw timestamps are ~1e18.
    """
    if len(samples) < 2:
        raise ValueError("fit_clock needs at least two bracketed samples")
    kept_count = max(2, math.ceil(len(samples) * keep_fraction))
    kept = sorted(samples, key=lambda s: s.width_ns)[:kept_count]
    kept.sort(key=lambda s: s.mono_before_ns)
    ref_mono = kept[0].mono_before_ns
    ref_foreign = kept[0].foreign_ns
    xs = [s.mono_mid_ns - ref_mono for s in kept]
    ys = [float(s.foreign_ns - ref_foreign) for s in kept]
    n = len(kept)
    mean_x = sum(xs) / n
    mean_y = sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_clock needs samples spread over time (all brackets have the same midpoint)")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = mean_y - slope * mean_x  # foreign - ref_foreign at mono == ref_mono
    residuals = [y - (intercept + slope * x) for x, y in zip(xs, ys, strict=True)]
    rms = math.sqrt(sum(r * r for r in residuals) / n)
    return ClockFit(
        ref_mono_ns=ref_mono,
        offset_ns=(ref_foreign - ref_mono) + round(intercept),  # int: 1e18-sized floats lose 128 ns
        drift_ppm=(slope - 1.0) * 1e6,
        residual_ns=rms,
        max_residual_ns=max(abs(r) for r in residuals),
        samples=n,
    )
