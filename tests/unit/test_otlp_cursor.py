"""The export cursor and delivery loop on a real DuckDB file, with a scripted transport (the e2e tier
runs the same loop against a real collector): advances only on ack, resumes after a restart, survives
pid reuse, closes requests correctly across batches, counts failures and drops, stays bounded."""

from __future__ import annotations

import threading

import pytest
from llmobs import clock
from llmobs.otlp.config import resolve
from llmobs.otlp.delivery import ExportFailed, OtlpExporter
from llmobs.otlp.encoder import span_count
from llmobs.otlp.source import ExportCursor
from llmobs.otlp.transport import SendResult, Transport
from llmobs.store import synthetic
from llmobs.store.sink import DuckDBStore
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

PID = 31


class ScriptedTransport(Transport):
    """Answers from a script (then OK), and keeps every span id it acknowledged."""

    def __init__(self, script: list[SendResult] | None = None):
        self.script = list(script or [])
        self.attempts = 0
        self.acked: list[bytes] = []
        self.acked_requests: list[ExportTraceServiceRequest] = []
        self.metrics_requests = 0

    def send_traces(self, request):
        self.attempts += 1
        result = self.script.pop(0) if self.script else SendResult(ok=True)
        if result.ok:
            self.acked_requests.append(request)
            self.acked += [
                s.span_id for rs in request.resource_spans for sc in rs.scope_spans for s in sc.spans
            ]
        return result

    def send_metrics(self, request):
        self.metrics_requests += 1
        return SendResult(ok=True)


def config(**values):
    base = {"backoff_initial_s": 0.001, "backoff_max_s": 0.002, "batch_spans": 10, "settle_s": 0.0}
    return resolve({**base, **values}, env={})


def fill(store, pid=PID, requests=4, tokens=6, start_ns=1_000_000_000_000, seq_start=1, batch_rows=2):
    steps = synthetic.token_steps(
        pid, requests, tokens, batch_rows=batch_rows, start_ns=start_ns, step_seq_start=seq_start, seed=pid
    )
    store.append({"token_steps": steps})
    return steps


