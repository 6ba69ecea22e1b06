"""What a map read brings is scored at once and handed on in bulk (pipeline/core.py HAND_STEPS): the
detectors see every read's steps as it comes (the spike-to-row latency), while the store's writer and
`top`'s live stats get them with the ring's events once a second, once HAND_STEPS are held, at close,
or at once when a token is flagged: the flagged step is submitted before its anomaly row is queued. A
real map (ShmWriter), a real Pipeline and DuckDB file, the real `mad` detector."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from llmobs import clock
from llmobs.diagnostics.detectors import DetectorConfig
from llmobs.pipeline import Pipeline, ShmSource, core
from llmobs.shm import layout
from llmobs.shm.writer import ShmWriter
from llmobs.store.sink import DuckDBStore

HAND_STEPS = 8


@pytest.fixture
def writer(tmp_path, monkeypatch):
    monkeypatch.setattr(core, "MAP_PERIOD_S", 0.0)  # every poll reads the map
    monkeypatch.setattr(core, "SLOW_PERIOD_S", 3600.0)  # one slow tick (the first poll's), no other
    monkeypatch.setattr(core, "HAND_STEPS", HAND_STEPS)
    w = ShmWriter(shm_dir=str(tmp_path), model_id="m1")
    yield w
    w.close()


class Request:
    """One request's tokens, published one forward pass each (begin_step, then its one row)."""

    def __init__(self, writer: ShmWriter):
        self.writer = writer
        self.tenant = writer.name(layout.NAME_TENANT, "acme")
        self.model = writer.name(layout.NAME_MODEL, "m1")
        self.tokens = 0

    def publish(self, *losses: float) -> None:
        for loss in losses:
            block = torch.zeros((1, 7), dtype=torch.float32)
            block[0, 0] = loss
            block[0, 4:] = torch.tensor([[0, 5, 5]], dtype=torch.int32).view(torch.float32)
            end = clock.monotonic_ns()
            self.writer.publish_steps(
                block, step_seq=self.writer.begin_step(1, 2, self.tenant, 0), t_start=end - 1000, t_end=end,
                trace_hi=[1], trace_lo=[2], tenant_hash=self.tenant, session_hash=0, model_hash=self.model,
                step=self.tokens, position=np.array([10 + self.tokens]), batch_row=np.array([0]), kv_len=-1,
                flags=layout.FLAG_HAS_TARGET,
            )  # fmt: skip
            self.tokens += 1


def _pipeline(tmp_path, writer: ShmWriter, detector: DetectorConfig = DetectorConfig()) -> Pipeline:  # noqa: B008
    pid = os.getpid()
    return Pipeline(DuckDBStore(tmp_path / "s.duckdb"), pid, owns_store=True, snapshot=False,
                    shm=ShmSource(pid, shm_dir=str(tmp_path)), detector=detector)  # fmt: skip


def test_a_read_is_scored_at_once_and_handed_on_once_enough_steps_are_held(tmp_path, writer):
    request = Request(writer)
    pipeline = _pipeline(tmp_path, writer)
    try:
        pipeline.poll()  # the first poll: the slow tick, nothing to hand
        request.publish(2.0, 2.1, 1.9)
        assert pipeline.poll() == 3
        assert pipeline.anomalies.detector.counters.steps == 3  # scored at the read
        assert pipeline.writer.counters.submitted_rows == 0 and pipeline.live.tokens == 0  # held
        request.publish(*[2.0] * (HAND_STEPS - 4))
        assert pipeline.poll() == HAND_STEPS - 4
        assert pipeline.writer.counters.submitted_rows == 0  # HAND_STEPS - 1 held
        request.publish(2.0)
        assert pipeline.poll() == 1
        assert pipeline.anomalies.detector.counters.steps == HAND_STEPS
        assert pipeline.writer.counters.submitted_rows == HAND_STEPS == pipeline.live.tokens  # all of them
        request.publish(2.2, 2.3)
        pipeline.poll()  # held again ...
    finally:
        summary = pipeline.close()  # ... and handed on at close: nothing read is lost
    assert summary.steps_read == HAND_STEPS + 2 == summary.rows_by_table["token_steps"]


def test_a_flagged_tokens_step_reaches_the_writer_before_its_anomaly_row(tmp_path, writer):
    request = Request(writer)
    pipeline = _pipeline(tmp_path, writer, DetectorConfig(detector="mad", window=8, min_history=4))
    committed = threading.Event()
    submitted_at_commit: list[int] = []

    def on_committed(rows: dict) -> None:  # the anomaly lane's thread, after the row's commit
        submitted_at_commit.append(pipeline.writer.counters.submitted_rows)
        committed.set()

    pipeline.anomalies.on_committed = on_committed
    try:
        pipeline.poll()
        request.publish(2.0, 2.1, 1.9, 2.0, 2.05)
        pipeline.poll()
        assert pipeline.writer.counters.submitted_rows == 0  # no flag: held
        request.publish(9.0)  # a spike the mad detector flags
        pipeline.poll()
        assert committed.wait(30), "the anomaly row was not committed"
    finally:
        summary = pipeline.close()
    assert pipeline.anomalies.counters.rows == 1
    assert submitted_at_commit == [6]  # the spike and every step held before it, before the row
    assert summary.rows_by_table["token_steps"] == 6
