"""Correlation is paced by who waits for it (pipeline/core.py CORRELATE_UNAWAITED_S): while no OTLP
exporter follows the store's rollups and no anomaly was flagged lately, a due correlate run is put off
(counted) until CORRELATE_UNAWAITED_S after the last one, unless PUT_OFF_MAX_STEPS steps wait for it;
an exporter keeps every run, and a newly flagged anomaly is owed two runs (its evidence). A real
Pipeline on a real map and DuckDB file."""

from __future__ import annotations

import pytest
from llmobs import clock
from llmobs.pipeline import Pipeline, ShmSource, core
from llmobs.store.sink import DuckDBStore

from tests.unit.served_runs import ServedRuns

EVERY_S = 0.05


@pytest.fixture
def served(tmp_path, monkeypatch):
    monkeypatch.setattr(core, "CORRELATE_CPU_SHARE", 1.0)  # no stretching: the thread wakes every EVERY_S
    runs = ServedRuns(tmp_path / "shm")
    yield runs
    runs.close()


def _pipeline(served, store, **kwargs) -> Pipeline:
    pid = served.writer.pid
    return Pipeline(store, pid, shm=ShmSource(pid, shm_dir=served.shm_dir), snapshot=False,
                    correlate_every_s=EVERY_S, **kwargs)  # fmt: skip


def _step_until(served, pipeline, condition, timeout_s: float = 30.0) -> None:
    """Publishes a token step and polls the pipeline until `condition()` (steps keep arriving, so the
    correlate thread is never idle)."""
    deadline = clock.monotonic_ns() + int(timeout_s * 1e9)
    while not condition():
        assert clock.monotonic_ns() < deadline, "condition not met"
        served.step(["a"])
        pipeline.poll()
        pipeline.writer.flush(10)


def test_runs_nobody_waits_for_are_put_off(tmp_path, served):
    with DuckDBStore(tmp_path / "s.duckdb") as store:
        pipeline = _pipeline(served, store, detector=None)
        try:
            served.arrive("a", [5, 6, 7], "acme")
            _step_until(served, pipeline, lambda: pipeline.correlate_put_off >= 3)
            assert pipeline.correlate_runs == 1  # the first run; then nothing waits for 60 s
        finally:
            pipeline.close()
        # the run at close rolls up every pass, those of the put-off runs included
        assert store.count("step_rollups") == store.count("token_steps") > 3


def test_an_exporter_following_the_rollups_keeps_every_run(tmp_path, served):
    with DuckDBStore(tmp_path / "s.duckdb") as store:
        store.follow_rollups(lambda: None)
        pipeline = _pipeline(served, store, detector=None)
        try:
            served.arrive("a", [5, 6, 7], "acme")
            _step_until(served, pipeline, lambda: pipeline.correlate_runs >= 3)
            assert pipeline.correlate_put_off == 0
        finally:
            pipeline.close()


def test_a_flagged_anomaly_is_owed_two_runs(tmp_path, served):
    with DuckDBStore(tmp_path / "s.duckdb") as store:
        pipeline = _pipeline(served, store)  # the live detectors on
        try:
            served.arrive("a", [5, 6, 7], "acme")
            _step_until(served, pipeline, lambda: pipeline.correlate_put_off >= 1)
            runs = pipeline.correlate_runs
            pipeline.anomalies.counters.rows += 1  # what the lane counts when a detector flags a row
            put_off = pipeline.correlate_put_off
            _step_until(served, pipeline, lambda: pipeline.correlate_put_off > put_off)
            assert pipeline.correlate_runs == runs + 2
        finally:
            pipeline.close()


def test_a_busy_target_is_not_put_off(tmp_path, served, monkeypatch):
    monkeypatch.setattr(core, "PUT_OFF_MAX_STEPS", 5)  # a busy target: steps enough wait for each run
    with DuckDBStore(tmp_path / "s.duckdb") as store:
        pipeline = _pipeline(served, store, detector=None)
        try:
            served.arrive("a", [5, 6, 7], "acme")
            _step_until(served, pipeline, lambda: pipeline.correlate_runs >= 3)
            assert pipeline.correlate_put_off < 5 * pipeline.correlate_runs  # each run after <= 5 steps
        finally:
            pipeline.close()