@pytest.fixture
def store(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb")
    yield store
    store.close()


def test_tables_are_created_idempotently(store):
    ExportCursor(store.connection)
    ExportCursor(store.connection)  # CREATE TABLE IF NOT EXISTS: a second open changes nothing
    tables = {
        r[0] for r in store.connection.execute("SELECT table_name FROM information_schema.tables").fetchall()
    }
    assert {"otlp_cursor", "otlp_requests", "otlp_state"} <= tables


def test_one_shot_exports_every_step_once_then_nothing(store):
    fill(store)
    transport = ScriptedTransport()
    counters = OtlpExporter(store.connection.cursor(), config(), transport).run()
    assert counters.spans_sent == 24 + 4 == len(set(transport.acked)) == len(transport.acked)
    assert counters.max_batch_spans <= 10 + 4  # batch_spans steps (+ the requests closed with them)
    again = ScriptedTransport()
    assert OtlpExporter(store.connection.cursor(), config(), again).run().spans_sent == 0
    assert again.attempts == 0
    assert transport.metrics_requests == 1


def test_cursor_moves_only_after_an_ack_and_failures_are_counted(store):
    fill(store, requests=1, tokens=4)
    fail = SendResult(ok=False, retryable=True, error="gRPC UNAVAILABLE: down")
    transport = ScriptedTransport([fail, fail, fail])
    exporter = OtlpExporter(store.connection.cursor(), config(), transport)
    counters = exporter.run()
    assert transport.attempts == 4 and counters.attempts_failed == 3 and counters.retries == 3
    assert counters.spans_failed == 3 * 5 and counters.spans_sent == 5 and counters.spans_dropped == 0
    assert exporter.status()["pending_steps"] == 0


def test_unreachable_collector_gives_up_and_keeps_the_rows(store):
    fill(store, requests=1, tokens=4)
    down = [SendResult(ok=False, retryable=True, error="down")] * 1000
    exporter = OtlpExporter(store.connection.cursor(), config(), ScriptedTransport(down))
    with pytest.raises(ExportFailed, match="4 token steps not exported"):
        exporter.run(give_up_after_s=0.05)
    assert ExportCursor(store.connection).pending_steps() == 4


def test_a_batch_whose_ack_was_lost_is_sent_again_with_the_same_ids(store):
    fill(store, requests=1, tokens=4)
    cursor = ExportCursor(store.connection.cursor())
    first = cursor.next_batch(limit=10, max_events_per_span=8, flush=True)
    # The agent dies after sending, before committing: a new exporter sends the same window again.
    transport = ScriptedTransport()
    OtlpExporter(store.connection.cursor(), config(), transport).run()
    assert len(transport.acked) == 5
    from llmobs.otlp.encoder import SpanIds

    ids = SpanIds()
    expected = {ids.step_span_id(s["pid"], s["trace_id"], s["step_seq"], s["batch_row"]) for s in first.steps}
    assert expected <= set(transport.acked)


def test_reused_pid_restarting_step_seq_is_still_exported(store):
    from llmobs.otlp.encoder import SpanIds

    fill(store, requests=2, tokens=5, start_ns=1_000_000_000_000, seq_start=1)
    transport = ScriptedTransport()
    OtlpExporter(store.connection.cursor(), config(), transport).run()
    # A new process got the same pid later: step_seq starts at 1 again, CLOCK_MONOTONIC is later.
    steps = fill(store, requests=1, tokens=3, start_ns=2_000_000_000_000, seq_start=1).to_pylist()
    later = ScriptedTransport()
    counters = OtlpExporter(store.connection.cursor(), config(), later).run()
    assert counters.spans_sent == 3 + 1
    # exactly the new process's spans (its 3 token steps and its request), each once, none of the old
    expected = {SpanIds.step_span_id(s["pid"], s["trace_id"], s["step_seq"], s["batch_row"]) for s in steps}
    expected |= {SpanIds.request_span_id(s["pid"], s["trace_id"]) for s in steps}
    assert sorted(later.acked) == sorted(expected)
    assert not set(later.acked) & set(transport.acked)


def test_late_rows_of_another_pid_are_not_skipped(store):
    """A pid whose rows reach the store after another pid's later rows is still exported in full."""
    fill(store, pid=1, requests=1, tokens=4, start_ns=2_000_000_000_000)
    OtlpExporter(store.connection.cursor(), config(), ScriptedTransport()).run()
    fill(store, pid=2, requests=1, tokens=4, start_ns=1_000_000_000_000)  # older times, arrived later
    assert OtlpExporter(store.connection.cursor(), config(), ScriptedTransport()).run().spans_sent == 5


def test_request_spans_wait_for_all_their_steps_across_batches(store):
    fill(store, requests=2, tokens=15, batch_rows=1)  # 30 steps, batches of 7
    transport = ScriptedTransport()
    OtlpExporter(store.connection.cursor(), config(batch_spans=7), transport).run()
    requests = [
        s
        for r in transport.acked_requests
        for rs in r.resource_spans
        for sc in rs.scope_spans
        for s in sc.spans
        if not s.parent_span_id
    ]
    assert len(requests) == 2
    for span in requests:
        attrs = {kv.key: kv.value for kv in span.attributes}
        assert attrs["gen_ai.usage.output_tokens"].int_value == 15


def test_follow_mode_holds_back_unsettled_steps_and_open_requests(store):
    now = clock.monotonic_ns()
    fill(store, requests=1, tokens=4, start_ns=now - 60_000_000_000, batch_rows=1)
    fill(store, pid=PID + 1, requests=1, tokens=4, start_ns=now - 5_000_000_000, batch_rows=1)  # too fresh
    transport = ScriptedTransport()
    exporter = OtlpExporter(store.connection.cursor(), config(settle_s=30.0, request_idle_s=10.0), transport)
    exporter.export_pending(follow=True)
    # The old steps and their (idle) request went out; the unsettled ones wait in the store.
    assert transport.acked and exporter.counters.spans_sent == 4 + 1
    assert exporter.cursor.pending_steps() == 4


def test_bad_data_is_dropped_and_counted_but_auth_errors_keep_the_rows(store):
    fill(store, requests=1, tokens=4)
    bad = SendResult(ok=False, retryable=False, error="gRPC INVALID_ARGUMENT: malformed")
    counters = OtlpExporter(store.connection.cursor(), config(), ScriptedTransport([bad])).run()
    assert counters.spans_dropped == 5 and counters.spans_sent == 0
    fill(store, requests=1, tokens=4, start_ns=3_000_000_000_000)
    auth = SendResult(ok=False, retryable=False, error="gRPC UNAUTHENTICATED: bad token")
    with pytest.raises(ExportFailed, match="refused"):
        OtlpExporter(store.connection.cursor(), config(), ScriptedTransport([auth])).run()
    assert ExportCursor(store.connection).pending_steps() == 4


def test_partial_success_rejections_are_dropped_not_retried(store):
    fill(store, requests=1, tokens=4)
    transport = ScriptedTransport([SendResult(ok=True, rejected=2, error="2 spans too large")])
    counters = OtlpExporter(store.connection.cursor(), config(), transport).run()
    assert counters.spans_sent == 3 and counters.spans_dropped == 2 and transport.attempts == 1


def test_background_follow_stops_promptly_during_backoff(store):
    fill(store, requests=1, tokens=4)
    down = [SendResult(ok=False, retryable=True, error="down")] * 10_000
    exporter = OtlpExporter(
        store.connection.cursor(), config(backoff_initial_s=60, backoff_max_s=60), ScriptedTransport(down)
    )
    thread = exporter.start()
    first_failure = threading.Event()
    for _ in range(500):
        if exporter.counters.attempts_failed:
            first_failure.set()
            break
        thread.join(0.01)
    assert first_failure.is_set()
    exporter.shutdown(timeout=10)  # in a 60 s backoff wait: shutdown must cut it short
    assert not thread.is_alive()


def test_memory_bound_is_one_batch_whatever_the_backlog(store):
    fill(store, requests=50, tokens=40, batch_rows=5)  # 2,000 steps waiting
    transport = ScriptedTransport()
    counters = OtlpExporter(store.connection.cursor(), config(batch_spans=64), transport).run()
    assert counters.spans_sent == 2000 + 50
    assert max(span_count(r) for r in transport.acked_requests) <= 64 + 50
    assert counters.max_batch_spans <= 64 + 50


def test_random_trace_ids_are_stable_across_exporter_restarts(store):
    fill(store, requests=1, tokens=2)
    first, second = ScriptedTransport(), ScriptedTransport()
    OtlpExporter(store.connection.cursor(), config(trace_id_mode="random"), first).run()
    store.connection.execute("DELETE FROM otlp_cursor; DELETE FROM otlp_requests")  # export again
    OtlpExporter(store.connection.cursor(), config(trace_id_mode="random"), second).run()

    def trace_ids(transport):
        return {
            s.trace_id
            for r in transport.acked_requests
            for rs in r.resource_spans
            for sc in rs.scope_spans
            for s in sc.spans
        }

    steps = store.query("SELECT DISTINCT trace_id FROM token_steps")["trace_id"].to_pylist()
    assert trace_ids(first) == trace_ids(second)  # the salt is kept in otlp_state
    assert trace_ids(first).isdisjoint({bytes.fromhex(t) for t in steps})  # not the prompt-hash id


class MetricsKeeper(ScriptedTransport):
    def send_metrics(self, request):
        self.last_metrics = {m.name: m for m in request.resource_metrics[0].scope_metrics[0].metrics}
        return SendResult(ok=True)


def test_trace_sampling_sends_the_kernels_traces_and_metrics_still_count_everything(store):
    from llmobs.bpf.records import trace_kept

    steps = fill(store, requests=40, tokens=3, batch_rows=1)
    transport = MetricsKeeper()
    counters = OtlpExporter(store.connection.cursor(), config(sample_n=4), transport).run()
    traces = set(steps["trace_id"].to_pylist())
    kept = {t for t in traces if trace_kept(int(t[:16], 16), int(t[16:], 16), 4)}
    assert 0 < len(kept) < len(traces)  # the hash keeps some, not all
    sent = {s.trace_id.hex() for r in transport.acked_requests for rs in r.resource_spans
            for sc in rs.scope_spans for s in sc.spans}  # fmt: skip
    assert sent == kept
    assert counters.spans_sent == 4 * len(kept) and counters.spans_sampled_out == 4 * (
        len(traces) - len(kept)
    )
    tokens = transport.last_metrics["llmobs.tokens"].sum.data_points
    assert sum(p.as_int for p in tokens) == 120  # metrics see every token, sampled out or not
    exemplar_traces = {e.trace_id.hex() for p in tokens for e in p.exemplars}
    assert exemplar_traces <= kept  # exemplars only link to spans that were sent
    assert ExportCursor(store.connection).pending_steps() == 0


def test_per_pass_metrics_count_a_pass_once_when_its_rows_straddle_batches(store):
    from llmobs.pipeline import correlate

    fill(store, requests=4, tokens=5, batch_rows=2)  # 10 forward passes of 2 rows
    correlate.correlate(store.connection)
    transport = MetricsKeeper()
    OtlpExporter(store.connection.cursor(), config(batch_spans=3), transport).run()  # odd: passes split
    allocations = transport.last_metrics["llmobs.step.allocations"].histogram.data_points[0]
    assert allocations.count == 10
