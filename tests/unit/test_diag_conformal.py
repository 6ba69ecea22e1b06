"""The calibrated (conformal) detector: its false-alarm rate on heavy-tailed clean losses is the budget's
binomial, with request-relative scores too, warm-up is counted exactly, BH verdicts, bounded memory
(llmobs.diagnostics.conformal)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from llmobs.diagnostics.conformal import (
    BINS,
    ConformalScorer,
    Reference,
    RequestTests,
    bh_discoveries,
    bins_of,
)
from llmobs.diagnostics.detectors import DetectorConfig, StreamingDetector


def binomial_interval(n: int, p: float, tail: float = 0.0005) -> tuple[int, int]:
    """The smallest lo and largest hi with P(X < lo) <= tail and P(X > hi) <= tail, X ~ Binomial(n, p):
    computed from the binomial's pmf (log space), not a normal approximation."""
    sd = math.sqrt(n * p * (1 - p))  # beyond +-12 sd (and 10) the pmf is far below any tail here
    ks = range(max(0, int(n * p - 12 * sd) - 10), min(n, int(n * p + 12 * sd) + 10) + 1)
    pmf = {
        k: math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p)
                    + (n - k) * math.log1p(-p))
        for k in ks
    }  # fmt: skip
    below, lo = 0.0, min(ks)
    for k in ks:
        if below + pmf[k] > tail:
            lo = k
            break
        below += pmf[k]
    above, hi = 0.0, max(ks)
    for k in reversed(ks):
        if above + pmf[k] > tail:
            hi = k
            break
        above += pmf[k]
    return lo, hi


def _batch(
    losses: np.ndarray, first_seq: int, pid: int = 7, trace: str = "a" * 32, forced: bool = True
) -> dict:
    """One teacher-forced pass (all tokens under one step_seq) or one generated token per step_seq."""
    n = len(losses)
    step = np.arange(n)
    return {
        "step_seq": np.full(n, first_seq) if forced else first_seq + step,
        "step": step,
        "batch_row": np.zeros(n, np.int64),
        "pid": np.full(n, pid),
        "trace_id": [trace] * n,
        "loss": np.asarray(losses, np.float64),
        "position": step,
        "token_id": np.zeros(n, np.int64),
        "target_id": np.zeros(n, np.int64),
        "t_end_ns": np.zeros(n, np.int64),
    }


CLEAN = {
    # heavy-tailed clean losses: a normal-theory threshold under-covers both (the t-test flags 2-3x alpha)
    "lognormal": lambda rng, n: rng.lognormal(0.5, 1.0, n),
    "student_t3": lambda rng, n: np.abs(rng.standard_t(3, n)) * 1.5,
}


@pytest.mark.parametrize("distribution", sorted(CLEAN))
@pytest.mark.parametrize(
    "alarm_rate, tokens, batch", [(1e-2, 40_000, 200), (1e-3, 200_000, 500), (1e-4, 600_000, 2000)]
)
def test_false_alarm_rate_on_heavy_tailed_clean_losses_is_the_budgets_binomial(
    distribution, alarm_rate, tokens, batch
):
    """Online smoothed conformal p-values of exchangeable losses are iid uniform, so the false alarms of
    the tested tokens are Binomial(tested, alarm_rate): the count must lie in its central 99.9%. Warm-up
    is exact: a bucket's tokens are tested once its reference holds ceil(1 / alarm_rate) losses. A flag's
    aftermath (the next 16 tokens of its request) is untested, and being in one depends only on earlier
    tokens, so the tested tokens' flags are still that binomial."""
    rng = np.random.default_rng(20261201)
    detector = StreamingDetector(DetectorConfig(detector="calibrated", alarm_rate=alarm_rate))
    losses = CLEAN[distribution](rng, tokens)
    flags = 0
    for k in range(0, tokens, batch):
        rows = detector.add(_batch(losses[k : k + batch], first_seq=k), now_ns=1) or {"kind": []}
        flags += len(rows["kind"])
    need, batches = math.ceil(1 / alarm_rate), tokens // batch
    per_batch = np.bincount(detector.calibrated.bucket_of(np.arange(batch)))  # positions 0..batch-1
    warmup = sum(min(math.ceil(need / k), batches) * k for k in per_batch.tolist() if k)
    assert detector.counters.warmup == warmup
    aftermath = detector.counters.aftermath
    assert aftermath > 0  # the rule ran: every flag but a batch's last tokens' has an aftermath
    assert detector.counters.tested == tokens - warmup - aftermath
    lo, hi = binomial_interval(tokens - warmup - aftermath, alarm_rate)
    assert lo <= flags <= hi, (flags, lo, hi)
    assert detector.calibrated.counters.held_out == 0  # clean traffic never trips the burst guard


