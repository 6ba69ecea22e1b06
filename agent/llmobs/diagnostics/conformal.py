"""The calibrated token-loss detector: conformal p-values of a request-relative score against a reference
of the same scores from earlier tokens.

The nonconformity score of a token is request-relative: the MAD detector's modified z of its loss
against its own request's preceding window (llmobs.diagnostics.detectors computes it), so a spike that
is large within its request is large whatever the spread between requests (a random-init model's
requests differ by more than a spike). Tokens whose request has too little history for a z (its first
min_history tokens) are scored by their raw loss instead, against a reference of raw losses of such
tokens: the first tokens are tested too. The score, either kind, is ranked among the scores of the same
kind the detector has seen before it of the same (process, variant, position bucket): the smoothed
conformal p-value

    p = (#{reference > x} + U * (#{reference == x} + 1)) / (N + 1),   U ~ Uniform(0, 1)

is exactly uniform when the token and the reference are exchangeable (clean traffic of one model), so
flagging p <= alarm_rate flags clean tokens at exactly that rate, whatever the score's distribution
(heavy tails included: no normal theory, unlike the t-test's and MAD's thresholds). In the online
setting (each token tested against all earlier ones) the p-values are independent as well (Vovk,
Gammerman & Shafer, *Algorithmic Learning in a Random World*, 2005, ch. 8), so the count of false
alarms over n clean tokens is Binomial(n, alarm_rate): the tolerance is the binomial's. Here a batch's
tokens share the reference of the batches before them, which adds O(batch / N) to that variance, and
a request's z-scores share its window, which correlates neighbours' p-values (not their marginal
uniformity: the rate per token stays the budget).

- **Reference**: a histogram of the score in BINS fixed bins: log1p(loss) for raw losses, asinh(z)
  (signed, fine near 0, log-like in the tails) for z-scores (4,096 x float64 = 32 KiB each, whatever
  the traffic): the rank needs only counts above and in the token's bin, and the bins' ties are what
  U breaks. At most `max_references` references (least recently used evicted, counted); a reference
  whose count passes `max_count` halves its counts, so it follows slow drift with a horizon of about
  that many tokens.
- **Keys**: the score's kind (raw, relative); variant is a generated token (one forward pass each)
  or a teacher-forced / training pass (all tokens of a pass under one step_seq: a different loss
  distribution); position buckets split the first tokens of a text (no context: high loss) from the
  rest. A bucket is tested only against itself: borrowing a pooled reference while a bucket is young
  leaked (the first 8 tokens of a pass, with ~1.5x the loss of the rest, were flagged at ~6x the
  budget against the pool).
- **Warm-up**: no verdict until the token's reference holds at least ceil(1 / alarm_rate) scores (1e-4
  needs 10,000, per bucket): with fewer, p <= alarm_rate only by the coin U. Tokens scored before that
  are counted (`warmup`), not tested; they do enter the reference.
- **Exchangeability**: the reference holds earlier tokens only. Flagged tokens do enter it while the
  stream's recent flag rate is near the budget: leaving out every flagged clean token would thin the
  reference's tail and make the threshold creep down (the false-alarm rate grows like
  alarm_rate x ln(tokens / warm-up)). While the recent flag rate (EWMA, horizon 10 / alarm_rate
  tokens) exceeds `holdout_factor` x alarm_rate, which clean traffic essentially never does, flagged
  tokens are held out (counted): a burst of faults must not become the reference's normal.
- **Request verdict**: Benjamini-Hochberg at level `fdr` over the p-values of a request so far
  (`RequestTests`): a request is flagged when BH makes at least one discovery. It keeps the tested
  count and only p-values <= fdr (at most RequestTests.KEPT), which is all BH needs.

All of it is vectorised over a batch: one np.unique over the batch's reference keys, one suffix sum per
reference used, one bincount per reference updated. A poll of at most SCALAR_BATCH tokens (a slowly
stepping generate(): one token a poll) takes a path in Python floats instead, with the same draws, bins
and arithmetic (its suffix sums equal the cumulative's differences exactly: the counts are multiples
of 2^-h after h halvings): some twenty numpy calls on one-element arrays cost ~10x the work there.
`score_scalars` is that path for a caller holding Python lists (the detector's poll of a few steps):
no array in or out; what is left of numpy is the generator's draw and the references' bin counts.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

BIN_SCALE = 512  # bins per unit of log1p(loss): 1/512 of log1p, ~0.02 nats at a loss of 10
BINS = 4096  # log1p(loss) in [0, 8): losses up to ~2,980 nats; beyond, the last bin
Z_SCALE = 256  # bins per unit of asinh(z): 1/256, a z of 5 resolved to ~0.02
Z_LOW = -8.0  # asinh(z) in [-8, 8): |z| up to ~1,490; beyond, the end bins (ties broken by U)
DEFAULT_BUCKETS = (8, 64, 512)  # position bucket edges: [0, 8), [8, 64), [64, 512), [512, ...)
GENERATED, FORCED = 0, 1  # variants
VARIANT_NAMES = ("generated", "forced")
RAW, RELATIVE = 0, 1  # score kinds: the raw loss (too little request history), the request-relative z
KIND_NAMES = ("raw", "relative")
SCALAR_BATCH = 4  # polls of at most this many tokens take the Python-float path (same results)


def bins_of(losses: np.ndarray) -> np.ndarray:
    """Each finite loss's histogram bin (negative losses share bin 0: only a rise is an anomaly)."""
    scaled = np.log1p(np.maximum(losses, 0.0)) * BIN_SCALE
    return np.minimum(scaled, BINS - 1).astype(np.int64)


