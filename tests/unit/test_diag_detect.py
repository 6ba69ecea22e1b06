"""Loss-anomaly detectors (t-test, median/MAD), their streaming form, evidence ranking, live rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
from llmobs.diagnostics.detectors import DetectorConfig, StreamingDetector, score_sequence
from llmobs.diagnostics.evidence import gather, refresh_evidence, summary
from llmobs.diagnostics.live import LiveAnomalies
from llmobs.store.sink import DuckDBStore
from scipy import stats

DETECTORS = ("ttest", "mad")


def _noisy(seed: int, n: int = 64, sd: float = 0.5) -> np.ndarray:
    return np.random.default_rng(seed).normal(3.0, sd, n)


@pytest.mark.parametrize("detector", DETECTORS)
@pytest.mark.parametrize("seed", range(5))
def test_each_detector_catches_a_six_sigma_spike_and_only_it(detector, seed):
    losses = _noisy(seed)
    spike_at = 40
    losses[spike_at] = 3.0 + 6 * 0.5
    scores = score_sequence(losses)
    flagged = np.flatnonzero(scores.flagged(detector))
    assert spike_at in flagged
    # at alpha 0.01 / z 3.5 a clean normal series of 64 raises at most a rare false alarm
    assert len(flagged) <= 2, flagged


@pytest.mark.parametrize("detector", DETECTORS)
def test_a_flat_series_is_never_flagged_but_a_step_out_of_it_is(detector):
    flat = np.full(64, 2.0)
    assert not score_sequence(flat).flagged(detector).any()
    flat[50] = 2.5  # 0.5 nats above a series that never moved: the spread floor (0.05) makes it count
    assert np.flatnonzero(score_sequence(flat).flagged(detector)).tolist() == [50]
    flat[50] = 2.01  # a wobble below the floor is not an anomaly
    assert not score_sequence(flat).flagged(detector).any()


@pytest.mark.parametrize("detector", DETECTORS)
def test_one_sided_a_loss_drop_is_not_an_anomaly(detector):
    losses = _noisy(1)
    losses[30] = -10.0
    assert 30 not in np.flatnonzero(score_sequence(losses).flagged(detector))


def test_no_verdict_before_min_history_and_nan_losses_are_skipped():
    losses = np.full(20, 1.0)
    losses[3] = 50.0  # before min_history (8): not tested
    losses[12] = np.nan  # no target: neither tested nor in any window
    scores = score_sequence(losses, DetectorConfig(min_history=8))
    assert scores.n[3] == 0 and not scores.ttest[3] and not scores.mad_flag[3]
    assert scores.n[12] == 0 and np.isnan(scores.t[12])
    assert scores.n[13] == 12  # 13 tokens before it, one of them without a loss
    assert scores.n[19] == 18


def test_t_statistic_is_the_predictive_one_and_p_comes_from_the_t_distribution():
    losses = _noisy(3, n=40)
    config = DetectorConfig(window=16)
    scores = score_sequence(losses, config)
    i = 30
    window = losses[i - 16 : i]
    t = (losses[i] - window.mean()) / (window.std(ddof=1) * np.sqrt(1 + 1 / 16))
    assert scores.t[i] == pytest.approx(t)
    assert scores.p[i] == pytest.approx(stats.t.sf(t, 15))
    median = np.median(window)
    assert scores.z[i] == pytest.approx(0.6745 * (losses[i] - median) / np.median(np.abs(window - median)))


def test_mad_is_robust_to_an_earlier_spike_in_the_window_the_t_test_is_not():
    losses = _noisy(4, sd=0.2)
    losses[20] = 40.0  # a huge earlier spike inflates the t-test's mean and sd for the next 32 tokens
    losses[30] = 3.0 + 8 * 0.2
    scores = score_sequence(losses)
    assert scores.mad_flag[30]
    assert not scores.ttest[30]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"detector": "zscore"}, "one of calibrated, ttest, mad, both, all"),
        ({"window": 1}, "window must be >= 2"),
        ({"window": 16, "min_history": 20}, "min_history"),
        ({"min_history": 1}, "min_history"),
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": 1.0}, "alpha"),
        ({"mad_threshold": 0}, "mad_threshold"),
        ({"max_open": 0}, "max_open"),
        ({"calibrated_score": "z"}, "calibrated_score must be one of raw, relative"),
    ],
)
def test_config_validation(options, message):
    with pytest.raises(ValueError, match=message):
        DetectorConfig(**options)


def _steps(trace: str, losses, first: int = 100, row: int = 0, pid: int = 7, start: int = 0) -> dict:
    n = len(losses)
    step = np.arange(start, start + n)
    return {
        "pid": np.full(n, pid), "step_seq": first + step, "trace_id": [trace] * n, "step": step,
        "position": 10 + step, "token_id": step + 1000, "target_id": step + 1000,
        "loss": np.asarray(losses, np.float32), "batch_row": np.full(n, row, np.int32),
        "t_start_ns": (first + step) * 1_000_000, "t_end_ns": (first + step) * 1_000_000 + 500_000,
    }  # fmt: skip


def _concat(parts: list[dict]) -> dict:
    return {k: np.concatenate([np.asarray(p[k]) for p in parts]).tolist() for k in parts[0]}


def test_streaming_equals_scoring_the_whole_sequence_whatever_the_chunks_and_interleaving():
    a, b = _noisy(5, n=80), _noisy(6, n=80)
    a[50], b[33] = 9.0, 9.0
    want = {(t, int(s), f"loss_{d}") for t, x in (("a" * 32, a), ("b" * 32, b)) for d in DETECTORS
            for s in np.flatnonzero(score_sequence(x).flagged(d))}  # fmt: skip
    assert len(want) >= 4  # both sequences do have anomalies, for both detectors
    detector = StreamingDetector(DetectorConfig(detector="both"))
    got = set()
    cuts = [0, 1, 7, 8, 30, 31, 50, 51, 79, 80]
    for lo, hi in zip(cuts, cuts[1:], strict=False):  # both requests in each batch, in uneven chunks
        batch = _concat(
            [_steps("a" * 32, a[lo:hi], start=lo), _steps("b" * 32, b[lo:hi], first=500, start=lo)]
        )
        rows = detector.add(batch, now_ns=1)
        if rows:
            got |= set(zip(rows["trace_id"], rows["step"], rows["kind"], strict=True))
    assert got == want
    assert detector.counters.steps == 160 and detector.counters.open == 2


@pytest.mark.parametrize("few", [0, 2])  # 0: every batch through the one-pass path for many requests
def test_a_batch_of_many_requests_scores_as_each_request_alone(monkeypatch, few):
    from llmobs.diagnostics import detectors

    monkeypatch.setattr(detectors, "FEW_REQUESTS", few)
    series = {f"{i:x}" * 32: _noisy(10 + i, n=90) for i in range(6)}
    for i, losses in enumerate(series.values()):
        losses[20 + 9 * i] = 9.0
        losses[3 * i + 1] = np.nan  # a step without a target: neither tested nor in any window
    want = {(t, int(s), f"loss_{d}") for t, x in series.items() for d in DETECTORS
            for s in np.flatnonzero(score_sequence(x).flagged(d))}  # fmt: skip
    assert len(want) >= 12
    detector = StreamingDetector(DetectorConfig(detector="both"))
    got, details = set(), {}
    cuts = [0, 5, 6, 40, 41, 77, 90]  # batches of 6 x 1 .. 6 x 36 steps: both key paths
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        parts = [_steps(t, x[lo:hi], first=1000 * (i + 1), row=i, start=lo)
                 for i, (t, x) in enumerate(series.items())]  # fmt: skip
        rows = detector.add(_concat(parts), now_ns=1)
        if rows:
            got |= set(zip(rows["trace_id"], rows["step"], rows["kind"], strict=True))
            keys = zip(rows["trace_id"], rows["step"], rows["kind"], strict=True)
            details.update(zip(keys, rows["detail"], strict=True))
    assert got == want
    assert detector.counters.steps == 6 * 90 and detector.counters.open == 6
    trace, losses = next(iter(series.items()))
    both = StreamingDetector(DetectorConfig(detector="both"))
    alone = both.add(_steps(trace, losses, first=1000, row=0), now_ns=1)
    keys = zip(alone["trace_id"], alone["step"], alone["kind"], strict=True)
    for key, detail in zip(keys, alone["detail"], strict=True):
        assert json.loads(details[key]) == pytest.approx(json.loads(detail))


def test_anomaly_rows_carry_the_request_key_and_why():
    losses = np.full(30, 1.0) + np.random.default_rng(0).normal(0, 0.1, 30)
    losses[25] = 4.0
    rows = StreamingDetector(DetectorConfig(detector="ttest")).add(_steps("c" * 32, losses, first=200), 99)
    assert rows["kind"] == ["loss_ttest"] and rows["detector"] == ["ttest"]
    assert rows["step_seq"] == [225] and rows["first_step_seq"] == [200] and rows["step"] == [25]
    assert rows["ts_ns"] == [99] and rows["pid"] == [7] and rows["batch_row"] == [0]
    detail = json.loads(rows["detail"][0])
    assert detail["n"] == 25 and detail["p_value"] < 0.01 and detail["loss"] == pytest.approx(4.0)
    assert detail["token_id"] == 1025 and detail["position"] == 35 and detail["t_end_ns"] == 225_500_000
    assert rows["score"][0] == pytest.approx(
        (4.0 - detail["window_mean"]) / (detail["window_sd"] * np.sqrt(1 + 1 / 25))
    )


def test_open_requests_are_bounded_oldest_evicted_and_counted():
    detector = StreamingDetector(DetectorConfig(max_open=2))
    for i, trace in enumerate(("a", "b", "c", "a")):
        detector.add(_steps(trace * 32, np.ones(4), first=100 * i), 0)
    # a, b, c: a evicted for c; a again: b evicted for it (a starts over: its history was dropped)
    assert detector.counters.evicted == 2 and detector.counters.open == 2
    assert detector.counters.steps == 16


# ---- evidence ----------------------------------------------------------------------------------------


def _rollup(step_seq: int, **values) -> dict:
    row = {
        "pid": 7, "step_seq": step_seq, "tokens": 1, "t_start_ns": step_seq * 10**6,
        "t_end_ns": step_seq * 10**6 + 1, "decode_latency_ns": 2_000_000, "launches": 100, "allocations": 50,
        "alloc_bytes": 1 << 20, "frees": 50,
        "memcpy_bytes": 0, "off_cpu_ns": 100_000, "page_faults": 3, "compute_calls": 211, "gpu_ns": None,
        "tagged_events": 10, "windowed_events": 0, "counts_exact": True,
    }  # fmt: skip
    row.update(values)
    return row


@pytest.fixture
def store(tmp_path):
    with DuckDBStore(tmp_path / "s.duckdb") as s:
        yield s


def _fill(store, rows: list[dict]) -> None:
    store.append({"step_rollups": {k: [r[k] for r in rows] for k in rows[0]}})


def test_evidence_ranks_what_is_unusual_by_how_far_out_it_is(store):
    rng = np.random.default_rng(0)
    base = [
        _rollup(s, decode_latency_ns=int(2e6 + rng.normal(0, 5e4)), off_cpu_ns=int(1e5 + rng.normal(0, 1e4)))
        for s in range(1, 41)
    ]
    spike = _rollup(41, decode_latency_ns=3_100_000, off_cpu_ns=5_000_000, alloc_bytes=1 << 20)
    quiet = _rollup(42)
    _fill(store, [*base, spike, quiet])
    conn = store.connection
    ev = gather(conn, 7, 41)
    assert ev["baseline_steps"] == 32 and ev["counts_exact"]
    # off-CPU moved by ~490 MADs, the step's latency by ~30: ranked in that order; allocations did not move
    assert [u["measure"] for u in ev["unusual"]] == ["off_cpu_ns", "decode_latency_ns"]
    assert ev["unusual"][0]["value"] == 5_000_000 and ev["unusual"][0]["ratio"] > 40
    assert "off-CPU time: 5.00 ms vs median 0.10 ms" in summary(ev)
    assert gather(conn, 7, 42)["unusual"] == []
    assert "nothing unusual" in summary(gather(conn, 7, 42))
    assert gather(conn, 7, 43) is None  # not rolled up (yet)
    assert summary(gather(conn, 7, 2)).startswith("no baseline")


def test_evidence_names_extra_and_slow_kernels(store):
    _fill(store, [_rollup(s) for s in range(1, 12)])
    ops = []
    for s in range(1, 12):
        ops.append((s, "gemm_kernel", 1000))
        if s == 11:
            ops += [(s, "gemm_kernel", 90_000), (s, "nccl_allreduce", 5000)]
    store.append({"gpu_ops": {
        "pid": [7] * len(ops), "ts_ns": [s * 10**6 for s, _, _ in ops], "probe": ["cupti"] * len(ops),
        "step_seq": [s for s, _, _ in ops], "source": ["cupti"] * len(ops), "name": [n for _, n, _ in ops],
        "gpu_start_ns": [0] * len(ops), "gpu_end_ns": [d for _, _, d in ops],
    }})  # fmt: skip
    unusual = {u["what"]: u for u in gather(store.connection, 7, 11)["unusual"]}
    assert unusual["extra kernel: nccl_allreduce"]["value"] == 1
    assert unusual["extra calls: gemm_kernel"]["value"] == 2
    assert unusual["slow kernel: gemm_kernel"]["value"] == 91_000
    assert gather(store.connection, 7, 10)["unusual"] == []


def test_refresh_fills_evidence_once_the_step_is_rolled_up(store):
    _fill(store, [_rollup(s) for s in range(1, 11)] + [_rollup(11, page_faults=5000)])
    rows = {
        "ts_ns": [5, 5, 5], "pid": [7, 7, 7], "step_seq": [11, 11, 12], "trace_id": ["t" * 32] * 3,
        "kind": ["loss_ttest", "loss_mad", "loss_mad"], "score": [9.0, 9.0, 9.0], "detail": ["{}"] * 3,
    }  # fmt: skip
    store.append({"anomalies": rows})
    conn = store.connection
    assert refresh_evidence(conn, 7, since_ns=10**18) == 2  # step 12 has no rollup yet
    stored = conn.execute("SELECT step_seq, evidence FROM anomalies ORDER BY step_seq, kind").fetchall()
    assert stored[2] == (12, None)
    evidence = json.loads(stored[0][1])
    assert evidence["unusual"][0]["measure"] == "page_faults" and "page faults: 5,000" in evidence["summary"]
    # done once: a later refresh leaves them (unless they are recent), then step 12 arrives
    assert refresh_evidence(conn, 7, since_ns=10**18) == 0
    _fill(store, [_rollup(12)])
    assert refresh_evidence(conn, 7, since_ns=10**18) == 1


def test_the_last_refresh_gives_every_rolled_up_anomaly_its_evidence_page_by_page(store):
    """1,200 anomalous steps of three pids (more than three pages of MAX_STEPS_PER_REFRESH, the pages
    ending inside a step_seq's pids): a correlate run's refresh does one page; the session's last one
    (pages=None) every step, every pid; again over every step (since 0: all recent) it ends, with
    nothing changed."""
    from llmobs.diagnostics.evidence import MAX_STEPS_PER_REFRESH

    steps = range(1, 401)
    _fill(store, [{**_rollup(s), "pid": pid} for pid in (7, 8, 9) for s in steps])
    n = 3 * len(steps)
    store.append({"anomalies": {
        "ts_ns": [5] * n, "pid": [pid for pid in (7, 8, 9) for _ in steps], "step_seq": [*steps] * 3,
        "trace_id": ["t" * 32] * n, "kind": ["loss_mad"] * n, "score": [9.0] * n, "detail": ["{}"] * n,
    }})  # fmt: skip
    conn = store.connection
    missing = "SELECT count(*) FROM anomalies WHERE evidence IS NULL"
    assert refresh_evidence(conn, None, since_ns=10**18) == MAX_STEPS_PER_REFRESH  # one page
    assert conn.execute(missing).fetchall() == [(n - MAX_STEPS_PER_REFRESH,)]
    assert refresh_evidence(conn, None, since_ns=10**18, pages=None) == n - MAX_STEPS_PER_REFRESH
    assert conn.execute(missing).fetchall() == [(0,)]
    assert refresh_evidence(conn, None, since_ns=0, pages=None) == 0


# ---- live rows ---------------------------------------------------------------------------------------


def test_live_anomalies_commit_rows_with_their_latency(store):
    live = LiveAnomalies(store, DetectorConfig(detector="both"))
    losses = np.random.default_rng(2).normal(2.0, 0.2, 40)
    losses[35] = 6.0
    steps = _steps("d" * 32, losses, first=300)
    from llmobs import clock

    now = clock.monotonic_ns()
    steps["t_end_ns"] = np.full(40, now, np.int64)  # as if the step had just ended
    assert live.add(steps) == 2
    assert live.close()
    got = store.connection.execute(
        "SELECT step_seq, first_step_seq, step, kind, detector, evidence FROM anomalies ORDER BY kind"
    ).fetchall()
    assert got == [(335, 300, 35, "loss_mad", "mad", None), (335, 300, 35, "loss_ttest", "ttest", None)]
    assert live.counters.committed == 2 and live.counters.dropped == 0
    latency = live.latency_ms()
    assert latency["n"] == 2 and 0 < latency["p50"] < 60_000
    assert "2 flagged, 2 committed" in live.summary()


def test_a_forward_with_labels_is_one_request_even_when_a_poll_splits_it():
    """Teacher forcing publishes all tokens of a sequence under one step_seq (step = 0..T-1)."""
    losses = np.random.default_rng(8).normal(2.0, 0.1, 48)
    losses[40] = 5.0
    steps = _steps("e" * 32, losses, first=900)
    steps["step_seq"] = np.full(48, 900)
    detector = StreamingDetector(DetectorConfig(detector="both"))
    first = detector.add({k: v[:37] for k, v in steps.items()}, 0)
    rest = detector.add({k: v[37:47] for k, v in steps.items()}, 0)
    detector.add({k: v[47:] for k, v in steps.items()}, 0)  # one row alone: still the same request
    assert detector.counters.open == 1 and detector.counters.tested == 40
    flagged = [(s, f, k) for part in (first, rest) if part for s, f, k in
               zip(part["step"], part["first_step_seq"], part["kind"], strict=True)]  # fmt: skip
    assert (40, 900, "loss_ttest") in flagged and (40, 900, "loss_mad") in flagged
    assert {s for s, _, _ in flagged} == set(
        np.flatnonzero(score_sequence(losses).ttest | score_sequence(losses).mad_flag)
    )


def test_attach_flags_select_the_detectors():
    from llmobs.cli import build_parser
    from llmobs.settings import detector_config

    def config(*flags):
        return detector_config(build_parser().parse_args(["attach", "--pid", "1", *flags]))

    assert config() == DetectorConfig() and config().detector == "calibrated"  # AGENT_DETECTOR
    assert config("--detector", "off") is None
    chosen = config(
        "--detector", "mad", "--detector-window", "64", "--mad-threshold", "5", "--alpha", "0.001"
    )
    assert (chosen.enabled, chosen.window, chosen.mad_threshold, chosen.alpha) == (("mad",), 64, 5.0, 0.001)
    with pytest.raises(ValueError, match="alpha"):
        config("--alpha", "2")


def test_a_version_3_store_gets_the_anomaly_columns_and_keeps_its_rows(tmp_path):
    import duckdb
    from llmobs.store import schema

    path = tmp_path / "v3.duckdb"
    conn = duckdb.connect(str(path))
    assert schema.migrate(conn, target=3) == [1, 2, 3]
    conn.execute("INSERT INTO anomalies VALUES (5, 7, 11, 'ab', 'old_kind', 1.5, '{}')")
    conn.close()
    with DuckDBStore(path) as store:
        rows = store.connection.execute(
            "SELECT ts_ns, kind, score, first_step_seq, step, detector, evidence, artifact FROM anomalies"
        ).fetchall()
        assert rows == [(5, "old_kind", 1.5, None, None, None, None, None)]
        assert schema.current_version(store.connection) == schema.LATEST_VERSION >= 4


def test_the_evidence_median_is_numpys_to_the_bit():
    """evidence._median (Python, for ~32 numbers) against np.median on the baselines evidence sees:
    latencies, small counts with ties, heavy-tailed byte counts; odd and even lengths."""
    from llmobs.diagnostics.evidence import _median

    rng = np.random.default_rng(26)
    for n in range(1, 66):
        for base in (
            rng.normal(2e6, 5e4, n),
            rng.integers(0, 5, n).astype(float),
            np.round(rng.lognormal(10, 2, n)),
        ):
            median = float(np.median(base))
            assert _median(base.tolist()) == median
            assert _median([abs(b - median) for b in base.tolist()]) == float(
                np.median(np.abs(base - median))
            )