def test_the_t_test_misses_the_same_contract():
    """The contract above can fail: the t-test at alpha 0.01 on the same lognormal losses is far outside
    Binomial(tested, 0.01)'s 99.9% interval."""
    rng = np.random.default_rng(20261201)
    detector = StreamingDetector(DetectorConfig(detector="ttest", alpha=0.01))
    losses = CLEAN["lognormal"](rng, 10_000)
    flags = sum(len((detector.add(_batch(losses[k : k + 200], k), 1) or {"kind": []})["kind"])
                for k in range(0, 10_000, 200))  # fmt: skip
    _lo, hi = binomial_interval(detector.counters.tested, 0.01)
    assert flags > hi


def test_a_spike_is_flagged_with_its_p_value_and_reference():
    rng = np.random.default_rng(1)
    detector = StreamingDetector(DetectorConfig(detector="calibrated", alarm_rate=1e-3, fdr=0.2))
    for k in range(0, 2000, 100):
        detector.add(_batch(rng.lognormal(0.5, 0.5, 100), k), 1)
    clean = rng.lognormal(0.5, 0.5, 100)
    clean[40] = 40.0  # far above anything the reference holds
    rows = detector.add(_batch(clean, 5000, trace="b" * 32), now_ns=9)
    hits = [i for i, kind in enumerate(rows["kind"]) if json.loads(rows["detail"][i])["loss"] == 40.0]
    assert len(hits) == 1
    i = hits[0]
    detail = json.loads(rows["detail"][i])
    assert rows["kind"][i] == "loss_calibrated" and rows["detector"][i] == "calibrated"
    assert rows["step"][i] == 40 and rows["first_step_seq"][i] == 5000 and rows["trace_id"][i] == "b" * 32
    # position 40: bucket [8, 64), which holds 20 x 56 losses >= the warm-up of 1,000
    assert detail["reference_n"] == 1120 and detail["reference"] == "forced/bucket 1"
    assert 0 < detail["p_value"] <= 1 / 1121  # above every reference loss: only the coin U is left
    assert rows["score"][i] == pytest.approx(-math.log10(detail["p_value"]))
    # tested: the 56 tokens of bucket [8, 64) but the spike's aftermath, positions 41-56 (16 tokens);
    # [0, 8) holds 160 and [64, 512) 720 losses, < 1,000. BH over those 40 p-values at 0.2: p_(1) <=
    # 1/1121 <= 0.2 / 40, so >= 1 discovery
    assert detail["request_tested"] == 40 and detail["request_discoveries"] >= 1
    assert detector.counters.aftermath == 16
    assert detector.counters.requests_flagged >= 1


def _bimodal(rng, n: int) -> np.ndarray:
    """Losses like a text's: near-certain tokens (0.5 nats), likely ones (4.5) and open ones (9), so a
    request's window has a wide MAD (~4) while the raw reference's tail ends near 10 nats."""
    return np.maximum(rng.choice([0.5, 4.5, 9.0], n) + rng.normal(0.0, 0.3, n), 0.0)


