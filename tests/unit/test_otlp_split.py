"""Trace requests cut under a byte limit (llmobs.otlp.split), and the delivery loop over them: every span
exactly once under its own resource and scope, each request within the limit, a collector's "too large"
answer halved down to one span and never retried forever, only unacked requests resent."""

from __future__ import annotations

import http.server
import threading

import numpy as np
import pytest
from llmobs.otlp.config import MIN_MAX_REQUEST_BYTES, OtlpConfigError, resolve
from llmobs.otlp.delivery import OtlpExporter
from llmobs.otlp.encoder import EncodedTraces
from llmobs.otlp.source import ExportCursor
from llmobs.otlp.split import halve, split_request
from llmobs.otlp.transport import TOO_LARGE_DETAIL, HttpTransport, SendResult
from llmobs.store.sink import DuckDBStore
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from tests.unit.test_otlp_cursor import ScriptedTransport, config, fill


def synthetic_request(seed: int = 0) -> ExportTraceServiceRequest:
    """3 resources x 2 scopes (with schema urls), spans of 0-40 events of mixed sizes."""
    rng = np.random.default_rng(seed)
    request = ExportTraceServiceRequest()
    span_no = 0
    for r in range(3):
        resource_spans = request.resource_spans.add(schema_url=f"https://schema/r{r}")
        resource_spans.resource.attributes.add(key="process.pid").value.int_value = 100 + r
        for s in range(2):
            scope_spans = resource_spans.scope_spans.add(schema_url=f"https://schema/r{r}s{s}")
            scope_spans.scope.name = f"scope-{r}-{s}"
            for _ in range(int(rng.integers(5, 15))):
                span_no += 1
                span = scope_spans.spans.add(name="gen_ai.token_step", trace_id=bytes(15) + b"\x01")
                span.span_id = span_no.to_bytes(8, "big")
                span.attributes.add(key="llmobs.token.step").value.int_value = span_no
                for e in range(int(rng.integers(0, 40))):
                    event = span.events.add(time_unix_nano=e + 1, name="alloc_cpu")
                    event.attributes.add(key="llmobs.kernel.name").value.string_value = "k" * int(
                        rng.integers(10, 400)
                    )
                span.dropped_events_count = int(rng.integers(0, 3))
                span.status.code = 1  # a field numbered above the events: kept after them
    return request


def encoded(message: ExportTraceServiceRequest) -> EncodedTraces:
    return EncodedTraces(message.SerializeToString(), span_total(message))


def span_total(message) -> int:
    return sum(len(ss.spans) for rs in message.resource_spans for ss in rs.scope_spans)


def placed_spans(message) -> list[tuple[bytes, bytes, bytes, Span]]:
    """(span id, resource bytes, scope bytes, span) in order; resource/scope with their schema urls."""
    out = []
    for rs in message.resource_spans:
        resource = rs.resource.SerializeToString() + rs.schema_url.encode()
        for ss in rs.scope_spans:
            scope = ss.scope.SerializeToString() + ss.schema_url.encode()
            out.extend((span.span_id, resource, scope, span) for span in ss.spans)
    return out


def reference_partition(message: ExportTraceServiceRequest, limit: int) -> list[list[bytes]]:
    """The greedy partition computed with the generated classes' own ByteSize (slow, exact)."""
    parts: list[list[bytes]] = []
    current = ExportTraceServiceRequest()
    ids: list[bytes] = []
    for rs in message.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                trial = ExportTraceServiceRequest()
                trial.CopyFrom(current)
                _add(trial, rs, ss, span)
                if ids and trial.ByteSize() > limit:
                    parts.append(ids)
                    current, ids = ExportTraceServiceRequest(), []
                    _add(current, rs, ss, span)
                else:
                    current = trial
                ids.append(span.span_id)
    parts.append(ids)
    return parts


def _add(request, rs: ResourceSpans, ss: ScopeSpans, span: Span) -> None:
    last = request.resource_spans[-1] if request.resource_spans else None
    if last is None or last.resource != rs.resource or last.schema_url != rs.schema_url:
        last = request.resource_spans.add(schema_url=rs.schema_url)
        last.resource.CopyFrom(rs.resource)
    scope = last.scope_spans[-1] if last.scope_spans else None
    if scope is None or scope.scope != ss.scope or scope.schema_url != ss.schema_url:
        scope = last.scope_spans.add(schema_url=ss.schema_url)
        scope.scope.CopyFrom(ss.scope)
    scope.spans.add().CopyFrom(span)