def _loss_bin(loss: float) -> int:
    """bins_of for one loss (the same float64 arithmetic)."""
    return int(min(math.log1p(max(loss, 0.0)) * BIN_SCALE, BINS - 1))


def _z_bin(z: float) -> int:
    """z_bins_of for one z (NaN: 0)."""
    return int(min(max((math.asinh(0.0 if z != z else z) - Z_LOW) * Z_SCALE, 0.0), BINS - 1))


def z_bins_of(z: np.ndarray) -> np.ndarray:
    """Each request-relative z-score's histogram bin: asinh is monotone, so ranks are the z's own."""
    scaled = (np.arcsinh(np.nan_to_num(z, nan=0.0)) - Z_LOW) * Z_SCALE  # a flat window's 0/0: z 0
    return np.clip(scaled, 0, BINS - 1).astype(np.int64)


class Reference:
    """The scores of one (pid, variant, bucket, kind) seen so far, as bin counts."""

    __slots__ = ("counts", "total", "_cumulative")

    def __init__(self) -> None:
        self.counts = np.zeros(BINS, np.float64)
        self.total = 0.0
        self._cumulative: np.ndarray | None = None  # cumsum of counts, until the next add

    def p_values(self, bins: np.ndarray, uniform: np.ndarray) -> np.ndarray:
        """The smoothed conformal p-value of each loss (given as its bin) against this reference."""
        if self._cumulative is None:
            self._cumulative = np.cumsum(self.counts)
        equal = self.counts[bins]
        above = self.total - self._cumulative[bins]  # count in the bins above
        return (above + uniform * (equal + 1.0)) / (self.total + 1.0)

    def p_value(self, b: int, uniform: float) -> float:
        """p_values for one score: the counts above by a suffix sum (the cumulative is rebuilt after
        every add, and a poll of one token would rebuild all BINS of it for one lookup)."""
        if self._cumulative is not None:
            above = self.total - float(self._cumulative[b])
        else:
            above = float(self.counts[b + 1 :].sum())
        return (above + uniform * (float(self.counts[b]) + 1.0)) / (self.total + 1.0)

    def add_few(self, bins: list[int], max_count: float) -> None:
        """add for a few bins, one by one."""
        self._cumulative = None
        counts = self.counts
        for b in bins:
            counts[b] += 1.0
        self.total += len(bins)
        if self.total > max_count:
            self.counts *= 0.5
            self.total *= 0.5

    def add(self, bins: np.ndarray, max_count: float) -> None:
        if not len(bins):
            return
        self._cumulative = None
        if len(bins) <= 64:  # a few losses: no pass over every bin
            np.add.at(self.counts, bins, 1.0)
        else:
            self.counts += np.bincount(bins, minlength=BINS)
        self.total += len(bins)
        if self.total > max_count:  # halve: bounded counts, and a horizon for slow drift
            self.counts *= 0.5
            self.total *= 0.5


@dataclass
class CalibratedCounters:
    tested: int = 0  # tokens given a p-value (the reference resolved the budget)
    warmup: int = 0  # tokens not tested: their reference held fewer than warmup_count losses
    flagged: int = 0  # tested tokens with p <= alarm_rate
    held_out: int = 0  # flagged tokens kept out of the reference (a burst: flag rate above the guard)
    references: int = 0  # references kept now
    evicted: int = 0  # references dropped to stay within max_references


