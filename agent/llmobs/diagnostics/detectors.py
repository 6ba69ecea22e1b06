"""Token-loss anomaly detectors: each token's loss against the preceding window of the same request.

Three detectors, selectable (`calibrated`, `ttest`, `mad`; `both` is ttest + mad, `all` the three):
- `calibrated` (llmobs.diagnostics.conformal): the token's conformal p-value against the losses seen
  before it of the same (process, variant, position bucket); flagged when p <= alarm_rate, the
  false-alarm budget per token, which clean traffic then gets whatever the loss distribution. A
  request's verdict is Benjamini-Hochberg at level fdr over its p-values so far.
- `ttest`: one-sided one-sample t-test of the token's loss against the window's mean. The window is a
  sample of n losses; the question is whether the new loss is a draw from the same distribution, so
  the standard error is that of a new observation, sd * sqrt(1 + 1/n) (Student's prediction interval),
  not sd / sqrt(n) (which asks whether the token equals the window's mean, and flags almost any token
  of a long window). t has n - 1 degrees of freedom; the token is flagged when P(T >= t) < alpha.
- `mad`: the robust form: modified z = 0.6745 (x - median) / MAD (Iglewicz & Hoaglin); flagged above
  a threshold (3.5 by default). One huge earlier spike in the window moves the t-test's mean and sd,
  not the median and MAD.
Both are one-sided (a loss *rise* is the anomaly) and floor the window's spread at `min_sd` nats: a
flat series (sd 0) must not turn a 0.001-nat wobble into an infinite score.

`score_sequence` scores a whole sequence at once (tests, the offline evaluation); `StreamingDetector`
scores token steps as they arrive from the map, with O(window) state per open request and a bounded
number of open requests (least recently updated evicted first, counted). Both share `_score`, which
is vectorised over the tokens of a batch: one numpy pass per request per batch, not per token.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from llmobs.diagnostics.conformal import (
    DEFAULT_BUCKETS,
    FORCED,
    GENERATED,
    KIND_NAMES,
    SCALAR_BATCH,
    VARIANT_NAMES,
    CalibratedScores,
    ConformalScorer,
    RequestTests,
)
from llmobs.diagnostics.student_t import (  # not scipy: ~67 MB resident
    _tail_below_scalar,
    t_cdf,
    upper_tail_below,
)

DETECTORS = ("calibrated", "ttest", "mad")
WINDOWED = ("ttest", "mad")  # the detectors that test a token against its request's window
SELECTIONS = {d: (d,) for d in DETECTORS} | {"both": WINDOWED, "all": DETECTORS}
MAD_TO_Z = 0.6745  # the modified z-score's constant: MAD of a standard normal is 0.6745
DEFAULT_ALARM_RATE = 1e-3  # calibrated: false alarms per clean token (docs/diagnostics.md: the evaluation)
# What the agent runs unless told otherwise (attach --detector, the daemon's detector.name): the
# calibrated detector, with its raw score and a flag's aftermath, matched or beat the t-test's and MAD's
# F1 on every fault kind of the held-out evaluation at the default budget (docs/diagnostics.md), with
# the false-alarm rate it was set to.
AGENT_DETECTOR = "calibrated"
CALIBRATED_SCORES = ("raw", "relative")
MIN_ALARM_RATE, MAX_ALARM_RATE = 1e-6, 0.1  # below 1e-6 the warm-up is a million tokens


@dataclass(frozen=True)
class DetectorConfig:
    """What the detectors test and how strictly. `detector`: calibrated | ttest | mad | both | all."""

    detector: str = AGENT_DETECTOR
    window: int = 32  # preceding tokens of the request the test compares against
    min_history: int = 8  # no verdict before this many preceding tokens
    alpha: float = 0.01  # t-test: one-sided significance level
    mad_threshold: float = 3.5  # mad: modified z-score above which a token is flagged
    min_sd: float = 0.05  # nats: floor of the window's spread (sd; MAD scaled to sd)
    max_open: int = 4096  # open requests kept; beyond, the least recently updated is evicted
    alarm_rate: float = DEFAULT_ALARM_RATE  # calibrated: the false-alarm budget per clean token
    fdr: float = 0.01  # calibrated: Benjamini-Hochberg level of a request's verdict
    buckets: tuple[int, ...] = DEFAULT_BUCKETS  # calibrated: position bucket edges
    max_references: int = 64  # calibrated: references kept (32 KiB each)
    seed: int = 0  # calibrated: the generator of the p-values' tie-breaking uniforms
    # calibrated: what is ranked. raw: the token's loss (the held-out SmolLM2 evaluation's better one);
    # relative: its `mad` z against its request's window, the raw loss for its first min_history tokens
    # (sees spikes small against the spread between requests; docs/diagnostics.md has both evaluations)
    calibrated_score: str = "raw"
    # calibrated: a flagged token's aftermath, the next `aftermath` tokens of its request (0: none). The
    # flagged token is their context, which raises their loss: one is flagged only if its loss also
    # stands out within its request (its `mad` z above aftermath_z), else it is a consequence, untested.
    aftermath: int = 16
    aftermath_z: float = 6.0

    def __post_init__(self) -> None:
        if self.detector not in SELECTIONS:
            raise ValueError(f"detector must be one of {', '.join(SELECTIONS)}, not {self.detector!r}")
        if self.window < 2:
            raise ValueError(f"window must be >= 2 tokens, not {self.window}")
        if not 2 <= self.min_history <= self.window:
            raise ValueError(f"min_history must be in [2, window={self.window}], not {self.min_history}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), not {self.alpha}")
        if self.mad_threshold <= 0:
            raise ValueError(f"mad_threshold must be > 0, not {self.mad_threshold}")
        if self.min_sd < 0:
            raise ValueError(f"min_sd must be >= 0, not {self.min_sd}")
        if self.max_open < 1:
            raise ValueError(f"max_open must be >= 1, not {self.max_open}")
        if not MIN_ALARM_RATE <= self.alarm_rate <= MAX_ALARM_RATE:
            raise ValueError(
                f"alarm_rate must be in [{MIN_ALARM_RATE:g}, {MAX_ALARM_RATE:g}], not {self.alarm_rate}"
            )
        if not 0.0 < self.fdr < 1.0:
            raise ValueError(f"fdr must be in (0, 1), not {self.fdr}")
        edges = list(self.buckets)
        if edges != sorted(set(edges)) or len(edges) > 62 or min(edges, default=1) < 1:
            raise ValueError(f"buckets must be increasing positions >= 1 (at most 62), not {self.buckets}")
        if self.max_references < 1:
            raise ValueError(f"max_references must be >= 1, not {self.max_references}")
        if self.aftermath < 0:
            raise ValueError(f"aftermath must be >= 0 tokens, not {self.aftermath}")
        if self.aftermath_z <= 0:
            raise ValueError(f"aftermath_z must be > 0, not {self.aftermath_z}")
        if self.calibrated_score not in CALIBRATED_SCORES:
            choices = ", ".join(CALIBRATED_SCORES)
            raise ValueError(f"calibrated_score must be one of {choices}, not {self.calibrated_score!r}")

    @property
    def enabled(self) -> tuple[str, ...]:
        return SELECTIONS[self.detector]

    @property
    def windowed(self) -> tuple[str, ...]:
        """The enabled detectors that test against the request's window (ttest, mad)."""
        return tuple(d for d in self.enabled if d in WINDOWED)