@pytest.mark.parametrize("divisor", [2, 5, 17])
def test_split_keeps_every_span_once_grouped_and_each_request_under_the_limit(divisor):
    message = synthetic_request(seed=divisor)
    limit = message.ByteSize() // divisor
    split = split_request(encoded(message), limit)
    assert split.events_truncated == 0 and len(split.requests) >= divisor
    parts = []
    for request in split.requests:
        parsed = ExportTraceServiceRequest.FromString(request.SerializeToString())
        assert request.ByteSize() == parsed.ByteSize() <= limit
        assert request.spans == span_total(parsed)
        parts.append(placed_spans(parsed))
    # Every span exactly once, in order, byte for byte, under its own resource and scope.
    assert [p for part in parts for p in part] == placed_spans(message)
    # The packing is the tightest greedy one: the sizes are counted exactly, length prefixes included.
    assert [[p[0] for p in part] for part in parts] == reference_partition(message, limit)


def test_a_request_under_the_limit_is_sent_as_it_is():
    request = encoded(synthetic_request())
    split = split_request(request, request.ByteSize())
    assert split.requests == [request] and split.events_truncated == 0


def test_a_span_too_large_alone_keeps_its_first_events_and_counts_the_rest():
    message = ExportTraceServiceRequest()
    scope_spans = message.resource_spans.add().scope_spans.add()
    small = scope_spans.spans.add(name="small", span_id=b"\x01" * 8)
    big = scope_spans.spans.add(name="big", span_id=b"\x02" * 8, dropped_events_count=7)
    for e in range(600):
        big.events.add(time_unix_nano=e + 1, name="cupti_kernel").attributes.add(
            key="llmobs.kernel.name"
        ).value.string_value = "void flash_fwd_kernel<" + "T" * 200 + ">"
    big.status.code = 2
    assert message.ByteSize() > 2 * MIN_MAX_REQUEST_BYTES
    split = split_request(encoded(message), MIN_MAX_REQUEST_BYTES)
    assert [r.spans for r in split.requests] == [1, 1]
    assert all(r.ByteSize() <= MIN_MAX_REQUEST_BYTES for r in split.requests)
    first, second = (ExportTraceServiceRequest.FromString(r.SerializeToString()) for r in split.requests)
    assert first.resource_spans[0].scope_spans[0].spans[0] == small
    cut = second.resource_spans[0].scope_spans[0].spans[0]
    kept = len(cut.events)
    assert 0 < kept < 600 and list(cut.events) == list(big.events)[:kept]
    assert split.events_truncated == 600 - kept and split.spans_truncated == 1
    assert cut.dropped_events_count == 7 + 600 - kept
    assert cut.status.code == 2 and cut.name == "big" and cut.span_id == big.span_id
    # As many events as fit: one more would not.
    cut.events.add().CopyFrom(big.events[kept])
    cut.dropped_events_count -= 1
    assert second.ByteSize() > MIN_MAX_REQUEST_BYTES


def test_halve_gives_two_smaller_requests_with_every_span_once():
    message = synthetic_request(seed=4)
    first, second = halve(encoded(message))
    assert first.ByteSize() < message.ByteSize() and second.ByteSize() < message.ByteSize()
    halves = [ExportTraceServiceRequest.FromString(r.SerializeToString()) for r in (first, second)]
    assert placed_spans(halves[0]) + placed_spans(halves[1]) == placed_spans(message)
    assert abs(first.ByteSize() - second.ByteSize()) < message.ByteSize() / 2
    one = split_request(encoded(message), 1).requests[0]
    with pytest.raises(ValueError):
        halve(one)


def test_too_large_wording_is_recognised_and_throttling_is_not():
    rotel = "Error, decoded message length too large: found 4819210 bytes, the limit is: 4194304 bytes"
    grpc_go = "grpc: received message larger than max (14680064 vs. 4194304)"
    client = "Sent message larger than max (70000000 vs. 67108864)"
    assert all(TOO_LARGE_DETAIL.search(m) for m in (rotel, grpc_go, client))
    assert not TOO_LARGE_DETAIL.search("rate limit exceeded, retry later")


def test_http_413_is_too_large_not_bad_data():
    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's interface
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(413)
            self.end_headers()
            self.wfile.write(b"request entity too large")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        transport = HttpTransport(resolve({"endpoint": endpoint, "protocol": "http/protobuf"}, env={}))
        result = transport.send_traces(encoded(synthetic_request()))
        transport.close()
    finally:
        server.shutdown()
        server.server_close()
    assert not result.ok and result.too_large and not result.retryable and "HTTP 413" in result.error


