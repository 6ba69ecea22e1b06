"""The in-situ cost scale, learned online from what shedding actually changed.

A calibrated per-hit cost is measured in a tight loop; inside a real workload a hit costs more (the
trap path with cold caches, the workload's own code slower after each trap) by a factor that depends
on the workload and the host. The governor starts from a prior (DEFAULT_COST_SCALE) and corrects it
each time one of its own actions gives a clean before/after:

    predicted = the calibrated (unscaled) CPU per token step of the probes the action switched, times
                the cores each hit holds up (the governor's stall: a waiting thread's spin is CPU too)
    observed  = the workload's CPU per step over a window before the action, minus over a window after
                (after minus before for a restore)
    sample    = observed / predicted, clipped to [SCALE_MIN, SCALE_MAX]
    scale     = (1 - ALPHA) * scale + ALPHA * sample       (an EWMA: one noisy window moves it by 30%)

An observation counts only when it can say something: the prediction is at least MIN_SIGNAL of the
workload's CPU per step (smaller changes drown in the 1-4% step-to-step noise), both windows saw at
least MIN_STEPS steps, and no other action fell inside either window. The workload's CPU per step
comes from /proc/PID/stat (utime + stime, the traps included) and the step count from the exact
aggregates' step sequence numbers (the shm context cell's step_seq); a workload without token steps
keeps the prior.
"""

from __future__ import annotations

from dataclasses import dataclass

SCALE_MIN = 0.5  # below the calibration's own cost: a learned value under it is noise
SCALE_MAX = 8.0  # 3x the largest factor measured here (docs/governor.md): beyond it, something else moved
ALPHA = 0.3
MIN_SIGNAL = 0.02  # the predicted change must be >= 2% of the CPU per step to be learned from
MIN_STEPS = 8


@dataclass(frozen=True)
class Window:
    """The workload over one window: CPU seconds and token steps."""

    cpu_s: float
    steps: float

    @property
    def cpu_per_step(self) -> float | None:
        return self.cpu_s / self.steps if self.steps >= MIN_STEPS else None


@dataclass
class Pending:
    """An action waiting for its after-window."""

    at_s: float
    sign: float  # +1: a shed (CPU per step should fall), -1: a restore (it should rise)
    predicted_per_step: float  # calibrated (unscaled) CPU seconds per step of the switched probes, stalled
    before: Window
    cpu_at: float  # the workload's CPU and step counters at the action
    steps_at: float


def learned_sample(pending: Pending, after: Window) -> float | None:
    """observed / predicted for one action, clipped; None when the observation cannot say anything."""
    before_per_step, after_per_step = pending.before.cpu_per_step, after.cpu_per_step
    if before_per_step is None or after_per_step is None or pending.predicted_per_step <= 0:
        return None
    if pending.predicted_per_step < MIN_SIGNAL * before_per_step:
        return None
    observed = pending.sign * (before_per_step - after_per_step)
    return min(max(observed / pending.predicted_per_step, SCALE_MIN), SCALE_MAX)


def updated_scale(scale: float, sample: float) -> float:
    return min(max((1 - ALPHA) * scale + ALPHA * sample, SCALE_MIN), SCALE_MAX)