@dataclass
class Scores:
    """Per token of one sequence: both detectors' statistics (NaN where not tested) and verdicts."""

    n: np.ndarray  # preceding losses in the window
    mean: np.ndarray
    sd: np.ndarray
    t: np.ndarray
    p: np.ndarray
    median: np.ndarray
    mad: np.ndarray
    z: np.ndarray
    ttest: np.ndarray  # bool: flagged by the t-test
    mad_flag: np.ndarray  # bool: flagged by median/MAD

    def flagged(self, detector: str) -> np.ndarray:
        return self.ttest if detector == "ttest" else self.mad_flag


def _score(history: np.ndarray, values: np.ndarray, seen: int, config: DetectorConfig) -> Scores:
    """Score `values` (finite losses, in order) given up to `window` finite losses before them and the
    count of finite losses the request had before them (`seen`, which may exceed the history kept)."""
    w = config.window
    seq = np.concatenate([np.full(w, np.nan), history[-w:], values]).astype(np.float64)
    start = w + min(len(history), w)
    windows = sliding_window_view(seq, w)[start - w : start - w + len(values)]  # row i: the w before i
    return _score_windows(windows, values, seen + np.arange(len(values)), config)


def _score_windows(
    windows: np.ndarray, values: np.ndarray, seen: np.ndarray, config: DetectorConfig, every_p: bool = True
) -> Scores:
    """Score each value against its row of `windows` (the up to `window` finite losses before it, NaN
    where there are fewer), `seen[i]` being the finite losses its request had before it. Rows may
    belong to different requests: one numpy pass for a whole batch. every_p False (the streaming path,
    which reads p only for flagged rows): p is exact where p < alpha and NaN elsewhere, same verdicts."""
    n = np.count_nonzero(~np.isnan(windows), axis=1)
    tested = seen >= config.min_history
    tested &= n >= 2
    valid = ~np.isnan(windows)
    count = np.maximum(n, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(valid, windows, 0.0).sum(axis=1) / count
        deviation = np.where(valid, windows - mean[:, None], 0.0)
        sd = np.maximum(np.sqrt((deviation**2).sum(axis=1) / np.maximum(n - 1, 1)), config.min_sd)
        t = (values - mean) / (sd * np.sqrt(1.0 + 1.0 / count))
        df = np.maximum(n - 1, 1)
        p = t_cdf(df, -t) if every_p else upper_tail_below(df, t, config.alpha)  # P(T >= t)
        median, mad, z = _robust_z(windows, values, n, config)
    nan = np.full(len(values), np.nan)
    return Scores(
        n=np.where(tested, n, 0),
        mean=np.where(tested, mean, nan),
        sd=np.where(tested, sd, nan),
        t=np.where(tested, t, nan),
        p=np.where(tested, p, nan),
        median=np.where(tested, median, nan),
        mad=np.where(tested, mad, nan),
        z=np.where(tested, z, nan),
        ttest=tested & (p < config.alpha),
        mad_flag=tested & (z > config.mad_threshold),
    )


def _robust_z(windows: np.ndarray, values: np.ndarray, n: np.ndarray, config: DetectorConfig):
    """(median, MAD, modified z) of each value against its row of `windows` (its first-sorted `n`
    finite values): the MAD detector's statistic, and the calibrated detector's request-relative score."""
    median = _row_median(windows, n)
    mad = _row_median(np.abs(windows - median[:, None]), n)
    mad_floor = np.maximum(mad, config.min_sd * MAD_TO_Z)  # sd = MAD / 0.6745 for a normal
    return median, mad, MAD_TO_Z * (values - median) / mad_floor


def _row_median(rows: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Median of each row's first-sorted `n` values (NaN sorts last): np.nanmedian's result without its
    masked-array path, which costs ~100x more on the short rows of a live poll."""
    ordered = np.sort(rows, axis=1)
    low = np.take_along_axis(ordered, np.maximum((n - 1) // 2, 0)[:, None], axis=1)[:, 0]
    high = np.take_along_axis(ordered, np.maximum(n // 2, 0)[:, None], axis=1)[:, 0]
    return (low + high) / 2.0


def _score_scalar(history: list[float], values: list[float], seen: int, config: DetectorConfig) -> Scores:
    """`_score` in Python floats with the streaming path's p (`_score_windows(every_p=False)`: exact
    where p < alpha, else NaN), for the few steps of a tiny batch (the numpy pass costs ~0.9 ms
    whatever its size). The same operations in the same order, to the bit: each sum is numpy's pairwise
    sum of the same zero-padded row (`_pairwise_sum`), the medians index the same sorted values, and a
    division by zero gives numpy's inf / NaN. The fields are lists, indexed as the arrays are."""
    w = config.window
    seq = [*history[-w:], *values]
    offset = len(seq) - len(values)  # where values[0] is in seq
    out: dict[str, list] = {name: [] for name in Scores.__dataclass_fields__}
    for i, value in enumerate(values):
        window = seq[max(0, offset + i - w) : offset + i]
        n = len(window)
        if seen + i < config.min_history or n < 2:
            for name in ("mean", "sd", "t", "p", "median", "mad", "z"):
                out[name].append(math.nan)
            out["n"].append(0)
            out["ttest"].append(False)
            out["mad_flag"].append(False)
            continue
        pad = [0.0] * (w - n)  # numpy sums the window's NaN slots as zeros, on the left
        mean = _pairwise_sum([*pad, *window]) / n
        squares = [*pad, *((v - mean) * (v - mean) for v in window)]
        sd = max(math.sqrt(_pairwise_sum(squares) / (n - 1)), config.min_sd)
        t = _divide(value - mean, sd * math.sqrt(1.0 + 1.0 / n))
        p = _tail_below_scalar(float(n - 1), t, config.alpha)
        median, mad, z = _robust_z_scalar(window, value, config)
        for name, v in (("n", n), ("mean", mean), ("sd", sd), ("t", t), ("p", p), ("median", median),
                        ("mad", mad), ("z", z), ("ttest", p < config.alpha),
                        ("mad_flag", z > config.mad_threshold)):  # fmt: skip
            out[name].append(v)
    return Scores(**out)


def _robust_z_scalar(window: list[float], value: float, config: DetectorConfig) -> tuple[float, float, float]:
    """`_robust_z` of one value against its window (at least 2 finite losses) in Python floats, bit for
    bit: the medians index the same sorted values, and a zero MAD floor gives numpy's inf / NaN."""
    n = len(window)
    ordered = sorted(window)
    median = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2.0
    spread = [abs(v - median) for v in window]
    spread.sort()
    mad = (spread[(n - 1) // 2] + spread[n // 2]) / 2.0
    return median, mad, _divide(MAD_TO_Z * (value - median), max(mad, config.min_sd * MAD_TO_Z))


def _pairwise_sum(row: list[float]) -> float:
    """np.add.reduce of a contiguous float64 row, in the same order (numpy's pairwise_sum: below 8
    elements a plain loop, up to 128 eight interleaved partial sums, beyond that halves)."""
    n = len(row)
    if n < 8:
        total = 0.0
        for v in row:
            total += v
        return total
    if n <= 128:
        r = row[:8]
        end = n - n % 8
        for i in range(8, end, 8):
            for j in range(8):
                r[j] += row[i + j]
        total = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
        for v in row[end:]:
            total += v
        return total
    half = n // 2
    half -= half % 8
    return _pairwise_sum(row[:half]) + _pairwise_sum(row[half:])


def _divide(a: float, b: float) -> float:
    """a / b with numpy's (IEEE) answer for b == 0 (min_sd 0 on a flat window), not ZeroDivisionError."""
    try:
        return a / b
    except ZeroDivisionError:
        if a == 0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)


def score_sequence(losses, config: DetectorConfig | None = None) -> Scores:
    """Score every token of one request's losses (in step order). NaN losses (no target) are neither
    tested nor part of any window; their rows come back untested."""
    config = config or DetectorConfig(detector="both")
    losses = np.asarray(losses, dtype=np.float64)
    finite = np.isfinite(losses)
    inner = _score(np.empty(0), losses[finite], 0, config)
    out = {}
    for name in Scores.__dataclass_fields__:
        part = getattr(inner, name)
        full = np.zeros(len(losses), part.dtype) if part.dtype != np.float64 else np.full(len(losses), np.nan)
        full[finite] = part
        out[name] = full
    return Scores(**out)


# ---- streaming -------------------------------------------------------------------------------------


@dataclass
class DetectorCounters:
    steps: int = 0  # token steps seen
    tested: int = 0  # token steps with enough history to be tested
    anomalies: int = 0  # rows produced (a token flagged by both detectors counts twice)
    evicted: int = 0  # open requests dropped to stay within max_open
    open: int = 0
    seconds: float = 0.0  # CPU time spent scoring (the scoring thread's)
    warmup: int = 0  # calibrated: token steps not tested, their reference still too small
    requests_flagged: int = 0  # calibrated: requests Benjamini-Hochberg flagged (at their first discovery)
    aftermath: int = 0  # calibrated: tokens in a flag's aftermath, untested unless they stand out (no rows)
    consequences: int = 0  # calibrated: of those, the ones its score alone would have flagged


@dataclass
class _Open:
    # the last `window` finite losses: an array, or a list where the calibrated detector alone moved
    # them on in a tiny poll (`_relative_z_scalar`: no array a poll); every reader takes either
    history: np.ndarray | list[float]
    seen: int = 0  # finite losses seen so far
    tests: RequestTests | None = None  # calibrated: the request's p-values for its BH verdict
    last_flag: int = -(1 << 62)  # calibrated: the step of the request's last flagged token


# up to this many steps a batch is scored in Python floats (`_score_scalar`, `_add_calibrated_tiny`)
TINY_BATCH = 4
SMALL_BATCH = 32  # up to this many steps a batch's request keys are made in Python
FEW_REQUESTS = 2  # up to this many requests in a batch each is scored on its own

ANOMALY_COLUMNS = (
    "ts_ns", "pid", "step_seq", "trace_id", "kind", "score", "detail",
    "first_step_seq", "step", "batch_row", "detector",
)  # fmt: skip


@dataclass
class StreamingDetector:
    """Scores token-step batches (the map reader's columns) as they arrive; returns anomaly rows."""

    config: DetectorConfig = field(default_factory=DetectorConfig)
    counters: DetectorCounters = field(default_factory=DetectorCounters)

    def __post_init__(self) -> None:
        self._open: OrderedDict[tuple, _Open] = OrderedDict()
        self._forced_open: set[tuple] = set()  # open requests keyed by their pass (teacher forcing)
        c = self.config
        self.calibrated = (
            ConformalScorer(c.alarm_rate, c.buckets, c.max_references, seed=c.seed)
            if "calibrated" in c.enabled
            else None
        )

    def add(self, steps: dict, now_ns: int) -> dict[str, list] | None:
        """Score one batch of token steps; the anomaly rows ({column: list}, ANOMALY_COLUMNS) or None.

        Steps of one request arrive in order (one process publishes its forward passes in sequence);
        a batch may mix requests and batch rows, which are grouped here."""
        began = time.thread_time()  # this thread's: the process's clock sums every thread, and costs more
        n = len(steps["step_seq"])
        self.counters.steps += n
        if n == 0:
            return None
        calibrated_rows = self._add_calibrated(steps, now_ns) if self.calibrated is not None else None
        if not self.config.windowed:
            return self._finish(calibrated_rows, began)
        if n <= TINY_BATCH:  # a slowly stepping target's poll: no numpy call at all
            return self._finish(_joined(calibrated_rows, self._add_tiny(steps, now_ns)), began)
        step_seq = np.asarray(steps["step_seq"], np.int64)
        step = np.asarray(steps["step"], np.int64)
        batch_row = np.asarray(steps["batch_row"], np.int64)
        pid = np.asarray(steps["pid"], np.int64)
        loss = np.asarray(steps["loss"], np.float64)
        traces = steps["trace_id"]
        rows: dict[str, list] = {c: [] for c in ANOMALY_COLUMNS}
        # Every request of the batch scored in one numpy pass (not one per request): the requests'
        # keys, their token steps in step order, each step's window from its request's history and the
        # steps before it in this batch.
        if n <= SMALL_BATCH:  # a few steps: keys in Python cost less than the numpy calls
            group, first, keys = self._small_groups(pid, traces, step_seq, step, batch_row)
        else:
            group, first, keys = self._request_groups(pid, traces, step_seq, step, batch_row)
        if len(keys) <= FEW_REQUESTS:  # one numpy pass per request is cheaper than the batch's setup
            for g in sorted(range(len(keys)), key=lambda g: first[g]):
                idx = np.flatnonzero(group == g)
                idx = idx[np.argsort(step[idx], kind="stable")]
                finite = idx[np.isfinite(loss[idx])]
                if not len(finite):
                    continue
                state = self._state(keys[g])
                values = loss[finite]
                scores = _score(state.history, values, state.seen, self.config)
                state.history = np.concatenate([state.history, values])[-self.config.window :]
                state.seen += len(values)
                self.counters.tested += int(np.count_nonzero(scores.n))
                for detector in self.config.windowed:
                    for j in np.flatnonzero(scores.flagged(detector)):
                        self._row(rows, steps, int(finite[j]), detector, scores, j, now_ns, keys[g])
            order = ()
        else:
            order = np.lexsort(
                (step, group)
            )  # by request, then step (stable: a pass's rows keep their order)
            order = order[np.isfinite(loss[order])]
        if len(order):
            scores, finite, by_group = self._score_batch(order, group[order], loss, first, keys)
            self.counters.tested += int(np.count_nonzero(scores.n))
            flagged = [(d, np.flatnonzero(scores.flagged(d))) for d in self.config.windowed]
            if any(len(f) for _d, f in flagged):
                for g in by_group:  # rows in the order the requests first appear, detector by detector
                    for detector, hits in flagged:
                        for j in hits[group[finite[hits]] == g]:
                            self._row(rows, steps, int(finite[j]), detector, scores, int(j), now_ns, keys[g])
        return self._finish(_joined(calibrated_rows, rows), began)

    def _finish(self, rows: dict[str, list] | None, began: float) -> dict[str, list] | None:
        self.counters.open = len(self._open)
        self.counters.seconds += time.thread_time() - began
        if not rows or not rows["ts_ns"]:
            return None
        self.counters.anomalies += len(rows["ts_ns"])
        return rows

    def _add_tiny(self, steps: dict, now_ns: int) -> dict[str, list]:
        """`add`'s one-request-at-a-time path for a few steps, in Python lists and floats: the same
        request keys, order, open state and rows (test_diag_detect checks it against the numpy path)."""
        step_seq, step, batch_row, pid = (
            _as_list(steps[c]) for c in ("step_seq", "step", "batch_row", "pid")
        )
        loss = [float(v) for v in _as_list(steps["loss"])]
        rows: dict[str, list] = {c: [] for c in ANOMALY_COLUMNS}
        groups: dict[tuple, list[int]] = {}  # in order of first appearance, as the numpy path
        for i, key in enumerate(self._request_keys(pid, steps["trace_id"], step_seq, step, batch_row)):
            groups.setdefault(key, []).append(i)
        w = self.config.window
        for key, members in groups.items():
            members.sort(key=step.__getitem__)  # stable, as argsort(kind="stable")
            finite = [i for i in members if math.isfinite(loss[i])]
            if not finite:
                continue
            state = self._state(key)
            history = _as_list(state.history)
            values = [loss[i] for i in finite]
            scores = _score_scalar(history, values, state.seen, self.config)
            state.history = np.array([*history, *values][-w:], dtype=np.float64)
            state.seen += len(values)
            self.counters.tested += sum(1 for count in scores.n if count)
            for detector in self.config.windowed:
                for j, hit in enumerate(scores.flagged(detector)):
                    if hit:
                        self._row(rows, steps, finite[j], detector, scores, j, now_ns, key)
        return rows

    def _add_calibrated(self, steps: dict, now_ns: int) -> dict[str, list] | None:
        """The calibrated detector over the batch: each token's p-value (ConformalScorer), then each
        request's Benjamini-Hochberg verdict; rows for the tokens with p <= alarm_rate. A slow target's
        poll takes Python scalars (`_add_calibrated_tiny`), with the same rows, counters and state."""
        n = len(steps["step_seq"])
        if 0 < n <= TINY_BATCH and n <= SCALAR_BATCH:  # the scorer's float path too: same arithmetic
            poll = _tiny_poll(steps, n)
            if poll is not None:
                return self._add_calibrated_tiny(steps, poll, now_ns)
        return self._add_calibrated_arrays(steps, now_ns)

    def _add_calibrated_arrays(self, steps: dict, now_ns: int) -> dict[str, list] | None:
        """`_add_calibrated` vectorised: one p-value pass over the batch, then `_calibrated_verdicts`."""
        n = len(steps["step_seq"])
        step_seq = np.asarray(steps["step_seq"], np.int64)
        step = np.asarray(steps["step"], np.int64)
        batch_row = np.asarray(steps["batch_row"], np.int64)
        pid = np.asarray(steps["pid"], np.int64)
        loss = np.asarray(steps["loss"], np.float64)
        if n <= SMALL_BATCH:
            group, first, keys = self._small_groups(pid, steps["trace_id"], step_seq, step, batch_row)
        else:
            group, first, keys = self._request_groups(pid, steps["trace_id"], step_seq, step, batch_row)
        finite = np.flatnonzero(np.isfinite(loss))
        if not len(finite):
            return None
        forced = np.fromiter((k in self._forced_open for k in keys), bool, len(keys))
        variant = np.where(forced[group[finite]], FORCED, GENERATED)
        position = np.asarray(steps["position"], np.int64)[finite]
        z = None
        if self.config.calibrated_score == "relative" or self.config.aftermath:
            z = self._relative_z(group, step, loss, first, keys)[finite]
        relative = z if self.config.calibrated_score == "relative" else None
        before = self.calibrated.counters.warmup
        scores = self.calibrated.score(pid[finite], variant, position, loss[finite], relative)
        self.counters.warmup += self.calibrated.counters.warmup - before
        return self._calibrated_verdicts(steps, now_ns, scores, z, relative, variant, group, step, finite,
                                         first, keys)  # fmt: skip

    def _calibrated_verdicts(self, steps, now_ns, scores, z, relative, variant, group, step, finite, first,
                             keys) -> dict[str, list] | None:  # fmt: skip
        """The scored tokens' aftermath, each request's Benjamini-Hochberg verdict and the flagged tokens'
        rows. Arrays: `finite` (the tokens scored, indices of the batch), `scores`, `z`, `relative` and
        `variant` (one per token scored), `group` and `step` (per step of the batch), `first` (per
        request, as `keys`)."""
        if self.config.aftermath:
            self._aftermath(scores, z, group[finite], step[finite], keys)
        if not self.config.windowed:
            self.counters.tested += int(np.count_nonzero(~np.isnan(scores.p)))
        # each request's BH verdict over its tested p-values (the few requests of a poll, or a pass)
        tested = np.flatnonzero(~np.isnan(scores.p))
        verdict: dict[int, int] = {}
        if len(tested):
            groups_of = group[finite[tested]]
            order = np.argsort(groups_of, kind="stable")
            bounds = np.flatnonzero(np.diff(groups_of[order])) + 1
            for part in np.split(order, bounds):
                g = int(groups_of[part[0]])
                verdict[g] = self._request_verdict(keys[g], scores.p[tested[part]].tolist())
        hits = np.flatnonzero(scores.flagged)
        if not len(hits):
            return None
        rows: dict[str, list] = {c: [] for c in ANOMALY_COLUMNS}
        for j in sorted(hits.tolist(), key=lambda j: (first[group[finite[j]]], step[finite[j]])):
            i = int(finite[j])
            g = int(group[i])
            state = self._open.get(keys[g])
            tests = state.tests if state is not None else None
            detail = {
                "p_value": float(scores.p[j]),
                "alarm_rate": self.config.alarm_rate,
                "reference_n": int(scores.reference_n[j]),
                "score": KIND_NAMES[int(scores.relative[j])],  # the p-value's score (combined: which side)
                "calibrated_score": self.config.calibrated_score,
                "z": float(relative[j]) if scores.relative[j] else None,  # relative is set
                "reference": f"{VARIANT_NAMES[int(variant[j])]}/bucket {int(scores.bucket[j])}",
                "request_tested": tests.tested if tests else 0,
                "request_discoveries": verdict.get(g, 0),
                "fdr": self.config.fdr,
            }  # fmt: skip
            self._append_row(rows, steps, i, "calibrated", -math.log10(max(float(scores.p[j]), 1e-300)),
                             detail, now_ns, keys[g])  # fmt: skip
        return rows

    def _add_calibrated_tiny(self, steps: dict, poll: _TinyPoll, now_ns: int) -> dict[str, list] | None:
        """`_add_calibrated_arrays` for a poll of a few steps in Python lists, floats and ints: its ~50
        numpy calls on arrays of 1-4 elements cost ~0.5 ms a poll (cold, after the poll's sleep). The
        same request keys, scores, aftermath, verdicts, counters and state changes, in the same order.
        A poll with a flagged token (rare) hands its scores, as arrays, to `_calibrated_verdicts`."""
        keys_of = self._request_keys(poll.pid, steps["trace_id"], poll.step_seq, poll.step, poll.batch_row)
        group, first, keys = _grouped(keys_of)
        finite = [i for i, loss in enumerate(poll.loss) if math.isfinite(loss)]
        if not finite:
            return None
        forced = [key in self._forced_open for key in keys]  # before the windows: they may evict
        variant = [FORCED if forced[group[i]] else GENERATED for i in finite]
        z = None
        if self.config.calibrated_score == "relative" or self.config.aftermath:
            every_z = self._relative_z_scalar(group, poll.step, poll.loss, keys)
            z = [every_z[i] for i in finite]
        relative = z if self.config.calibrated_score == "relative" else None
        before = self.calibrated.counters.warmup
        scores = self.calibrated.score_scalars([poll.pid[i] for i in finite], variant,
                                               [poll.position[i] for i in finite],
                                               [poll.loss[i] for i in finite], relative)  # fmt: skip
        self.counters.warmup += self.calibrated.counters.warmup - before
        if any(scores.flagged):  # rows to build: the vectorised verdicts on this poll's arrays
            z_array = None if z is None else np.array(z, np.float64)
            return self._calibrated_verdicts(
                steps, now_ns, scores.as_arrays(), z_array, z_array if relative is not None else None,
                np.array(variant, np.int64), np.array(group, np.int64), np.array(poll.step, np.int64),
                np.array(finite, np.intp), np.array(first, np.int64), keys,
            )  # fmt: skip
        self._unflagged_verdicts(scores, z, [group[i] for i in finite], [poll.step[i] for i in finite], keys)
        return None

    def _unflagged_verdicts(self, scores: CalibratedScores, z, group, step, keys) -> None:
        """`_calibrated_verdicts` for a tiny poll with no flagged token, in Python scalars: the aftermath
        of the requests' earlier flags, the tested count and each request's Benjamini-Hochberg verdict
        (no rows). Lists (`scores`' fields too), one item per token scored."""
        if self.config.aftermath:
            self._aftermath(scores, z, group, step, keys)
        p = scores.p
        tested = [j for j, value in enumerate(p) if value == value]
        if not self.config.windowed:
            self.counters.tested += len(tested)
        by_request: dict[int, list[float]] = {}  # in token order within a request, as the stable argsort
        for j in tested:
            by_request.setdefault(group[j], []).append(p[j])
        for g in sorted(by_request):
            self._request_verdict(keys[g], by_request[g])

    def _request_verdict(self, key: tuple, p_values: list[float]) -> int:
        """The request's Benjamini-Hochberg discoveries once `p_values` (its tested tokens of this batch)
        join its earlier ones; a request's first discovery is counted."""
        state = self._state(key)
        if state.tests is None:
            state.tests = RequestTests()
        had = state.tests.discoveries
        discoveries = state.tests.add(p_values, self.config.fdr)
        if discoveries and not had:
            self.counters.requests_flagged += 1
        return discoveries

    def _aftermath(self, scores: CalibratedScores, z, group, step, keys) -> None:
        """Leave a flagged token's aftermath untested: the next `aftermath` tokens of its request read the
        flagged token as context, and a garbage token in the context raises the loss of what follows
        it (the flag before them already reports it). One is flagged only if its loss also stands out
        within its request: its `mad` z above `aftermath_z`, whose window (median, MAD) the one spike
        does not move. Whether a token is in an aftermath depends only on the tokens before it, so the
        tested ones' p-values stay uniform on clean traffic: the false-alarm rate per tested token is
        still the budget (fewer tokens are tested: about alarm_rate x aftermath of them fewer)."""
        if len(step) <= TINY_BATCH and not any(scores.flagged):  # a slow target's poll: Python scalars
            self._untest_aftermath(scores.p, group, step, keys)
            return
        state_of = {}
        flags: dict[int, list[int]] = {}  # group -> the flag steps (its last before this batch first)
        for j in sorted(np.flatnonzero(scores.flagged).tolist(), key=lambda j: (int(group[j]), int(step[j]))):
            g = int(group[j])
            state = state_of.get(g) or state_of.setdefault(g, self._state(keys[g]))
            if 0 < step[j] - state.last_flag <= self.config.aftermath and not z[j] > self.config.aftermath_z:
                scores.flagged[j] = False
                self.counters.consequences += 1
                continue
            flags.setdefault(g, [state.last_flag]).append(int(step[j]))
            state.last_flag = int(step[j])
        tested = ~np.isnan(scores.p)
        for g in np.unique(group[tested]).tolist():
            members = np.flatnonzero(tested & (group == g))
            if g not in flags:
                state = state_of.get(g) or self._state(keys[g])
                flags[g] = [state.last_flag]
            marks = np.asarray(flags[g], np.int64)  # ascending: the last flag before, then this batch's
            steps = step[members]
            before = marks[np.maximum(np.searchsorted(marks, steps, side="left") - 1, 0)]
            inside = (steps - before > 0) & (steps - before <= self.config.aftermath)
            after = members[inside & ~scores.flagged[members]]
            scores.p[after] = np.nan
            self.counters.aftermath += len(after)

    def _untest_aftermath(self, p, group, step, keys) -> None:
        """`_aftermath` for a few tokens none of which is flagged (p, group, step: arrays or lists, one
        item per token scored): a tested one inside its request's last flag's aftermath becomes
        untested (p NaN), counted."""
        for j, value in enumerate(p):
            if value != value:  # not tested
                continue
            state = self._state(keys[int(group[j])])
            if 0 < step[j] - state.last_flag <= self.config.aftermath:
                p[j] = math.nan
                self.counters.aftermath += 1

    def _relative_z(self, group, step, loss, first, keys) -> np.ndarray:
        """Each step's request-relative score for the calibrated detector: the MAD detector's modified z
        of its loss against its request's preceding window (NaN: fewer than min_history finite losses
        before it, or a NaN loss). The windowed detectors, when enabled, keep the requests' windows
        (they run after this); alone, the calibrated detector keeps them here."""
        z = np.full(len(loss), np.nan)
        if len(loss) <= TINY_BATCH and not self.config.windowed:  # a slow target's poll: Python floats
            return self._relative_z_tiny(z, group, step, loss, keys)
        order = np.lexsort((step, group))  # by request, then step (stable: a pass's rows keep their order)
        order = order[np.isfinite(loss[order])]
        if not len(order):
            return z
        windows, values, seen, commit, _by_group = self._batch_windows(order, group[order], loss, first, keys)
        n = np.count_nonzero(~np.isnan(windows), axis=1)
        tested = (seen >= self.config.min_history) & (n >= 2)
        if tested.any():
            with np.errstate(invalid="ignore", divide="ignore"):
                _median, _mad, scores = _robust_z(windows[tested], values[tested], n[tested], self.config)
            z[order[tested]] = scores
        if not self.config.windowed:
            commit()
        return z

    def _relative_z_tiny(self, z, group, step, loss, keys) -> np.ndarray:
        """`_relative_z` for a few steps, in Python floats: the same windows, the MAD detector's z as
        `_score_scalar` computes it (bit for bit `_robust_z`'s), and the same open state after it."""
        w, c = self.config.window, self.config
        for i in sorted(range(len(loss)), key=lambda i: (int(group[i]), int(step[i]))):
            value = float(loss[i])
            if not math.isfinite(value):
                continue
            state = self._state(keys[int(group[i])])
            window = _as_list(state.history[-w:])
            if state.seen >= c.min_history and len(window) >= 2:
                z[i] = _robust_z_scalar(window, value, c)[2]
            state.history = np.array([*window, value][-w:], dtype=np.float64)
            state.seen += 1
        return z

    def _relative_z_scalar(self, group: list[int], step: list[int], loss: list[float], keys) -> list[float]:
        """`_relative_z` for a tiny poll in Python lists and floats: each step's z against its request's
        window (NaN: too little history, or a loss not finite), `_robust_z_scalar`'s bit for bit, the
        requests' open state touched in the same order. Alone, the calibrated detector moves their windows
        on here (as lists: no array made a poll); beside the windowed detectors it only reads them."""
        w, c = self.config.window, self.config
        z = [math.nan] * len(loss)
        members: dict[int, list[int]] = {}  # request -> its finite steps, requests in order, then steps
        for i in sorted(range(len(loss)), key=lambda i: (group[i], step[i])):
            if math.isfinite(loss[i]):
                members.setdefault(group[i], []).append(i)
        for g, indices in members.items():
            state = self._state(keys[g])
            window, seen = _as_list(state.history[-w:]), state.seen
            for i in indices:
                if seen >= c.min_history and len(window) >= 2:
                    z[i] = _robust_z_scalar(window, loss[i], c)[2]
                window, seen = [*window, loss[i]][-w:], seen + 1
            if not c.windowed:
                state.history, state.seen = window, seen
        return z

    def _small_groups(self, pid, traces, step_seq, step, batch_row):
        """`_request_groups` for a few steps, from `_request_keys`."""
        group, first, keys = _grouped(self._request_keys(pid, traces, step_seq, step, batch_row))
        return np.asarray(group, np.int64), np.asarray(first, np.int64), keys

    def _request_groups(self, pid, traces, step_seq, step, batch_row):
        """(group of each step, each group's first index, each group's request key): `_request_keys`'s
        keys, computed over arrays. A per-step look into the open requests is needed only for a
        teacher-forced pass split by a poll, so it runs only while such a request is open."""
        n = len(step_seq)
        codes: dict = {}  # trace id -> a small int (any hashable id, kept as given for the rows)
        trace_code = np.fromiter((codes.setdefault(t, len(codes)) for t in traces), np.int64, n)
        named = list(codes)
        _u, inverse, counts = np.unique(_packed(pid, trace_code, step_seq, batch_row), return_inverse=True,
                                        return_counts=True)  # fmt: skip
        use_forced = counts[inverse.reshape(-1)] > 1
        if self._forced_open:
            for i in np.flatnonzero(~use_forced & (step > 0)).tolist():
                key = (int(pid[i]), traces[i], int(step_seq[i]), int(batch_row[i]))
                use_forced[i] = key in self._forced_open and key in self._open
        origin = np.where(use_forced, step_seq, step_seq - step)
        _u, first, group = np.unique(_packed(pid, trace_code, origin, batch_row), return_index=True,
                                     return_inverse=True)  # fmt: skip
        keys = [
            (int(pid[i]), named[trace_code[i]], int(origin[i]), int(batch_row[i])) for i in first.tolist()
        ]
        forced_groups = set(group.reshape(-1)[use_forced].tolist())
        for g in forced_groups:
            self._forced_open.add(keys[g])
        return group.reshape(-1), first, keys

    def _score_batch(self, order, group_of, loss, first, keys):
        """Scores of the finite steps `order` (sorted by group, then step) against their requests' windows;
        the open state updated. Returns (scores, the steps scored in `order`'s order, the groups in order
        of first appearance)."""
        windows, values, seen, commit, by_group = self._batch_windows(order, group_of, loss, first, keys)
        scores = _score_windows(windows, values, seen, self.config, every_p=False)
        commit()
        return scores, order, by_group

    def _batch_windows(self, order, group_of, loss, first, keys):
        """Each finite step of `order` (sorted by group, then step): its window (the up to `window`
        finite losses before it in its request, NaN-padded), its loss, its request's finite losses
        before it; and `commit`, which moves the open state past the batch. Returns (windows, values,
        seen, commit, the groups in order of first appearance)."""
        w = self.config.window
        groups, starts, sizes = np.unique(group_of, return_index=True, return_counts=True)
        by_group = sorted(groups.tolist(), key=lambda g: first[g])
        histories = np.full((len(groups), w), np.nan)
        seen = np.zeros(len(groups), np.int64)
        slot = {g: i for i, g in enumerate(groups.tolist())}
        states = {}
        for g in by_group:  # the open-request order (and eviction) as requests first appear
            state = states[g] = self._state(keys[g])
            if len(state.history):
                histories[slot[g], w - len(state.history[-w:]) :] = state.history[-w:]
            seen[slot[g]] = state.seen
        values = loss[order]
        # each group's history (w, NaN-padded on the left) then its values, groups one after another
        lengths = w + sizes
        base = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        flat = np.empty(int(lengths.sum()))
        offsets = np.arange(len(groups)).repeat(sizes)
        within = np.arange(len(order)) - starts.repeat(sizes)  # a step's rank within its group
        flat[(base[:, None] + np.arange(w)).reshape(-1)] = histories.reshape(-1)
        flat[base.repeat(sizes) + w + within] = values
        windows = flat[(base[offsets] + within)[:, None] + np.arange(w)]

        def commit() -> None:
            tails = flat[(base + lengths - w)[:, None] + np.arange(w)]
            for g in by_group:
                i = slot[g]
                tail = tails[i]
                states[g].history = tail[~np.isnan(tail)]
                states[g].seen += int(sizes[i])

        return windows, values, seen[offsets] + within, commit, by_group

    def _request_keys(self, pid, traces, step_seq, step, batch_row) -> list[tuple]:
        """(pid, trace, origin, batch_row) per token step: the request it belongs to. Generated tokens
        take one forward pass each, so a request's origin is step_seq - step (its first pass: the
        store's first_step_seq). A forward pass with labels (teacher forcing, training) publishes all
        its tokens under one step_seq: its origin is that step_seq. A pass whose rows a poll split
        in two is recognised by its open state."""
        n = len(step_seq)
        passes: dict[tuple, int] = {}
        for i in range(n):
            key = (int(pid[i]), traces[i], int(step_seq[i]), int(batch_row[i]))
            passes[key] = passes.get(key, 0) + 1
        keys = []
        for i in range(n):
            forced = (int(pid[i]), traces[i], int(step_seq[i]), int(batch_row[i]))
            if passes[forced] > 1 or (step[i] > 0 and forced in self._open):
                keys.append(forced)
                self._forced_open.add(forced)
            else:
                keys.append((forced[0], forced[1], int(step_seq[i] - step[i]), forced[3]))
        return keys

    def _state(self, key: tuple) -> _Open:
        state = self._open.get(key)
        if state is None:
            state = self._open[key] = _Open(np.empty(0))
            while len(self._open) > self.config.max_open:
                evicted, _state = self._open.popitem(last=False)
                self._forced_open.discard(evicted)
                self.counters.evicted += 1
        else:
            self._open.move_to_end(key)
        return state

    def _row(self, rows, steps, i: int, detector: str, s: Scores, j: int, now_ns: int, key: tuple) -> None:
        if detector == "ttest":
            score = float(s.t[j])
            detail = {"window_mean": s.mean[j], "window_sd": s.sd[j], "n": int(s.n[j]), "p_value": s.p[j],
                      "alpha": self.config.alpha}  # fmt: skip
        else:
            score = float(s.z[j])
            detail = {"window_median": s.median[j], "window_mad": s.mad[j], "n": int(s.n[j]),
                      "threshold": self.config.mad_threshold}  # fmt: skip
        self._append_row(rows, steps, i, detector, score, detail, now_ns, key, {"window": self.config.window})

    def _append_row(self, rows, steps, i: int, detector: str, score: float, detail: dict, now_ns: int,
                    key: tuple, last: dict | None = None) -> None:  # fmt: skip
        """One anomaly row: the detector's numbers (`detail`), the token's, then `last`."""
        loss = float(steps["loss"][i])
        detail.update(
            loss=loss,
            position=int(steps["position"][i]),
            token_id=int(steps["token_id"][i]),
            target_id=int(steps["target_id"][i]),
            step=int(steps["step"][i]),
            t_end_ns=int(steps["t_end_ns"][i]),
        )
        detail.update(last or {})
        rows["ts_ns"].append(now_ns)
        rows["pid"].append(key[0])
        rows["step_seq"].append(int(steps["step_seq"][i]))
        rows["trace_id"].append(key[1])
        rows["kind"].append(f"loss_{detector}")
        rows["score"].append(score)
        rows["detail"].append(json.dumps({k: _plain(v) for k, v in detail.items()}))
        rows["first_step_seq"].append(key[2])
        rows["step"].append(int(steps["step"][i]))
        rows["batch_row"].append(key[3])
        rows["detector"].append(detector)


def _grouped(request_keys: list[tuple]) -> tuple[list[int], list[int], list[tuple]]:
    """Each step's request as a small int (in order of first appearance), each request's first step and
    each request's key, from each step's request key."""
    index: dict[tuple, int] = {}
    group: list[int] = []
    first: list[int] = []
    for i, key in enumerate(request_keys):
        g = index.get(key)
        if g is None:
            g = index[key] = len(first)
            first.append(i)
        group.append(g)
    return group, first, list(index)


@dataclass
class _TinyPoll:
    """A poll's columns as Python lists, each value the one the numpy path's int64 / float64 array holds."""

    pid: list[int]
    step_seq: list[int]
    step: list[int]
    batch_row: list[int]
    position: list[int]
    loss: list[float]


# |value| below: the numpy path's int64 arithmetic (pid * 2 + variant, step_seq - step, step - a flag
# step) cannot wrap, so Python ints give its results
EXACT_INT_LIMIT = 1 << 62


def _tiny_poll(steps: dict, n: int) -> _TinyPoll | None:
    """The poll's columns as Python lists when each converts exactly (`_exact_ints`, `_exact_floats`);
    else None: the numpy path takes the poll, with its conversions and its errors."""
    ints = [_exact_ints(steps.get(name), n) for name in ("pid", "step_seq", "step", "batch_row", "position")]
    loss = _exact_floats(steps.get("loss"), n)
    if loss is None or any(column is None for column in ints):
        return None
    return _TinyPoll(*ints, loss)


def _exact_ints(column, n: int) -> list[int] | None:
    """n ints (a 1-d integer array, or a list of Python ints) of magnitude below EXACT_INT_LIMIT, as Python
    ints: exactly np.asarray(column, np.int64)'s values. None for anything else (floats, bools, numpy
    scalars in a list, a missing or short column)."""
    values = _exact_column(column, n, "iu", int)
    if values and not -EXACT_INT_LIMIT < min(values) <= max(values) < EXACT_INT_LIMIT:
        return None
    return values


def _exact_floats(column, n: int) -> list[float] | None:
    """n floats (a 1-d array of float16/32/64, or a list of Python floats) as Python floats: exactly
    np.asarray(column, np.float64)'s values. None for anything else."""
    return _exact_column(column, n, "f", float)


def _exact_column(column, n: int, kinds: str, python_type: type) -> list | None:
    """n values of a 1-d array whose dtype kind is one of `kinds` (at most 8 bytes an item), or of a list
    of exactly `python_type`, as Python values; None for anything else."""
    if isinstance(column, np.ndarray):
        if column.ndim != 1 or column.dtype.kind not in kinds or column.dtype.itemsize > 8:
            return None
        values = column.tolist()
    elif type(column) is list and all(type(v) is python_type for v in column):
        values = column
    else:
        return None
    return values if len(values) == n else None


def _joined(first: dict[str, list] | None, second: dict[str, list] | None) -> dict[str, list] | None:
    """Two detectors' rows of one batch as one set of columns (either may be None)."""
    if not first:
        return second
    if not second:
        return first
    return {c: first[c] + second[c] for c in ANOMALY_COLUMNS}


def _packed(*columns: np.ndarray) -> np.ndarray:
    """One sortable value per row of integer columns, equal exactly when every column is: an int64
    mixed radix over the batch's ranges when it fits (np.unique on it is ~5x faster than on records),
    else a structured array."""
    lows = [int(c.min()) for c in columns]
    spans = [int(c.max()) - low + 1 for c, low in zip(columns, lows, strict=True)]
    total = 1
    for span in spans:
        total *= span
    if total < 2**62:
        packed = np.zeros(len(columns[0]), np.int64)
        for c, low, span in zip(columns, lows, spans, strict=True):
            packed = packed * span + (np.asarray(c, np.int64) - low)
        return packed
    records = np.empty(len(columns[0]), [(f"f{i}", "i8") for i in range(len(columns))])
    for i, c in enumerate(columns):
        records[f"f{i}"] = c
    return records


def _as_list(column) -> list:
    return column.tolist() if isinstance(column, np.ndarray) else list(column)


def _plain(value):
    """JSON-safe numbers: numpy scalars to Python, non-finite floats to None (JSON has no NaN/inf)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


# ---- settings ----------------------------------------------------------------------------------------


def live_traffic(steps: dict) -> dict:
    """The token-step columns without the shadow rows (llmobs.shadow's teacher-forced scores of another
    model, the reader's `shadow` column): they are a second opinion on tokens already scored, not
    traffic, so the detectors never see them (a shadow pass would look like one long request, or one
    training step). The same dict when there are none."""
    shadow = steps.get("shadow")
    if shadow is None:
        return steps
    mask = np.asarray(shadow, dtype=bool)
    if not mask.any():
        return steps
    keep = ~mask
    index = np.flatnonzero(keep).tolist()
    return {
        k: v[keep] if isinstance(v, np.ndarray) and v.shape[:1] == mask.shape else [v[i] for i in index]
        for k, v in steps.items()
    }


def config_of(values) -> DetectorConfig | None:
    """DetectorConfig from detector.* settings ({key: parsed value}; a missing key: its default), None
    for detector.name off. The daemon (its config) and attach (its flags) both build it here."""
    defaults = DetectorConfig()
    name = values.get("detector.name", AGENT_DETECTOR)
    if name == "off":
        return None
    window = values.get("detector.window", defaults.window)
    return DetectorConfig(
        detector=name,
        window=window,
        min_history=min(defaults.min_history, window),
        alpha=values.get("detector.alpha", defaults.alpha),
        mad_threshold=values.get("detector.mad_threshold", defaults.mad_threshold),
        alarm_rate=values.get("detector.alarm_rate", defaults.alarm_rate),
        fdr=values.get("detector.fdr", defaults.fdr),
        aftermath=values.get("detector.aftermath", defaults.aftermath),
    )
