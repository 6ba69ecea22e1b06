"""The calibrated detector's scalar path for polls of <= TINY_BATCH steps (`_add_calibrated_tiny`:
Python scalars, arrays only for a flagged token's row) against its vectorised path
(`_add_calibrated_arrays`) on the same long random streams: the same rows, counters and state after
every poll, bit for bit."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from llmobs.diagnostics import detectors
from llmobs.diagnostics.conformal import ConformalScorer
from llmobs.diagnostics.detectors import DetectorConfig, StreamingDetector

RATE = 0.02  # a warm-up of 50 scores per reference: the stream gets past it, then flags some tokens
CONFIGS = {
    "raw": DetectorConfig(alarm_rate=RATE),  # the agent's default, at a budget the stream exercises
    "raw-no-aftermath": DetectorConfig(alarm_rate=RATE, aftermath=0),  # no z computed at all
    "relative": DetectorConfig(alarm_rate=RATE, calibrated_score="relative"),
    "relative-no-aftermath": DetectorConfig(alarm_rate=RATE, calibrated_score="relative", aftermath=0),
    # short windows, a flat window's 0 / 0 and inf z (min_sd 0), a short aftermath, evictions of
    # open requests (a pass split by a poll forgotten) and of references (their flag rates with them)
    "evicting": DetectorConfig(
        alarm_rate=0.05,
        calibrated_score="relative",
        window=6,
        min_history=3,
        min_sd=0.0,
        aftermath=4,
        aftermath_z=2.0,
        max_open=3,
        max_references=6,
    ),
    # beside the windowed detectors: the z only reads the windows, the t-test and MAD move them on
    "all": DetectorConfig(detector="all", alarm_rate=RATE, calibrated_score="relative", fdr=0.2),
}
COLUMNS = ("pid", "step_seq", "trace_id", "step", "position", "token_id", "target_id", "loss", "batch_row",
           "t_end_ns")  # fmt: skip


@dataclasses.dataclass
class _Request:
    """One request's token steps: generated (a pass each) or teacher-forced (one pass, one step_seq)."""

    pid: int
    trace: str
    batch_row: int
    first: int  # its first step_seq
    forced: bool
    prompt: int  # the position of its step 0
    losses: np.ndarray
    step: int = 0

    def next_row(self) -> dict:
        s = self.step
        self.step += 1
        return {"pid": self.pid, "step_seq": self.first if self.forced else self.first + s,
                "trace_id": self.trace, "step": s, "position": self.prompt + s, "token_id": s,
                "target_id": s + 1, "loss": float(self.losses[s]), "batch_row": self.batch_row,
                "t_end_ns": 1000 + s}  # fmt: skip


def _losses(rng, n: int, spike_rate: float, spike: float) -> np.ndarray:
    """A request's losses: its own level and spread (normal, heavy-tailed, flat or tied), spikes that
    stand out, NaN and +-inf (no target, a broken step)."""
    kind = int(rng.integers(4))
    level = rng.uniform(1.0, 4.0)
    if kind == 0:
        x = rng.normal(level, rng.uniform(0.1, 1.0), n)
    elif kind == 1:
        x = level * rng.lognormal(0.0, 0.6, n)
    elif kind == 2:
        x = np.full(n, level)  # flat: MAD 0
    else:
        x = np.round(rng.normal(level, 0.3, n), 1)  # ties
    spikes = rng.random(n) < spike_rate
    x[spikes] += rng.uniform(spike, spike + 10.0, spikes.sum())
    x[rng.random(n) < 0.04] = np.nan
    x[rng.random(n) < 0.01] = np.inf
    x[rng.random(n) < 0.005] = -np.inf
    return x


def _new_request(rng, first: int, spike_rate: float, spike: float) -> _Request:
    forced = rng.random() < 0.3
    n = int(rng.integers(5, 40) if forced else rng.integers(10, 120))
    return _Request(
        pid=int(rng.choice([7, 9])),
        trace=f"{int(rng.integers(6)):032x}",  # few traces: one trace over several rows and passes
        batch_row=int(rng.integers(3)),
        first=first,
        forced=forced,
        prompt=0 if forced else int(rng.integers(1, 80)),  # every position bucket
        losses=_losses(rng, n, spike_rate, spike),
    )