@pytest.mark.parametrize("aftermath", [16, 0])
def test_a_flags_aftermath_is_a_consequence_unless_it_stands_out_in_its_request(aftermath):
    """The next `aftermath` tokens after a flag read the flagged token as context: a raised loss there
    (12 nats, above every clean one) is a consequence, not a row; a token that also stands out within
    its request (80 nats: z ~12 > aftermath_z 6) is flagged, and so is a raised loss past the aftermath.
    With aftermath=0 every raised loss is a row of its own (the contract above can fail)."""
    rng = np.random.default_rng(3)
    config = DetectorConfig(detector="calibrated", alarm_rate=1e-3, aftermath=aftermath)
    detector = StreamingDetector(config)
    for k in range(30):  # warm: [8, 64) gets 56 losses a pass, [64, 512) 36: both past 1,000
        detector.add(_batch(_bimodal(rng, 100), first_seq=k * 1000), 1)
    losses = _bimodal(rng, 100)
    raised = {40: 40.0, 42: 12.0, 45: 12.0, 50: 80.0, 60: 12.0, 80: 12.0}
    for step, value in raised.items():
        losses[step] = value
    rows = detector.add(_batch(losses, first_seq=99_000, trace="c" * 32), 1) or {"step": []}
    if aftermath:
        assert sorted(rows["step"]) == [40, 50, 80]  # 42, 45 after 40 and 60 after 50: consequences
        assert detector.counters.consequences == 3
    else:
        assert sorted(rows["step"]) == sorted(raised)
        assert detector.counters.consequences == 0 and detector.counters.aftermath == 0


def _offset_passes(rng, passes: int, length: int, spread: float = 3.0) -> list[np.ndarray]:
    """Clean passes whose levels differ by far more than a token's spread within one (a random-init
    model's requests): lognormal losses around a per-pass offset ~ N(0, spread)."""
    return [rng.normal(0.0, spread) + 5.0 + rng.lognormal(0.0, 0.3, length) for _ in range(passes)]


def test_false_alarm_rate_with_a_spread_between_requests_is_the_budgets_binomial():
    """Request-relative scores (the z of a token against its request's window) ranked against earlier
    tokens' z are conformal: false alarms of the tested tokens are Binomial(tested, budget). Raw losses
    are not, here: a pass is one request at one level, so a high pass is flagged whole, the burst guard
    then holds its tokens out of the reference, the tail thins and the flags run away."""
    flags, detectors = {}, {}
    for score in ("raw", "relative"):
        rng = np.random.default_rng(20261202)
        config = DetectorConfig(detector="calibrated", alarm_rate=1e-2, calibrated_score=score)
        detector = detectors[score] = StreamingDetector(config)
        flags[score] = 0
        for k, losses in enumerate(_offset_passes(rng, 200, 200)):
            rows = detector.add(_batch(losses, first_seq=k * 1000), now_ns=1) or {"kind": []}
            flags[score] += len(rows["kind"])
    # warm-up: [0, 8) (raw losses: no history) 8 a pass -> 13 passes; [8, 64) 56 -> 2; [64, 512) 136 -> 1
    warmup = 13 * 8 + 2 * 56 + 1 * 136
    relative = detectors["relative"]
    tested = 200 * 200 - warmup - relative.counters.aftermath  # a flag's next 16 tokens are untested
    assert relative.counters.warmup == warmup and relative.counters.tested == tested
    lo, hi = binomial_interval(tested, 1e-2)
    assert lo <= flags["relative"] <= hi, (flags, lo, hi)
    assert relative.calibrated.counters.held_out == 0
    assert flags["raw"] > hi and detectors["raw"].calibrated.counters.held_out > 0


def test_a_spike_small_between_requests_but_large_within_its_request_is_flagged():
    """The live case a raw-loss reference misses: a +3 nat spike, below the 90th percentile of the
    clean losses (the passes' levels spread by 3 nats), is flagged by its request-relative z; a token
    with too little history (position 2) is scored by its raw loss against the raw reference."""
    rng = np.random.default_rng(4)
    warm = _offset_passes(rng, 30, 100)
    losses = _offset_passes(rng, 1, 100)[0]
    losses[40] = np.median(losses[8:40]) + 3.0
    losses[2] = 60.0  # above every clean loss: no history needed
    assert losses[40] < np.quantile(np.concatenate(warm), 0.9)
    details = {}
    for score in ("raw", "relative"):
        config = DetectorConfig(detector="calibrated", alarm_rate=1e-2, fdr=0.2, calibrated_score=score)
        detector = StreamingDetector(config)
        for k, clean in enumerate(warm):
            detector.add(_batch(clean, first_seq=k * 1000), now_ns=1)
        rows = detector.add(_batch(losses, first_seq=99_000, trace="c" * 32), now_ns=9)
        details[score] = {rows["step"][i]: json.loads(rows["detail"][i]) for i in range(len(rows["kind"]))}
    assert 40 not in details["raw"] and details["raw"][2]["score"] == "raw"  # the raw loss misses it
    details = details["relative"]
    assert details[40]["score"] == "relative" and details[40]["z"] > 5
    assert details[40]["reference"] == "forced/bucket 1" and details[40]["reference_n"] == 30 * 56
    assert details[2]["score"] == "raw" and details[2]["z"] is None
    assert details[2]["reference"] == "forced/bucket 0" and details[2]["reference_n"] == 30 * 8


