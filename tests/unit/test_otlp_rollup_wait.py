"""A followed export waits for correlation: a token step whose forward pass has no rollup yet is not
sent until correlate has rolled it up (so its span carries the pass's llmobs.step.* attributes), at
most `rollup_wait_s`; steps without a pass (step_seq 0) and older steps never wait, and a final flush
(not following) sends everything. On a real DuckDB file, with the real correlate and a transport that
keeps what it acknowledged."""

from __future__ import annotations

import threading

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from llmobs import clock
from llmobs.otlp.config import OtlpConfigError, resolve
from llmobs.otlp.delivery import OtlpExporter
from llmobs.otlp.transport import SendResult, Transport
from llmobs.pipeline.correlate import correlate
from llmobs.store import synthetic
from llmobs.store.sink import DuckDBStore

PID = 41
ROLLUP_ATTRIBUTE = "llmobs.step.allocations"


class KeepingTransport(Transport):
    """Acknowledges every request and keeps each token-step span's attribute keys, by step_seq."""

    def __init__(self):
        self.steps: list[tuple[int, set[str]]] = []

    def send_traces(self, request):
        for rs in request.resource_spans:
            for scope in rs.scope_spans:
                for span in scope.spans:
                    keys = {a.key for a in span.attributes}
                    if "llmobs.step_seq" in keys:
                        seq = next(a.value.int_value for a in span.attributes if a.key == "llmobs.step_seq")
                        self.steps.append((seq, keys))
        return SendResult(ok=True)

    def send_metrics(self, request):
        return SendResult(ok=True)