@dataclass
class CalibratedScores:
    """Per token of a batch (in the order given): p-value (NaN: not tested), verdict, the reference's
    size, its position bucket and whether the score was the request-relative z (else the raw loss).
    Arrays, or lists indexed as they are (ConformalScorer.score_scalars)."""

    p: np.ndarray
    flagged: np.ndarray
    reference_n: np.ndarray
    bucket: np.ndarray
    relative: np.ndarray

    def as_arrays(self) -> CalibratedScores:
        """The scores as score()'s arrays (from score_scalars' lists)."""
        return CalibratedScores(np.array(self.p, np.float64), np.array(self.flagged, bool),
                                np.array(self.reference_n, np.int64), np.array(self.bucket, np.int64),
                                np.array(self.relative, bool))  # fmt: skip


class ConformalScorer:
    """Scores tokens against per (pid, variant, position bucket, score kind) references; bounded state."""

    def __init__(
        self,
        alarm_rate: float,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        max_references: int = 64,
        max_count: float = float(1 << 22),
        holdout_factor: float = 4.0,
        seed: int = 0,
    ):
        if not 0.0 < alarm_rate < 1.0:
            raise ValueError(f"alarm_rate must be in (0, 1), not {alarm_rate}")
        self.alarm_rate = alarm_rate
        self.warmup_count = math.ceil(1.0 / alarm_rate)
        if max_count < 2 * self.warmup_count:
            raise ValueError(f"max_count {max_count} must be >= 2 x the warm-up ({self.warmup_count})")
        self.buckets = np.asarray(buckets, np.int64)
        self._edges = tuple(int(b) for b in buckets)
        self.max_references = max_references
        self.max_count = max_count
        self.holdout_factor = holdout_factor
        self.counters = CalibratedCounters()
        self.learning = True  # False: score against the references without adding to them (evaluation)
        self._references: OrderedDict[tuple[int, int, int, int], Reference] = OrderedDict()
        self._flag_rate: dict[tuple[int, int], float] = {}  # (pid, variant) -> EWMA of the flag rate
        self._decay = 1.0 - alarm_rate / 10.0  # per token: the EWMA's horizon is 10 / alarm_rate tokens
        self._rng = np.random.default_rng(seed)

    def bucket_of(self, positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.buckets, positions, side="right")

    def score(self, pid: np.ndarray, variant: np.ndarray, position: np.ndarray, loss: np.ndarray,
              relative: np.ndarray | None = None) -> CalibratedScores:  # fmt: skip
        """p-values of each token (one per token, any order of pids and variants) against the references
        as they were before this batch; then the batch enters the references. A token's score is
        `relative` (its request-relative z) where that is not NaN, else its finite `loss`."""
        n = len(loss)
        float64 = loss.dtype == np.float64 and (relative is None or relative.dtype == np.float64)
        if 0 < n <= SCALAR_BATCH and float64:  # the scalar path's arithmetic is float64's
            return self._score_few(pid, variant, position, loss, relative)
        p = np.full(n, np.nan)
        reference_n = np.zeros(n, np.int64)
        used = np.full(n, -1, np.int64)
        is_relative = np.zeros(n, bool) if relative is None else ~np.isnan(relative)
        if n == 0:
            return CalibratedScores(p, np.zeros(0, bool), reference_n, used, is_relative)
        if is_relative.any():
            bins = np.where(is_relative, z_bins_of(relative), bins_of(loss))
        else:
            bins = bins_of(loss)
        bucket = self.bucket_of(position)
        uniform = self._rng.random(n)
        streams = pid.astype(np.int64) * 2 + variant.astype(np.int64)  # (pid, variant), packed
        packed = (streams * 2 + is_relative) * 64 + bucket  # < 64 buckets
        if packed[0] == packed[-1] and (n < 3 or (packed == packed[0]).all()):  # one reference: most polls
            keys, members = packed[:1], [np.arange(n)]
        else:
            keys, inverse = np.unique(packed, return_inverse=True)
            inverse = inverse.reshape(-1)
            members = np.split(np.argsort(inverse, kind="stable"), np.cumsum(np.bincount(inverse))[:-1])
        for key, idx in zip(keys.tolist(), members, strict=True):
            reference = self._references.get(_unpacked(key))
            if reference is None or reference.total < self.warmup_count:
                continue
            p[idx] = reference.p_values(bins[idx], uniform[idx])
            reference_n[idx] = int(reference.total)
            used[idx] = key % 64
        tested = ~np.isnan(p)
        flagged = np.zeros(n, bool)
        flagged[tested] = p[tested] <= self.alarm_rate
        c = self.counters
        c.tested += int(tested.sum())
        c.warmup += int(n - tested.sum())
        c.flagged += int(flagged.sum())
        if self.learning:
            self._learn(keys, members, bins, tested, flagged)
        return CalibratedScores(p, flagged, reference_n, used, is_relative)

    def _score_few(self, pid, variant, position, loss, relative) -> CalibratedScores:
        """score() for a poll of at most SCALAR_BATCH tokens, in Python floats (`_score_streams`), as
        arrays."""
        uniform = self._rng.random(len(loss)).tolist()  # first: a column that fails leaves it drawn, as ever
        streams = (pid.astype(np.int64) * 2 + variant.astype(np.int64)).tolist()
        zs = relative.tolist() if relative is not None else None
        return self._score_streams(uniform, streams, position.tolist(), loss.tolist(), zs).as_arrays()

    def score_scalars(self, pid: list[int], variant: list[int], position: list[int], loss: list[float],
                      relative: list[float] | None = None) -> CalibratedScores:  # fmt: skip
        """score() for a few tokens given and returned as Python lists (the fields of the result are
        lists, indexed as score()'s arrays are), for a caller that has no arrays: the detector's poll of
        a slowly stepping target. The same draws, p-values, counters and learning as score(); pid * 2
        + variant must fit an int64, as it does there."""
        uniform = self._rng.random(len(loss)).tolist()
        streams = [p * 2 + v for p, v in zip(pid, variant, strict=True)]
        return self._score_streams(uniform, streams, position, loss, relative)

    def _score_streams(self, uniform: list[float], streams: list[int], position: list[int], loss: list[float],
                       relative: list[float] | None) -> CalibratedScores:  # fmt: skip
        """The Python-float path of score(), given the poll's uniform draws (one random(n) call) and each
        token's (pid, variant) stream packed as pid * 2 + variant: the same bins, references, p-values,
        flag-rate guard and learning, token by token. The result's fields are lists."""
        n = len(loss)
        zs = relative if relative is not None else [math.nan] * n
        buckets = [bisect.bisect_right(self._edges, at) for at in position]
        p, reference_n, used = [math.nan] * n, [0] * n, [-1] * n
        is_relative, flagged, bins, keys = [False] * n, [False] * n, [0] * n, [0] * n
        for i in range(n):
            kind = int(zs[i] == zs[i])  # a z where there is one, else the raw loss
            is_relative[i] = bool(kind)
            bins[i] = _z_bin(zs[i]) if kind else _loss_bin(loss[i])
            keys[i] = (streams[i] * 2 + kind) * 64 + buckets[i]
            reference = self._references.get(_unpacked(keys[i]))
            if reference is None or reference.total < self.warmup_count:
                continue
            p[i] = reference.p_value(bins[i], uniform[i])
            reference_n[i] = int(reference.total)
            used[i] = buckets[i]
            flagged[i] = p[i] <= self.alarm_rate
        n_tested = sum(1 for value in p if value == value)
        n_flagged = sum(flagged)
        c = self.counters
        c.tested += n_tested
        c.warmup += n - n_tested
        c.flagged += n_flagged
        if self.learning:
            self._learn_few(keys, bins, p, flagged)
        return CalibratedScores(p, flagged, reference_n, used, is_relative)

    def _learn_few(self, keys: list[int], bins: list[int], p: list[float], flagged: list[bool]) -> None:
        """_learn for _score_streams' tokens: per (pid, variant) stream, in the order of the sorted keys."""
        order = sorted(range(len(keys)), key=lambda i: keys[i])  # np.unique's order, stable within a key
        by_stream: dict[int, list[int]] = {}
        for i in order:
            by_stream.setdefault(keys[i] // 128, []).append(i)
        for stream, members in by_stream.items():
            n_tested = sum(1 for i in members if p[i] == p[i])
            hold = self._guard(stream, n_tested, sum(1 for i in members if flagged[i]))
            start = 0
            while start < len(members):  # each key's part, as _learn adds them
                key = keys[members[start]]
                end = start
                while end < len(members) and keys[members[end]] == key:
                    end += 1
                part = members[start:end]
                if hold:
                    kept = [i for i in part if not flagged[i]]
                    self.counters.held_out += len(part) - len(kept)
                    part = kept
                reference = self._reference(_unpacked(key))
                if part:
                    reference.add_few([bins[i] for i in part], self.max_count)
                start = end

    def _learn(self, keys, members, bins, tested, flagged) -> None:
        """The batch into its references, but for flagged tokens of a stream whose recent flag rate is
        above the guard (held out, counted)."""
        by_stream: dict[int, list[tuple[int, np.ndarray]]] = {}  # (pid, variant): both kinds' parts
        for key, idx in zip(keys.tolist(), members, strict=True):
            by_stream.setdefault(key // 128, []).append((key, idx))
        for stream, parts in by_stream.items():
            idx = np.concatenate([part for _b, part in parts]) if len(parts) > 1 else parts[0][1]
            n_tested, n_flagged = int(np.count_nonzero(tested[idx])), int(np.count_nonzero(flagged[idx]))
            hold = self._guard(stream, n_tested, n_flagged)
            for key, part in parts:
                if hold:
                    kept = part[~flagged[part]]
                    self.counters.held_out += len(part) - len(kept)
                    part = kept
                self._reference(_unpacked(key)).add(bins[part], self.max_count)

    def _guard(self, stream: int, n_tested: int, n_flagged: int) -> bool:
        """The (pid, variant) stream's flag-rate EWMA after this batch's tested tokens; True: its flagged
        tokens are held out of the reference (the recent rate is above holdout_factor x the budget)."""
        key = divmod(stream, 2)
        rate = self._flag_rate.get(key, self.alarm_rate)
        if n_tested:
            weight = 1.0 - self._decay**n_tested
            rate = rate * (1.0 - weight) + weight * n_flagged / n_tested
            self._flag_rate[key] = rate
        return bool(n_flagged) and rate > self.holdout_factor * self.alarm_rate

    def _reference(self, key: tuple[int, int, int, int]) -> Reference:
        reference = self._references.get(key)
        if reference is None:
            reference = self._references[key] = Reference()
            while len(self._references) > self.max_references:
                evicted, _ = self._references.popitem(last=False)
                self._flag_rate.pop(evicted[:2], None)
                self.counters.evicted += 1
        else:
            self._references.move_to_end(key)
        self.counters.references = len(self._references)
        return reference

    def memory_bytes(self) -> int:
        """The references' arrays: at most max_references x BINS x 8 bytes."""
        return sum(r.counts.nbytes for r in self._references.values())


def _unpacked(key: int) -> tuple[int, int, int, int]:
    """(pid, variant, bucket, kind) of a reference key packed as ((pid * 2 + variant) * 2 + kind) * 64
    + bucket."""
    rest, bucket = divmod(key, 64)
    rest, kind = divmod(rest, 2)
    pid, variant = divmod(rest, 2)
    return pid, variant, bucket, kind


class RequestTests:
    """One request's p-values for its Benjamini-Hochberg verdict: the count tested and the p-values
    <= fdr, sorted (at most KEPT: beyond, the largest are dropped and BH counts only within them, a
    lower bound of the discoveries that is exact while fewer than KEPT p-values are <= fdr)."""

    KEPT = 64
    __slots__ = ("tested", "small", "discoveries")

    def __init__(self) -> None:
        self.tested = 0
        self.small: list[float] = []
        self.discoveries = 0  # the most BH has made so far: a flagged request stays flagged

    def add(self, p_values, fdr: float) -> int:
        """Take a batch of this request's p-values (finite); return BH's discoveries at level fdr over
        every p-value so far."""
        self.tested += len(p_values)
        for value in p_values:
            if value <= fdr:
                bisect.insort(self.small, float(value))
        del self.small[self.KEPT :]
        self.discoveries = max(self.discoveries, bh_discoveries(self.small, self.tested, fdr))
        return self.discoveries


def bh_discoveries(sorted_small: list[float] | np.ndarray, m: int, fdr: float) -> int:
    """Benjamini-Hochberg's number of rejections among m p-values at level fdr, given the smallest ones
    in ascending order: the largest k with p_(k) <= k * fdr / m."""
    k = 0
    for i, value in enumerate(sorted_small, start=1):
        if value <= i * fdr / m:
            k = i
    return k