def test_max_request_bytes_is_a_setting_with_a_floor():
    assert resolve({}, env={}).max_request_bytes == 3_670_016
    assert resolve({}, env={}, file_values={"max_request_bytes": 100_000}).max_request_bytes == 100_000
    with pytest.raises(OtlpConfigError, match="max_request_bytes 1000 is below the minimum"):
        resolve({"max_request_bytes": 1000}, env={})


# -- delivery ----------------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb")
    yield store
    store.close()


class SizeLimitedTransport(ScriptedTransport):
    """A collector refusing requests over `limit` bytes as too large (rotel's answer); else the script."""

    def __init__(self, limit: int, script=None):
        super().__init__(script)
        self.limit = limit
        self.sizes: list[int] = []

    def send_traces(self, request):
        self.sizes.append(request.ByteSize())
        if request.ByteSize() > self.limit:
            self.attempts += 1
            return SendResult(
                ok=False, too_large=True, error="gRPC OUT_OF_RANGE: decoded message length too large"
            )
        return super().send_traces(request)


def test_a_batch_over_the_limit_goes_as_several_requests_each_acked_once(store):
    fill(store, requests=20, tokens=30, batch_rows=4)  # 600 steps + 20 request spans
    transport = ScriptedTransport()
    exporter = OtlpExporter(
        store.connection.cursor(), config(batch_spans=600, max_request_bytes=MIN_MAX_REQUEST_BYTES), transport
    )
    counters = exporter.run()
    assert counters.spans_sent == 620 == len(transport.acked) == len(set(transport.acked))
    assert counters.max_batch_bytes > 3 * MIN_MAX_REQUEST_BYTES  # the batch did need cutting
    sizes = [r.ByteSize() for r in transport.acked_requests]
    assert counters.requests_sent == len(sizes) >= -(-counters.max_batch_bytes // MIN_MAX_REQUEST_BYTES)
    assert counters.batches_sent == 2  # the steps, then the requests they closed (one-shot flush)
    assert counters.max_request_bytes == max(sizes) <= MIN_MAX_REQUEST_BYTES
    assert counters.attempts_failed == 0 and exporter.status()["pending_steps"] == 0


def test_a_retry_resends_only_the_requests_not_acked(store):
    fill(store, requests=20, tokens=30, batch_rows=4)
    down = SendResult(ok=False, retryable=True, error="gRPC UNAVAILABLE: down")
    transport = ScriptedTransport([SendResult(ok=True), down, down])
    exporter = OtlpExporter(
        store.connection.cursor(), config(batch_spans=600, max_request_bytes=MIN_MAX_REQUEST_BYTES), transport
    )
    counters = exporter.run()
    assert len(transport.acked) == len(set(transport.acked)) == counters.spans_sent == 620
    assert transport.attempts == counters.requests_sent + 2 and counters.retries == 2


def test_too_large_answers_are_halved_until_they_pass(store):
    fill(store, requests=20, tokens=30, batch_rows=4)
    collector_limit = 30_000  # a collector accepting less than the exporter's limit
    transport = SizeLimitedTransport(collector_limit)
    exporter = OtlpExporter(
        store.connection.cursor(), config(batch_spans=600, max_request_bytes=MIN_MAX_REQUEST_BYTES), transport
    )
    counters = exporter.run()
    assert counters.spans_sent == 620 == len(transport.acked) == len(set(transport.acked))
    assert counters.spans_dropped == 0 and counters.requests_too_large == counters.attempts_failed > 0
    assert counters.max_request_bytes <= collector_limit and counters.retries == 0
    assert exporter.status()["pending_steps"] == 0


def test_a_single_span_still_too_large_is_dropped_counted_and_the_export_moves_on(store):
    fill(store, requests=2, tokens=5)  # 10 steps + 2 request spans, in one batch of 10 + 2
    transport = SizeLimitedTransport(limit=10)  # refuses every request, however small
    exporter = OtlpExporter(store.connection.cursor(), config(batch_spans=10), transport)
    counters = exporter.run()
    spans = 12
    # Halved down to one span per request (a binary tree over a batch of n spans: 2n - 1 requests),
    # each single span dropped: the export finishes instead of retrying forever.
    assert transport.attempts == 2 * spans - counters.batches_sent
    assert transport.attempts == counters.attempts_failed == counters.requests_too_large
    assert counters.spans_dropped == spans and counters.spans_sent == 0 and transport.acked == []
    assert "refused it as too large" in counters.last_error
    assert ExportCursor(store.connection).pending_steps() == 0