@pytest.fixture
def store(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb")
    yield store
    store.close()


def _steps(age_s: float, requests: int = 3, tokens: int = 4, seq_start: int = 1) -> pa.Table:
    """Token steps of PID that started `age_s` ago (each pass 20 ms after the last), with their events."""
    start = clock.monotonic_ns() - int(age_s * 1e9)
    return synthetic.token_steps(PID, requests, tokens, start_ns=start, step_seq_start=seq_start, seed=PID)


def _exporter(store, **values) -> tuple[OtlpExporter, KeepingTransport]:
    transport = KeepingTransport()
    config = resolve({"settle_s": 0.0, "batch_spans": 64, **values}, env={})
    return OtlpExporter(store.connection.cursor(), config, transport), transport


def test_a_young_step_waits_for_its_rollup_and_then_goes_with_it(store):
    steps = _steps(age_s=3.0)
    store.append({"token_steps": steps, "events": synthetic.events_for_steps(steps)})
    exporter, transport = _exporter(store)
    assert exporter.export_pending(follow=True) == 0  # no rollup yet: every step waits
    assert transport.steps == []
    correlate(store.connection, since_ns=0, pid=PID)
    sent = exporter.export_pending(follow=True)
    assert sent >= steps.num_rows  # every step span (and the closed requests' spans, if any)
    assert sorted(seq for seq, _ in transport.steps) == sorted(steps.column("step_seq").to_pylist())
    assert all(ROLLUP_ATTRIBUTE in keys for _, keys in transport.steps)


def test_steps_wait_from_the_first_unrolled_one_on_in_ingest_order(store):
    first = _steps(age_s=6.0, requests=2, tokens=3)
    store.append({"token_steps": first, "events": synthetic.events_for_steps(first)})
    correlate(store.connection, since_ns=0, pid=PID)  # the first passes are rolled up
    later = _steps(age_s=3.0, requests=2, tokens=3, seq_start=100)
    store.append({"token_steps": later, "events": synthetic.events_for_steps(later)})
    exporter, transport = _exporter(store)
    exporter.export_pending(follow=True)
    assert sorted(seq for seq, _ in transport.steps) == sorted(first.column("step_seq").to_pylist())
    correlate(store.connection, since_ns=0, pid=PID)
    exporter.export_pending(follow=True)
    expected = first.column("step_seq").to_pylist() + later.column("step_seq").to_pylist()
    assert sorted(seq for seq, _ in transport.steps) == sorted(expected)  # each once, none lost
    assert all(ROLLUP_ATTRIBUTE in keys for _, keys in transport.steps)


def test_a_step_older_than_the_wait_goes_without_its_rollup(store):
    steps = _steps(age_s=5.0)
    store.append({"token_steps": steps})
    exporter, transport = _exporter(store, rollup_wait_s=2.0)  # correlation behind by more than that
    exporter.export_pending(follow=True)
    assert len(transport.steps) == steps.num_rows
    assert not any(ROLLUP_ATTRIBUTE in keys for _, keys in transport.steps)


def test_a_step_without_a_pass_never_waits(store):
    steps = _steps(age_s=3.0)
    untagged = steps.set_column(
        steps.schema.get_field_index("step_seq"), "step_seq", pc.multiply(steps.column("step_seq"), 0)
    )
    store.append({"token_steps": untagged})
    exporter, transport = _exporter(store)
    exporter.export_pending(follow=True)
    assert exporter.counters.spans_sent >= steps.num_rows  # step_seq 0: no rollup will ever come


def test_the_final_flush_does_not_wait(store):
    steps = _steps(age_s=3.0)
    store.append({"token_steps": steps})
    exporter, transport = _exporter(store)
    exporter.export_pending(follow=False)  # attach's close: after the final correlate, or without one
    assert len(transport.steps) == steps.num_rows


def test_a_negative_wait_is_refused():
    with pytest.raises(OtlpConfigError, match="rollup_wait_s"):
        resolve({"rollup_wait_s": -1.0}, env={})


class SignallingTransport(KeepingTransport):
    """KeepingTransport that also sets `arrived` once a token-step span has come."""

    def __init__(self):
        super().__init__()
        self.arrived = threading.Event()

    def send_traces(self, request):
        result = super().send_traces(request)
        if self.steps:
            self.arrived.set()
        return result


def test_a_held_follower_sleeps_until_the_stores_correlate_commit_wakes_it(store):
    """A follow round held back for rollups sleeps until the store's next correlate commit, not until
    the held steps would go without their rollup (rollup_wait_s: 120 s here, far past this test's
    waits), and its sleep still ends at once on shutdown."""
    steps = _steps(age_s=3.0)
    store.append({"token_steps": steps, "events": synthetic.events_for_steps(steps)})
    transport = SignallingTransport()
    config = resolve({"settle_s": 0.0, "batch_spans": 64, "rollup_wait_s": 120.0}, env={})
    exporter = OtlpExporter(store.cursor(), config, transport)
    exporter.follow_rollups(store)
    exporter.start()
    try:
        deadline = clock.monotonic_ns() + 30_000_000_000
        while exporter.cursor.held_for_ns == 0:  # a round has read the steps and held them
            assert clock.monotonic_ns() < deadline, "the exporter never held the young steps"
            threading.Event().wait(0.05)
        assert exporter.cursor.held_for_ns > 100_000_000_000 and transport.steps == []
        correlate(store.connection, since_ns=0, pid=PID)
        store.rollups_committed()  # what the pipeline calls after its correlate commit
        assert transport.arrived.wait(30), "the commit did not wake the held exporter"
    finally:
        exporter.shutdown(timeout=10)
    assert not exporter._thread.is_alive()
    assert all(ROLLUP_ATTRIBUTE in keys for _, keys in transport.steps)


def test_the_pipelines_correlate_commit_wakes_the_stores_rollup_followers(tmp_path, store):
    """What wakes the exporter in `attach --otlp`: the pipeline's incremental correlate, once it has
    committed rollups of steps it read from a real map, calls the store's followers."""
    from llmobs.pipeline import Pipeline, ShmSource

    from tests.unit.served_runs import ServedRuns

    served = ServedRuns(tmp_path / "shm")
    woken = threading.Event()
    store.follow_rollups(woken.set)
    pipeline = Pipeline(store, served.writer.pid, shm=ShmSource(served.writer.pid, shm_dir=served.shm_dir),
                        detector=None, snapshot=False, correlate_every_s=0.05)  # fmt: skip
    try:
        served.arrive("a", [5, 6, 7], "acme")
        served.step(["a"])
        pipeline.poll()  # the steps go to the writer; the correlate thread rolls them up once committed
        deadline = clock.monotonic_ns() + 30_000_000_000
        rolled = 0
        while not rolled:  # each wake-up follows a commit; the first may precede the writer's
            assert woken.wait(max(deadline - clock.monotonic_ns(), 0) / 1e9), "no commit woke the follower"
            woken.clear()
            rolled = store.connection.execute("SELECT count(*) FROM step_rollups").fetchall()[0][0]
        assert rolled == 1
    finally:
        pipeline.close()
        served.close()