def _generated(streams: dict[str, np.ndarray], at: dict[str, int], counts: dict[str, int]) -> dict:
    """The next counts[trace] generated tokens (one step_seq each) of each trace, interleaved."""
    rows = []
    for trace, k in counts.items():
        for _ in range(k):
            rows.append((trace, at[trace]))
            at[trace] += 1
    rows.sort(key=lambda r: r[1])
    n = len(rows)
    step = np.array([s for _t, s in rows], np.int64)
    base = {t: 100_000 * (i + 1) for i, t in enumerate(streams)}
    return {
        "step_seq": np.array([base[t] + s for t, s in rows], np.int64),
        "step": step,
        "batch_row": np.zeros(n, np.int64),
        "pid": np.full(n, 3),
        "trace_id": [t for t, _s in rows],
        "loss": np.array([streams[t][s] for t, s in rows], np.float64),
        "position": step + 20,
        "token_id": np.zeros(n, np.int64),
        "target_id": np.zeros(n, np.int64),
        "t_end_ns": np.zeros(n, np.int64),
    }


def test_all_scores_the_calibrated_and_windowed_detectors_as_each_alone():
    """`all` keeps one window per request for both (the relative score reads it): its calibrated rows
    are `calibrated`'s and its t-test / MAD rows are `both`'s, row for row, over polls of 1 to 40
    generated tokens of 3 requests."""
    rng = np.random.default_rng(5)
    streams = {t * 32: rng.lognormal(0.5, 0.8, 800) for t in "abc"}
    detectors = {
        name: StreamingDetector(DetectorConfig(detector=name, alarm_rate=1e-2, calibrated_score="relative"))
        for name in ("all", "calibrated", "both")
    }
    rows = {name: [] for name in detectors}
    sizes = [1, 3, 7, 40, 2, 13] * 12
    cursors = {name: dict.fromkeys(streams, 0) for name in detectors}
    for k, size in enumerate(sizes):
        counts = {t: size if (k + i) % 3 else max(1, size // 2) for i, t in enumerate(streams)}
        for name, detector in detectors.items():
            out = detector.add(_generated(streams, cursors[name], counts), now_ns=k) or {"kind": []}
            rows[name] += [(out["kind"][i], out["trace_id"][i], out["step"][i], out["score"][i])
                           for i in range(len(out["kind"]))]  # fmt: skip
    calibrated = [r for r in rows["all"] if r[0] == "loss_calibrated"]
    assert calibrated == rows["calibrated"] and len(calibrated) > 0
    assert sorted(r for r in rows["all"] if r[0] != "loss_calibrated") == sorted(rows["both"])
    assert detectors["calibrated"].counters.tested > 1000


def test_warm_up_is_per_bucket():
    """A bucket's tokens are untested until its own reference resolves the budget (1 / 0.01 = 100
    losses); a young bucket does not borrow another's."""
    scorer = ConformalScorer(alarm_rate=0.01, buckets=(8,))
    rng = np.random.default_rng(2)
    pid, variant = np.zeros(50, np.int64), np.zeros(50, np.int64)
    position = np.arange(50)  # 8 of each 50 in bucket 0, 42 in bucket 1
    for batch in range(13):
        scores = scorer.score(pid, variant, position, rng.random(50))
        assert np.isnan(scores.p[:8]).all()  # bucket 0 holds 8 x batch < 100 before this batch
        assert np.isnan(scores.p[8:]).all() == (batch < 3)  # bucket 1: 42 x 3 = 126 >= 100 from batch 3
    assert set(scores.bucket[8:].tolist()) == {1} and set(scores.bucket[:8].tolist()) == {-1}
    last = scorer.score(pid, variant, position, rng.random(50))  # bucket 0 now holds 104
    assert not np.isnan(last.p).any() and set(last.bucket[:8].tolist()) == {0}
    assert scorer.counters.warmup == 13 * 8 + 3 * 42 and scorer.counters.tested == 10 * 42 + 50


def test_p_values_are_exact_ranks_with_the_coin_breaking_ties():
    reference = Reference()
    values = np.array([1.0, 2.0, 3.0, 4.0])
    reference.add(bins_of(values), max_count=1e9)
    b = bins_of(np.array([2.5, 4.0, 9.0]))
    p = reference.p_values(b, np.array([0.0, 0.5, 1.0]))
    # 2.5: 2 above, none tied -> (2 + 0) / 5; 4.0: 0 above, 1 tied -> 0.5 * 2 / 5; 9.0: (0 + 1) / 5
    assert p.tolist() == [2 / 5, 1 / 5, 1 / 5]


def test_counts_halve_at_max_count_so_the_state_stays_bounded():
    reference = Reference()
    reference.add(bins_of(np.ones(300)), max_count=256)
    assert reference.total == 150 and reference.counts.sum() == 150


def test_references_are_bounded_and_evicted_least_recently_used_first():
    scorer = ConformalScorer(alarm_rate=0.01, max_references=6)
    for pid in range(10):  # one reference each: (pid, generated, bucket 1)
        scorer.score(np.full(3, pid), np.zeros(3, np.int64), np.full(3, 20), np.ones(3))
    scorer.score(np.full(3, 5), np.zeros(3, np.int64), np.full(3, 20), np.ones(3))  # 5: most recent now
    scorer.score(np.full(3, 10), np.zeros(3, np.int64), np.full(3, 20), np.ones(3))  # evicts 4, not 5
    assert scorer.counters.references == 6 and scorer.counters.evicted == 5
    assert scorer.memory_bytes() == 6 * BINS * 8
    assert {key[0] for key in scorer._references} == {5, 6, 7, 8, 9, 10}


def test_benjamini_hochberg():
    # p_(1..5) = .001 .008 .039 .041 .9, m = 5, q = .05: thresholds .01 .02 .03 .04 .05 -> 2 discoveries
    assert bh_discoveries([0.001, 0.008, 0.039, 0.041, 0.9], 5, 0.05) == 2
    assert bh_discoveries([0.011, 0.02], 2, 0.02) == 2  # the step-up: p_(1) > q/m, yet both rejected
    assert bh_discoveries([], 10, 0.05) == 0


def test_request_verdict_in_the_stream():
    tests = RequestTests()
    assert tests.add([0.5, 0.004], 0.01) == 1  # 0.004 <= 1 * 0.01 / 2
    assert tests.add([0.3, 0.6], 0.01) == 1  # m = 4: 0.004 > 0.0025, but a flagged request stays flagged
    assert tests.tested == 4 and tests.small == [0.004]
    many = RequestTests()
    many.add(np.full(200, 1e-6).tolist(), 0.01)
    assert len(many.small) == RequestTests.KEPT and many.discoveries == RequestTests.KEPT


def test_burst_of_flags_is_held_out_of_the_reference():
    """A run of faulted tokens (all flagged) must not teach the reference that such losses are normal."""
    rng = np.random.default_rng(3)
    scorer = ConformalScorer(alarm_rate=0.01)
    zeros = np.zeros(500, np.int64)
    scorer.score(zeros, zeros, np.full(500, 30), rng.lognormal(0, 0.5, 500))
    burst = np.full(200, 50.0)
    for _ in range(10):
        scores = scorer.score(zeros[:200], zeros[:200], np.full(200, 30), burst)
    assert scores.flagged.all()  # still flagged after 2,000 faulted tokens
    assert scorer.counters.held_out >= 1800


def test_alarm_rate_from_the_daemons_file_variable_and_flag(tmp_path):
    """detector.* keys: the file, then LLMOBS_ALARM_RATE, then --alarm-rate, into each target's
    DetectorConfig; a bad value is one ConfigError naming the key and its origin."""
    from llmobs.daemon import config as daemon_config
    from llmobs.errors import ConfigError

    path = tmp_path / "agent.toml"
    path.write_text('[detector]\nname = "calibrated"\nalarm_rate = 0.01\nfdr = 0.05\n')
    from_file = daemon_config.load(path, env={}).detector_config()
    assert (from_file.detector, from_file.alarm_rate, from_file.fdr) == ("calibrated", 0.01, 0.05)
    from_env = daemon_config.load(path, env={"LLMOBS_ALARM_RATE": "1e-4"})
    assert from_env.detector_config().alarm_rate == 1e-4 and from_env.sources["detector.alarm_rate"] == (
        "env LLMOBS_ALARM_RATE"
    )
    from_flag = daemon_config.load(
        path, env={"LLMOBS_ALARM_RATE": "1e-4"}, flags={"detector.alarm_rate": "2e-5"}
    )
    assert from_flag.detector_config().alarm_rate == 2e-5
    assert daemon_config.load(path, env={"LLMOBS_DETECTOR": "off"}).detector_config() is None
    assert daemon_config.load(None, env={}).detector_config() == DetectorConfig(detector="calibrated")
    with pytest.raises(ConfigError, match=r"detector.alarm_rate = '0.5' \(from env LLMOBS_ALARM_RATE\)"):
        daemon_config.load(path, env={"LLMOBS_ALARM_RATE": "0.5"})


def test_attach_takes_the_same_detector_flags():
    from llmobs.cli import build_parser
    from llmobs.settings import detector_config

    def config(*flags):
        return detector_config(build_parser().parse_args(["attach", "--pid", "1", *flags]))

    chosen = config("--detector", "all", "--alarm-rate", "1e-4")
    assert chosen.enabled == ("calibrated", "ttest", "mad") and chosen.alarm_rate == 1e-4
    with pytest.raises(ValueError, match="detector.alarm_rate"):
        config("--alarm-rate", "0")


def test_the_scalar_path_of_tiny_polls_gives_exactly_the_vector_paths_results(monkeypatch):
    """Polls of at most SCALAR_BATCH tokens take a Python-float path: on the same mixed stream (two
    processes, both variants, raw and relative scores, every position bucket, a burst that trips the
    hold-out guard, one reference evicted) it gives the vectorised path's p-values, verdicts, counters
    and references exactly."""
    from llmobs.diagnostics import conformal

    rng = np.random.default_rng(7)
    polls = []
    for k in range(4000):
        n = int(rng.choice([1, 1, 2, 3, 4, 9]))
        loss = rng.lognormal(0.5, 1.0, n)
        relative = np.where(rng.random(n) < 0.5, rng.standard_t(3, n), np.nan)
        if 3000 <= k < 3300:  # a burst: the flag rate passes the guard, flagged tokens are held out
            loss, relative = loss + 40.0, relative + 40.0
        pid = rng.integers(1, 3, n) if k < 3900 else np.full(n, 3)  # a third process evicts references
        polls.append((pid, rng.integers(0, 2, n), rng.integers(0, 700, n), loss, relative))

    def run(scalar_batch: int):
        monkeypatch.setattr(conformal, "SCALAR_BATCH", scalar_batch)
        scorer = ConformalScorer(alarm_rate=0.01, max_references=32, seed=3)
        out = [scorer.score(*poll) for poll in polls]
        return scorer, out

    tiny = conformal.SCALAR_BATCH
    assert tiny >= 4  # the polls above are tiny ones, with a few larger among them
    vector, expected = run(0)
    scalar, got = run(tiny)
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a.p, b.p)
        for field in ("flagged", "reference_n", "bucket", "relative"):
            assert getattr(a, field).dtype == getattr(b, field).dtype
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert vector.counters == scalar.counters
    assert vector.counters.held_out > 0 and vector.counters.evicted > 0 and vector.counters.flagged > 0
    assert list(vector._references) == list(scalar._references)
    for key, ref in vector._references.items():
        np.testing.assert_array_equal(ref.counts, scalar._references[key].counts)
        assert ref.total == scalar._references[key].total
    assert vector._flag_rate == scalar._flag_rate