def _as_columns(rng, rows: list[dict]) -> dict:
    """The poll's columns in one of the forms the detector gets: the map reader's (int64, float32 loss,
    int32 batch_row), all 64-bit, Python lists; now and then one it cannot take exactly (the numpy path
    then takes the poll on both detectors)."""
    cols = {c: [r[c] for r in rows] for c in COLUMNS}
    form = rng.choice(["reader", "wide", "lists", "odd"], p=[0.5, 0.25, 0.2, 0.05])
    if form == "lists":
        return cols
    out = {c: (v if c in ("trace_id", "loss") else np.asarray(v, np.int64)) for c, v in cols.items()}
    out["loss"] = np.asarray(cols["loss"], np.float32 if form == "reader" else np.float64)
    if form == "reader":
        out["batch_row"] = out["batch_row"].astype(np.int32)
    if form == "odd":
        out["step"] = out["step"].astype(np.float64)  # floats: only the numpy path converts them
    return out


def _polls(seed: int, count: int) -> list[dict]:
    """`count` polls of 1..TINY_BATCH token steps from 2-6 interleaved requests, each request's steps
    in order (a teacher-forced pass's tokens one after another: a poll may split the pass). The
    requests begun in the stream's third fifth are faulty (half their tokens spike, higher and higher):
    a burst, whose flags the scorer holds out of its references."""
    rng = np.random.default_rng(seed)
    live: list[_Request] = []
    next_first = 1000
    polls = []
    while len(polls) < count:
        while len(live) < 2 or (len(live) < 6 and rng.random() < 0.1):
            burst = (len(polls) - 2 * count // 5) / (count // 5)  # in [0, 1) during the burst
            if 0 <= burst < 1:
                live.append(_new_request(rng, next_first, 0.5, 20.0 + 200.0 * burst))
            else:
                live.append(_new_request(rng, next_first, 0.03, 4.0))
            next_first += 1000
        size, rows = int(rng.integers(1, detectors.TINY_BATCH + 1)), []
        while len(rows) < size and live:
            request = live[int(rng.integers(len(live)))]
            for _ in range(size - len(rows) if request.forced else 1):  # a pass: its tokens in a run
                rows.append(request.next_row())
                if request.step == len(request.losses):
                    live.remove(request)
                    break
        polls.append(_as_columns(rng, rows))
    return polls


def _state(detector: StreamingDetector) -> dict:
    """Everything the detector and its scorer keep, as plain values (a window as floats, whether an
    array or a list holds it); the CPU seconds counted are not state."""
    requests = [
        (key, [float(v) for v in s.history], s.seen, s.last_flag,
         None if s.tests is None else (s.tests.tested, list(s.tests.small), s.tests.discoveries))
        for key, s in detector._open.items()
    ]  # fmt: skip
    scorer = detector.calibrated
    return {
        "counters": dataclasses.replace(detector.counters, seconds=0.0),
        "requests": requests,
        "forced_open": set(detector._forced_open),
        "scorer_counters": dataclasses.replace(scorer.counters),
        "references": [(key, r.total) for key, r in scorer._references.items()],  # counts: _same_counts
        "flag_rate": dict(scorer._flag_rate),
        "rng": scorer._rng.bit_generator.state,
    }


def _same_counts(a: StreamingDetector, b: StreamingDetector) -> bool:
    """The references' bin counts equal (their keys, order and totals are in _state)."""
    return all(
        np.array_equal(r.counts, b.calibrated._references[key].counts)
        for key, r in a.calibrated._references.items()
    )


def _vectorised(config: DetectorConfig) -> StreamingDetector:
    """A detector whose calibrated detector takes the vectorised path for every poll."""
    detector = StreamingDetector(config)
    detector._add_calibrated = detector._add_calibrated_arrays
    return detector


@pytest.mark.parametrize("name", CONFIGS)
def test_tiny_polls_give_the_vectorised_paths_rows_counters_and_state_after_every_poll(monkeypatch, name):
    """Polls of 1-4 steps of interleaved requests and passes, through warm-up, flags, a burst."""
    config = CONFIGS[name]
    scalar, vectorised = StreamingDetector(config), _vectorised(config)
    taken = {"tiny": 0, "flagged": 0}
    tiny = scalar._add_calibrated_tiny

    def counted(steps, poll, now_ns):
        taken["tiny"] += 1
        rows = tiny(steps, poll, now_ns)
        taken["flagged"] += rows is not None
        return rows

    monkeypatch.setattr(scalar, "_add_calibrated_tiny", counted)
    rows = 0
    for i, poll in enumerate(_polls(seed=list(CONFIGS).index(name), count=1500)):
        got, want = scalar.add(poll, now_ns=i), vectorised.add(poll, now_ns=i)
        assert got == want, i  # every column of every row: p-value, reference, request verdict, z...
        assert _state(scalar) == _state(vectorised) and _same_counts(scalar, vectorised), i
        rows += len(got["ts_ns"]) if got else 0
    c, s = scalar.counters, scalar.calibrated.counters
    # the stream exercised what is compared: the scalar path, flags on it, warm-up, verdicts
    assert taken["tiny"] > 1300 and taken["flagged"] >= 5 and rows >= 5
    assert c.warmup > 0 and s.tested > 1000 and c.requests_flagged > 0
    if config.aftermath:
        assert c.aftermath > 0 and c.consequences > 0
    if config.calibrated_score == "raw":  # the burst's raw losses outgrow the references
        assert s.held_out > 0
    if name == "evicting":
        assert c.evicted > 0 and s.evicted > 0


def _merged(polls: list[dict], rng) -> list[dict]:
    """The polls, runs of 1-12 of them merged into one: a stream of tiny and larger polls (<= 48 steps)."""
    merged, at = [], 0
    while at < len(polls):
        run = polls[at : at + int(rng.integers(1, 13))]
        at += len(run)
        columns = {c: [v for poll in run for v in list(poll[c])] for c in COLUMNS}
        merged.append({c: v if c == "trace_id" else np.asarray(v, np.float64 if c == "loss" else np.int64)
                       for c, v in columns.items()})  # fmt: skip
    return merged


@pytest.mark.parametrize("name", ["raw", "relative", "all"])
def test_tiny_and_larger_polls_in_turn_hand_the_same_state_on(name):
    """The scalar path keeps a request's window as a list, the vectorised path as an array: a request
    scored by both in turn (a target that slows down and speeds up) gets the same verdicts."""
    config = CONFIGS[name]
    scalar, vectorised = StreamingDetector(config), _vectorised(config)
    polls = _merged(_polls(seed=11, count=2000), np.random.default_rng(11))
    assert sum(len(p["step"]) <= detectors.TINY_BATCH for p in polls) >= 30
    for i, poll in enumerate(polls):
        assert scalar.add(poll, now_ns=i) == vectorised.add(poll, now_ns=i), i
        assert _state(scalar) == _state(vectorised) and _same_counts(scalar, vectorised), i
    assert scalar.counters.anomalies >= 5


def test_the_scorers_scalar_entry_point_is_score_on_lists():
    """ConformalScorer.score_scalars (lists in and out) against score() (arrays) on polls of 1-4 tokens
    of mixed pids, variants, positions and score kinds: the same scores, counters and references."""
    rng = np.random.default_rng(5)
    lists, arrays = (ConformalScorer(alarm_rate=0.05, max_references=10, seed=1) for _ in range(2))
    flagged = 0
    for _ in range(3000):
        n = int(rng.integers(1, 5))
        pid, variant = np.where(rng.random(n) < 0.02, 2, 1), rng.integers(0, 2, n)  # pid 2: evicted
        position, loss = rng.integers(0, 100, n), rng.lognormal(1.0, 0.5, n) + (rng.random(n) < 0.05) * 9
        z = np.where(rng.random(n) < 0.5, rng.normal(0.0, 2.0, n), np.nan)
        relative = z if rng.random() < 0.7 else None
        got = lists.score_scalars(pid.tolist(), variant.tolist(), position.tolist(), loss.tolist(),
                                  None if relative is None else relative.tolist())  # fmt: skip
        want = arrays.score(pid, variant, position, loss, relative)
        for field in dataclasses.fields(want):
            g, w = getattr(got, field.name), getattr(want, field.name)
            assert isinstance(g, list)
            assert all(
                a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(g, w.tolist(), strict=True)
            )
        flagged += sum(got.flagged)
    assert flagged > 50 and arrays.counters.evicted > 0
    assert lists.counters == arrays.counters and lists._flag_rate == arrays._flag_rate
    assert [(k, r.counts.tobytes(), r.total) for k, r in lists._references.items()] == [
        (k, r.counts.tobytes(), r.total) for k, r in arrays._references.items()
    ]
    assert lists._rng.bit_generator.state == arrays._rng.bit_generator.state
