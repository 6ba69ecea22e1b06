"""Incidents (llmobs.diagnostics.incidents) and the anomaly lane that writes them (llmobs.diagnostics.live),
on a real DuckDB store: the merge rule (gap in passes, per request; teacher-forced and training passes by
the step-level verdict), exact closing, the rows' links, and migration 11 on an older store."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import duckdb
import numpy as np
from llmobs import clock
from llmobs.diagnostics import live as live_lane
from llmobs.diagnostics.detectors import DetectorConfig
from llmobs.diagnostics.incidents import IncidentBuilder
from llmobs.diagnostics.live import COMMIT_GAP_NS, LiveAnomalies, _pass_tokens
from llmobs.store import schema
from llmobs.store.sink import DuckDBStore

TRACE = "ab" * 16


def _rows(seqs, steps, kinds, scores, first=100, row=0, trace=TRACE) -> dict:
    n = len(seqs)
    return {
        "ts_ns": [1] * n, "pid": [7] * n, "step_seq": list(seqs), "trace_id": [trace] * n,
        "kind": list(kinds),
        "score": list(scores), "detail": [json.dumps({"t_end_ns": 1000 + s}) for s in seqs],
        "first_step_seq": [first] * n, "step": list(steps), "batch_row": [row] * n,
        "detector": [k.removeprefix("loss_") for k in kinds],
    }  # fmt: skip


def test_tokens_within_the_gap_merge_and_a_detector_batch_order_does_not_split_them():
    builder = IncidentBuilder(gap=4)
    # as StreamingDetector lists them: detector by detector, each in step order
    rows = _rows([110, 113, 110, 113, 118], [10, 13, 10, 13, 18], ["loss_ttest"] * 2 + ["loss_mad"] * 2
                 + ["loss_ttest"], [4.0, 9.0, 3.0, 8.0, 5.0])  # fmt: skip
    ids = builder.add(rows, now_ns=50)
    assert ids == ["7-110-0"] * 4 + ["7-118-0"]  # 118 - 113 = 5 passes > gap: a new incident
    new, updated = builder.take_changed()
    assert updated == [] and [r["incident_id"] for r in new] == ["7-110-0", "7-118-0"]
    first = new[0]
    assert (first["first_step"], first["last_step"], first["tokens"], first["rows"]) == (10, 13, 2, 4)
    assert (first["peak_score"], first["peak_step"], first["peak_kind"]) == (9.0, 13, "loss_ttest")
    assert (first["detectors"], first["state"], first["t_first_ns"], first["t_last_ns"]) == (
        "mad,ttest", "closed", 1110, 1113)  # closed when 118 opened the next one  # fmt: skip
    assert new[1]["state"] == "open"


def test_an_incident_closes_exactly_when_the_scored_passes_are_past_its_gap():
    builder = IncidentBuilder(gap=4)
    builder.add(_rows([120], [20], ["loss_mad"], [6.0]), now_ns=1)
    builder.take_changed()
    assert builder.close_through("request", 124, now_ns=2) == 0  # 124 - 120 = 4: a row at 124 could join
    assert builder.close_through("request", 125, now_ns=3) == 1
    new, updated = builder.take_changed()
    assert new == [] and [(r["state"], r["closed_ns"]) for r in updated] == [("closed", 3)]
    assert builder.add(_rows([122], [22], ["loss_mad"], [5.0]), now_ns=4) == ["7-122-0"]  # closed is final


def test_an_open_incident_is_written_once_closed_or_once_it_has_been_open_long_enough():
    """The lane's write rule (take_changed with open_every_ns): a closed incident at once and once; an
    open one only after open_every_ns since it opened (or was last written), so a short incident is one
    INSERT instead of one statement per growth."""
    builder = IncidentBuilder(gap=4)
    builder.add(_rows([130], [30], ["loss_mad"], [6.0]), now_ns=1_000)
    assert not builder.ready(1_500, open_every_ns=1_000)  # open for 500 ns < 1,000: not yet
    assert builder.take_changed(1_500, open_every_ns=1_000) == ([], [])
    builder.add(_rows([132], [32], ["loss_mad"], [7.0]), now_ns=1_800)  # grows, still young
    assert builder.ready(2_000, open_every_ns=1_000)  # open 1,000 ns since its first row: due
    new, updated = builder.take_changed(2_000, open_every_ns=1_000)
    assert [(r["state"], r["tokens"]) for r in new] == [("open", 2)] and updated == []
    builder.add(_rows([134], [34], ["loss_mad"], [8.0]), now_ns=2_100)
    assert builder.take_changed(2_500, open_every_ns=1_000) == ([], [])  # written 500 ns ago
    builder.close_through("request", 139, now_ns=2_600)
    new, updated = builder.take_changed(2_600, open_every_ns=1_000)  # closed: at once
    assert new == [] and [(r["state"], r["tokens"]) for r in updated] == [("closed", 3)]
    builder.add(_rows([150], [50], ["loss_mad"], [6.0]), now_ns=3_000)
    builder.close_through("request", 155, now_ns=3_100)
    new, updated = builder.take_changed(3_100, open_every_ns=1_000)  # opened and closed: one INSERT
    assert [(r["state"], r["incident_id"]) for r in new] == [("closed", "7-150-0")] and updated == []


def test_other_requests_and_rows_stay_apart():
    builder = IncidentBuilder(gap=4)
    a = _rows([130], [30], ["loss_mad"], [6.0], row=0)
    b = _rows([130], [30], ["loss_mad"], [6.0], row=1)
    c = _rows([131], [31], ["loss_mad"], [6.0], first=101, trace="cd" * 16)
    ids = [builder.add(r, 1)[0] for r in (a, b, c)]
    assert ids == ["7-130-0", "7-130-1", "7-131-0"]


def test_training_passes_are_one_incident_per_bad_batch_and_their_token_rows_open_none():
    builder = IncidentBuilder(gap=4)
    # token rows of a teacher-forced pass (first_step_seq = step_seq, step > 0): no incident of their own
    noise = _rows([60, 60], [5, 17], ["loss_ttest", "loss_mad"], [4.0, 4.5], first=60)
    assert builder.add(noise, 1) == [None, None]
    spike = {"ts_ns": [2], "pid": [7], "step_seq": [61], "trace_id": [TRACE], "kind": ["train_loss_spike"],
             "score": [12.0], "detail": [json.dumps({"tokens": 124})], "batch_row": [2],
             "detector": ["step_mad"], "artifact": ["/a/dLdE.png"]}  # fmt: skip
    assert builder.add(spike, 2) == ["7-61-pass"]
    later = _rows([61], [9], ["loss_mad"], [4.0], first=61)  # a token row of the flagged pass, after it
    assert builder.add(later, 3) == ["7-61-pass"]
    builder.close_all(4)
    new, _ = builder.take_changed()
    columns = ("incident_id", "scope", "tokens", "rows", "detectors", "artifact", "batch_row")
    assert [tuple(r[c] for c in columns) for r in new] == [
        ("7-61-pass", "pass", 124, 1, "step_mad", "/a/dLdE.png", None)
    ]
    assert builder.counters.pass_token_rows == 3


def _steps(losses, first: int) -> dict:
    n = len(losses)
    return {"pid": np.full(n, 7), "step_seq": np.arange(first, first + n), "step": np.arange(n),
            "batch_row": np.zeros(n, np.int32), "loss": np.asarray(losses, np.float32),
            "trace_id": [TRACE] * n, "position": np.arange(n), "token_id": np.zeros(n, np.int64),
            "target_id": np.zeros(n, np.int64), "t_end_ns": np.full(n, clock.monotonic_ns())}  # fmt: skip


def test_the_lane_commits_rows_with_their_incident_and_closes_it_at_the_end(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb")
    live = LiveAnomalies(store, DetectorConfig(detector="both"))
    losses = np.random.default_rng(2).normal(2.0, 0.2, 60)
    losses[[35, 37, 50]] = (6.0, 6.5, 7.0)
    steps = _steps(losses, 300)
    steps["t_end_ns"] -= 1_000_000_000  # the steps ended 1 s ago: each row is late, and said to be
    assert live.add(steps) == 6  # three tokens, two detectors each
    assert live.close()
    conn = store.connection
    rows = conn.execute("SELECT step, kind, incident_id FROM anomalies ORDER BY step, kind").fetchall()
    assert rows == [(35, "loss_mad", "7-335-0"), (35, "loss_ttest", "7-335-0"), (37, "loss_mad", "7-335-0"),
                    (37, "loss_ttest", "7-335-0"), (50, "loss_mad", "7-350-0"),
                    (50, "loss_ttest", "7-350-0")]  # fmt: skip
    incidents = conn.execute(
        "SELECT incident_id, first_step, last_step, tokens, rows, detectors, state FROM incidents ORDER BY 1"
    ).fetchall()
    assert incidents == [("7-335-0", 35, 37, 2, 4, "mad,ttest", "closed"),
                         ("7-350-0", 50, 50, 1, 2, "mad,ttest", "closed")]  # fmt: skip
    assert store.counters.rows_by_table["incidents"] == 2
    assert "2 incident(s)" in live.summary() and live.counters.late == 6
    assert "6 row(s) later than 200 ms" in live.lag_summary()
    store.close()


def _until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_rows_flagged_while_commits_come_faster_than_the_gap_share_the_next_commit(tmp_path, monkeypatch):
    """The lane's clock is held still. A spike's rows are committed at once, and so are the next ones 10
    ms later; the third rows 10 ms after that (commits now come faster than the gap) wait the gap's other
    40 ms, and rows flagged meanwhile (the lane's wait is held open) join them in one commit; rows that
    come a whole gap after the last commit go at once again."""
    now = [10**15]
    monkeypatch.setattr(live_lane, "clock", SimpleNamespace(monotonic_ns=lambda: now[0]))
    waits, release = [], threading.Event()

    def wait(seconds: float) -> None:
        waits.append(seconds)
        release.wait(30)

    store = DuckDBStore(tmp_path / "s.duckdb")
    live = LiveAnomalies(store, DetectorConfig(detector="both"), wait=wait)
    commits: list[list[int]] = []
    live.on_committed = lambda rows: commits.append(sorted(set(rows["step"])))
    losses = np.random.default_rng(2).normal(2.0, 0.2, 90)
    losses[[35, 50, 60, 70, 85]] = (6.0, 6.2, 6.5, 7.0, 7.5)

    def flag(first: int, end: int) -> None:
        steps = _steps(losses[first:end], 300 + first)
        steps["step"] = steps["step"] + first
        steps["position"] = steps["position"] + first
        assert live.add(steps) == 2  # the one spike of the batch, by both detectors

    flag(0, 40)
    _until(lambda: len(commits) == 1, "the first commit")
    now[0] += 10_000_000
    flag(40, 55)
    _until(lambda: len(commits) == 2, "the second commit")
    assert waits == []
    now[0] += 10_000_000
    flag(55, 65)
    _until(lambda: waits, "the lane to wait out the gap")
    flag(65, 80)
    release.set()
    _until(lambda: len(commits) == 3, "the third commit")
    now[0] += COMMIT_GAP_NS
    flag(80, 90)
    _until(lambda: len(commits) == 4, "the fourth commit")
    assert live.close()
    assert commits == [[35], [50], [60, 70], [85]]
    assert waits == [(COMMIT_GAP_NS - 10_000_000) / 1e9]
    assert store.connection.execute("SELECT count(*) FROM anomalies").fetchall() == [(10,)]
    store.close()


def test_incidents_are_written_at_once_then_at_most_once_a_gap(tmp_path, monkeypatch):
    """The lane's clock held still: a lone spike's incident is written with its rows; the next two
    spikes' (100 and 200 ms later) wait, and go together in one write once the clock is a whole
    INCIDENT_GAP_NS past the first write (the lane's periodic wake writes them)."""
    start = 10**15
    now = [start]
    monkeypatch.setattr(live_lane, "clock", SimpleNamespace(monotonic_ns=lambda: now[0]))
    store = DuckDBStore(tmp_path / "s.duckdb")
    live = LiveAnomalies(store, DetectorConfig(detector="both"), incidents=IncidentBuilder(gap=1))
    commits, writes = [], []
    live.on_committed = lambda rows: commits.append(len(rows["kind"]))
    write = live._write_incidents

    def recorded(new, updated):
        writes.append((now[0], sorted(r["first_step"] for r in new + updated)))
        write(new, updated)

    live._write_incidents = recorded
    losses = np.random.default_rng(2).normal(2.0, 0.2, 70)
    losses[[30, 45, 57]] = (6.0, 6.5, 7.0)
    for first, end in ((0, 40), (40, 52), (52, 70)):
        steps = _steps(losses[first:end], 300 + first)
        steps["step"] = steps["step"] + first
        steps["position"] = steps["position"] + first
        assert live.add(steps) == 2
        _until(lambda first=first: len(commits) == 1 + (first > 0) + (first > 40), "the rows' commit")
        if first == 0:
            _until(lambda: writes, "the first incident's write")
        now[0] += 100_000_000
    assert writes == [(start, [30])]  # the clock is 300 ms past it: the other two wait
    now[0] = start + live_lane.INCIDENT_GAP_NS
    _until(lambda: len(writes) == 2, "the held incidents' write")
    assert live.close()
    assert writes == [(start, [30]), (start + live_lane.INCIDENT_GAP_NS, [45, 57])]
    assert store.connection.execute("SELECT count(*) FROM incidents").fetchall() == [(3,)]
    store.close()


def test_a_version_10_store_gets_incidents_and_keeps_its_anomaly_rows(tmp_path):
    path = tmp_path / "old.duckdb"
    conn = duckdb.connect(str(path))
    assert schema.migrate(conn, target=10)[-1] == 10
    conn.execute("INSERT INTO anomalies (ts_ns, pid, step_seq, kind, score) VALUES (1, 7, 9, 'loss_mad', 5)")
    conn.close()
    with DuckDBStore(path) as store:
        got = store.connection.execute("SELECT step_seq, incident_id FROM anomalies").fetchall()
        assert got == [(9, None)] and store.count("incidents") == 0
        assert schema.current_version(store.connection) == schema.LATEST_VERSION >= 11


def test_a_teacher_forced_passs_step_0_is_told_from_a_generated_requests_first_token():
    """first_step_seq = step_seq holds for both; the pass has more tokens of its row in the batch."""
    forced = {"step_seq": np.array([900, 900, 900, 901]), "batch_row": np.array([0, 0, 1, 0])}
    rows = {"step_seq": [900, 900, 900, 901, 905], "first_step_seq": [900, 900, 900, 901, 901],
            "step": [0, 2, 0, 0, 4], "batch_row": [0, 0, 1, 0, 0]}  # fmt: skip
    # row 0 of pass 900 has two tokens: forced; row 1 of 900 and pass 901 one each: generated first tokens
    assert _pass_tokens(rows, forced) == [True, True, False, False, False]
    builder = IncidentBuilder()
    marked = {
        **_rows([900, 901], [0, 0], ["loss_calibrated"] * 2, [4.0, 4.0], first=900),
        "pass_token": [True, False],
    }
    marked["first_step_seq"] = [900, 901]
    assert builder.add(marked, 1) == [None, "7-901-0"]


def test_a_commit_over_the_stores_memory_cap_is_run_again_with_headroom(tmp_path):
    # The agent's store caps DuckDB's memory (32MB), shared with the writer, correlate and the exporter:
    # an anomaly commit that found the cap full failed and its rows were lost (seen at 20k steps/s with
    # --otlp: "3 failed ... Out of Memory Error"). Here one commit needs more than a 16MB cap by itself
    # (a 24 MB trace id on its rows), which DuckDB refuses the same way; the lane runs it again with the
    # store's headroom, and nothing is lost.
    store = DuckDBStore(tmp_path / "s.duckdb", memory_limit="16MB", threads=1)
    live = LiveAnomalies(store, DetectorConfig(detector="both"))
    losses = np.random.default_rng(2).normal(2.0, 0.2, 60)
    losses[35] = 6.0
    steps = _steps(losses, 300)
    steps["trace_id"] = ["f" * 24_000_000] * len(losses)
    assert live.add(steps) == 2
    assert live.close()
    assert (live.counters.failed, live.counters.last_error) == (0, None)
    assert store.headroom_retries >= 1
    query = "SELECT step, kind, length(trace_id) FROM anomalies ORDER BY kind"  # reading them needs it too
    rows = store.with_headroom(lambda: store.connection.execute(query).fetchall())
    assert rows == [(35, "loss_mad", 24_000_000), (35, "loss_ttest", 24_000_000)]
    store.close()
