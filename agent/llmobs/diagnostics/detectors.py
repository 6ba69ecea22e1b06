"""Token-loss anomaly detectors: each token's loss against the preceding window of the same request.

Two detectors, selectable (`ttest`, `mad`, `both`):
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
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

DETECTORS = ("ttest", "mad")
MAD_TO_Z = 0.6745  # the modified z-score's constant: MAD of a standard normal is 0.6745


@dataclass(frozen=True)
class DetectorConfig:
    """What the detectors test and how strictly. `detector`: ttest | mad | both."""

    detector: str = "both"
    window: int = 32  # preceding tokens of the request the test compares against
    min_history: int = 8  # no verdict before this many preceding tokens
    alpha: float = 0.01  # t-test: one-sided significance level
    mad_threshold: float = 3.5  # mad: modified z-score above which a token is flagged
    min_sd: float = 0.05  # nats: floor of the window's spread (sd; MAD scaled to sd)
    max_open: int = 4096  # open requests kept; beyond, the least recently updated is evicted

    def __post_init__(self) -> None:
        if self.detector not in (*DETECTORS, "both"):
            raise ValueError(f"detector must be ttest, mad or both, not {self.detector!r}")
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

    @property
    def enabled(self) -> tuple[str, ...]:
        return DETECTORS if self.detector == "both" else (self.detector,)


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
    from scipy import special  # here, not at import: the CLI's parsers import this module for its flags

    w = config.window
    seq = np.concatenate([np.full(w, np.nan), history[-w:], values]).astype(np.float64)
    start = w + min(len(history), w)
    windows = sliding_window_view(seq, w)[start - w : start - w + len(values)]  # row i: the w before i
    n = np.count_nonzero(~np.isnan(windows), axis=1)
    tested = (seen + np.arange(len(values))) >= config.min_history
    tested &= n >= 2
    valid = ~np.isnan(windows)
    count = np.maximum(n, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(valid, windows, 0.0).sum(axis=1) / count
        deviation = np.where(valid, windows - mean[:, None], 0.0)
        sd = np.maximum(np.sqrt((deviation**2).sum(axis=1) / np.maximum(n - 1, 1)), config.min_sd)
        t = (values - mean) / (sd * np.sqrt(1.0 + 1.0 / count))
        p = special.stdtr(np.maximum(n - 1, 1), -t)  # P(T >= t): Student's t CDF at -t (scipy's)
        median = _row_median(windows, n)
        mad = _row_median(np.abs(windows - median[:, None]), n)
        mad_floor = np.maximum(mad, config.min_sd * MAD_TO_Z)  # sd = MAD / 0.6745 for a normal
        z = MAD_TO_Z * (values - median) / mad_floor
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


def _row_median(rows: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Median of each row's first-sorted `n` values (NaN sorts last): np.nanmedian's result without its
    masked-array path, which costs ~100x more on the short rows of a live poll."""
    ordered = np.sort(rows, axis=1)
    low = np.take_along_axis(ordered, np.maximum((n - 1) // 2, 0)[:, None], axis=1)[:, 0]
    high = np.take_along_axis(ordered, np.maximum(n // 2, 0)[:, None], axis=1)[:, 0]
    return (low + high) / 2.0


def score_sequence(losses, config: DetectorConfig | None = None) -> Scores:
    """Score every token of one request's losses (in step order). NaN losses (no target) are neither
    tested nor part of any window; their rows come back untested."""
    config = config or DetectorConfig()
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
    seconds: float = 0.0  # CPU time spent scoring


@dataclass
class _Open:
    history: np.ndarray  # the last `window` finite losses
    seen: int = 0  # finite losses seen so far


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
        # scipy now, at attach: imported on the first scored batch it stalled the drain loop for
        # 0.3-0.7 s on a busy host (the first spikes' rows were that late)
        import scipy.special  # noqa: F401

    def add(self, steps: dict, now_ns: int) -> dict[str, list] | None:
        """Score one batch of token steps; the anomaly rows ({column: list}, ANOMALY_COLUMNS) or None.

        Steps of one request arrive in order (one process publishes its forward passes in sequence);
        a batch may mix requests and batch rows, which are grouped here."""
        import time

        began = time.process_time()
        n = len(steps["step_seq"])
        self.counters.steps += n
        if n == 0:
            return None
        step_seq = np.asarray(steps["step_seq"], np.int64)
        step = np.asarray(steps["step"], np.int64)
        batch_row = np.asarray(steps["batch_row"], np.int64)
        pid = np.asarray(steps["pid"], np.int64)
        loss = np.asarray(steps["loss"], np.float64)
        keys = self._request_keys(pid, steps["trace_id"], step_seq, step, batch_row)
        groups: dict[tuple, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
        rows: dict[str, list] = {c: [] for c in ANOMALY_COLUMNS}
        for key, index in groups.items():
            idx = np.asarray(index)
            idx = idx[np.argsort(step[idx], kind="stable")]
            finite = idx[np.isfinite(loss[idx])]
            if not len(finite):
                continue
            state = self._state(key)
            values = loss[finite]
            scores = _score(state.history, values, state.seen, self.config)
            state.history = np.concatenate([state.history, values])[-self.config.window :]
            state.seen += len(values)
            self.counters.tested += int(np.count_nonzero(scores.n))
            for detector in self.config.enabled:
                for j in np.flatnonzero(scores.flagged(detector)):
                    self._row(rows, steps, int(finite[j]), detector, scores, j, now_ns, key)
        self.counters.open = len(self._open)
        self.counters.seconds += time.process_time() - began
        if not rows["ts_ns"]:
            return None
        self.counters.anomalies += len(rows["ts_ns"])
        return rows

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
            else:
                keys.append((forced[0], forced[1], int(step_seq[i] - step[i]), forced[3]))
        return keys

    def _state(self, key: tuple) -> _Open:
        state = self._open.get(key)
        if state is None:
            state = self._open[key] = _Open(np.empty(0))
            while len(self._open) > self.config.max_open:
                self._open.popitem(last=False)
                self.counters.evicted += 1
        else:
            self._open.move_to_end(key)
        return state

    def _row(self, rows, steps, i: int, detector: str, s: Scores, j: int, now_ns: int, key: tuple) -> None:
        loss = float(steps["loss"][i])
        if detector == "ttest":
            score = float(s.t[j])
            detail = {"window_mean": s.mean[j], "window_sd": s.sd[j], "n": int(s.n[j]), "p_value": s.p[j],
                      "alpha": self.config.alpha}  # fmt: skip
        else:
            score = float(s.z[j])
            detail = {"window_median": s.median[j], "window_mad": s.mad[j], "n": int(s.n[j]),
                      "threshold": self.config.mad_threshold}  # fmt: skip
        detail.update(
            loss=loss,
            position=int(steps["position"][i]),
            token_id=int(steps["token_id"][i]),
            target_id=int(steps["target_id"][i]),
            step=int(steps["step"][i]),
            t_end_ns=int(steps["t_end_ns"][i]),
            window=self.config.window,
        )
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


def _plain(value):
    """JSON-safe numbers: numpy scalars to Python, non-finite floats to None (JSON has no NaN/inf)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


# ---- command line ----------------------------------------------------------------------------------


def add_detector_arguments(parser) -> None:
    """The detectors' flags, for the commands that run a pipeline (attach, run)."""
    defaults = DetectorConfig()
    parser.add_argument(
        "--detector",
        choices=("both", *DETECTORS, "off"),
        default=defaults.detector,
        help="token-loss anomaly detectors on the live token steps (default both; see docs/diagnostics.md)",
    )
    parser.add_argument(
        "--detector-window",
        type=int,
        default=defaults.window,
        metavar="N",
        help=f"tokens of the request each loss is compared with (default {defaults.window})",
    )
    parser.add_argument(
        "--alpha",
        type=float,
        default=defaults.alpha,
        help=f"t-test significance level (default {defaults.alpha})",
    )
    parser.add_argument(
        "--mad-threshold",
        type=float,
        default=defaults.mad_threshold,
        metavar="Z",
        help=f"median/MAD: modified z-score to flag (default {defaults.mad_threshold})",
    )


def detector_config(args) -> DetectorConfig | None:
    """The DetectorConfig the flags ask for (None: --detector off); ValueError names a bad value."""
    if args.detector == "off":
        return None
    window = args.detector_window
    return DetectorConfig(detector=args.detector, window=window, min_history=min(8, max(window, 2)),
                          alpha=args.alpha, mad_threshold=args.mad_threshold)  # fmt: skip
