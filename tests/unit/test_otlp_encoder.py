"""Store rows -> OTLP protobuf: ids, parent/child structure, attributes, events and their cap, metrics."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from llmobs.otlp.encoder import STEP_SPAN_NAME, SpanIds, TraceEncoder, span_count
from llmobs.otlp.metrics import LOSS_BOUNDS, MetricsAggregator, kernel_class
from llmobs.otlp.source import ExportCursor
from llmobs.pipeline import correlate
from llmobs.store import synthetic
from llmobs.store.sink import DuckDBStore
from opentelemetry.proto.trace.v1.trace_pb2 import Span

PID = 777


@pytest.fixture
def store(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb")
    steps = synthetic.token_steps(PID, 3, 4, batch_rows=3, seed=3)
    loss = steps["loss"].to_numpy(zero_copy_only=False).copy()
    loss[0] = np.nan  # a token without a target
    steps = steps.set_column(steps.schema.get_field_index("loss"), "loss", pa.array(loss, pa.float32()))
    store.append({"token_steps": steps, "events": synthetic.events_for_steps(steps)})
    correlate.correlate(store.connection)
    yield store
    store.close()


def batch_of(store, **kwargs):
    cursor = ExportCursor(store.connection.cursor())
    return cursor.next_batch(
        limit=100, max_events_per_span=kwargs.pop("max_events", 64), flush=True, **kwargs
    )


def spans_of(request) -> list[Span]:
    return [s for rs in request.resource_spans for scope in rs.scope_spans for s in scope.spans]


def test_ids_are_deterministic_and_never_zero():
    ids = SpanIds("prompt")
    trace = "00112233445566778899aabbccddeeff"
    assert ids.trace_id(1, trace) == bytes.fromhex(trace)
    assert ids.step_span_id(1, trace, 5, 0) == SpanIds().step_span_id(1, trace, 5, 0)
    assert ids.step_span_id(1, trace, 5, 0) != ids.step_span_id(1, trace, 5, 1)
    assert ids.step_span_id(1, trace, 5, 0) != ids.step_span_id(2, trace, 5, 0)  # pid is part of the key
    assert len(ids.request_span_id(1, trace)) == 8 and any(ids.request_span_id(1, trace))
    # An untracked/invalid trace id still gets a valid (hashed) 16-byte id.
    for bad in ("", "0" * 32, "zz" * 16):
        value = ids.trace_id(1, bad)
        assert len(value) == 16 and any(value)


def test_random_mode_is_stable_per_salt_and_unlinkable_across_salts():
    trace = "00112233445566778899aabbccddeeff"
    a1, a2, b = SpanIds("random", b"salt-a"), SpanIds("random", b"salt-a"), SpanIds("random", b"salt-b")
    assert a1.trace_id(1, trace) == a2.trace_id(1, trace)
    assert a1.trace_id(1, trace) != bytes.fromhex(trace)
    assert a1.trace_id(1, trace) != b.trace_id(1, trace)
    with pytest.raises(ValueError):
        SpanIds("sequential")


def test_request_and_step_spans_with_attributes(store):
    batch = batch_of(store)
    assert len(batch.steps) == 12 and len(batch.requests) == 3
    request = TraceEncoder(SpanIds(), wall_offset_ns=10**18, host_name="node-1").encode(batch)
    assert span_count(request) == 15
    resource = {kv.key: kv.value for kv in request.resource_spans[0].resource.attributes}
    assert resource["process.pid"].int_value == PID and resource["host.name"].string_value == "node-1"
    spans = spans_of(request)
    by_id = {s.span_id: s for s in spans}
    requests = [s for s in spans if not s.parent_span_id]
    steps = [s for s in spans if s.parent_span_id]
    assert len(requests) == 3 and len(steps) == 12
    rows = {(r["trace_id"], r["step"]): r for r in batch.steps}
    for span in steps:
        parent = by_id[span.parent_span_id]
        assert parent in requests and parent.trace_id == span.trace_id
        attrs = {kv.key: kv.value for kv in span.attributes}
        row = rows[(span.trace_id.hex(), attrs["llmobs.token.step"].int_value)]
        assert span.name == STEP_SPAN_NAME
        assert span.start_time_unix_nano == row["t_start_ns"] + 10**18
        assert span.end_time_unix_nano - span.start_time_unix_nano == row["latency_ns"]
        assert attrs["gen_ai.operation.name"].string_value == "text_completion"
        assert attrs["llmobs.tenant"].string_value == row["tenant"]
        if math.isnan(row["loss"]):
            assert "llmobs.token.loss" not in attrs  # NaN (no target) is left out, not sent as NaN
        else:
            assert attrs["llmobs.token.loss"].double_value == pytest.approx(row["loss"])
        assert attrs["llmobs.step.tokens"].int_value == 3  # three batch rows share each forward pass
    for span in requests:
        attrs = {kv.key: kv.value for kv in span.attributes}
        assert span.name == "text_completion smollm2-135m"
        assert attrs["gen_ai.usage.output_tokens"].int_value == 4
        assert attrs["llmobs.prompt_hash"].string_value == span.trace_id.hex()
        children = [s for s in steps if s.parent_span_id == span.span_id]
        assert span.start_time_unix_nano == min(c.start_time_unix_nano for c in children)
        assert span.end_time_unix_nano == max(c.end_time_unix_nano for c in children)


def test_events_go_on_one_span_per_pass_capped_with_the_rest_counted(store):
    per_pass = sum(p.count for p in synthetic.DEFAULT_PROBES)  # 18 events per forward pass
    batch = batch_of(store, max_events=5)
    spans = spans_of(TraceEncoder(SpanIds(), 0).encode(batch))
    with_events = [s for s in spans if s.events]
    assert len(with_events) == 4  # one per forward pass (3 rows share each)
    for span in with_events:
        assert len(span.events) == 5 and span.dropped_events_count == per_pass - 5
        attrs = {kv.key: kv.value for kv in span.attributes}
        assert attrs["llmobs.batch_row"].int_value == 0  # the event's own trace: the first row's
        for event in span.events:
            eattrs = {kv.key: kv.value for kv in event.attributes}
            assert eattrs["llmobs.sample_ratio"].int_value == 1
            assert span.start_time_unix_nano <= event.time_unix_nano <= span.end_time_unix_nano


def test_events_go_on_the_span_of_their_own_trace_else_the_pass_first_row(tmp_path):
    """An event is matched to a step by its stored trace words: the row of its own trace in the pass
    (here batch row 1, not the first row), else the pass's first row (an untracked event, trace 0/0)."""
    store = DuckDBStore(tmp_path / "t.duckdb")
    steps = synthetic.token_steps(PID, 3, 4, batch_rows=3, seed=5)
    events = synthetic.events_for_steps(steps)
    rows = steps.to_pylist()
    second_row_trace = {r["step_seq"]: r["trace_id"] for r in rows if r["batch_row"] == 1}
    seqs = events["step_seq"].to_pylist()
    traces = [second_row_trace[seq] for seq in seqs]
    traces[0] = ""  # one untracked event: its pass's first row carries it
    events = events.set_column(events.schema.get_field_index("trace_id"), "trace_id", pa.array(traces))
    store.append({"token_steps": steps, "events": events})
    correlate.correlate(store.connection)
    batch = batch_of(store)
    spans = spans_of(TraceEncoder(SpanIds(), 0).encode(batch))
    by_row = {}
    for span in spans:
        attrs = {kv.key: kv.value for kv in span.attributes}
        if "llmobs.batch_row" in attrs:
            by_row[(attrs["llmobs.step_seq"].int_value, attrs["llmobs.batch_row"].int_value)] = span
    per_pass = sum(p.count for p in synthetic.DEFAULT_PROBES)
    untracked_seq = seqs[0]
    for (seq, row), span in by_row.items():
        expected = {1: per_pass - (seq == untracked_seq), 0: int(seq == untracked_seq)}.get(row, 0)
        assert len(span.events) == expected, (seq, row)
    store.close()


def test_sampling_keeps_the_events_of_kept_traces_only(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb")
    steps = synthetic.token_steps(PID, 12, 2, batch_rows=1, seed=9)
    store.append({"token_steps": steps, "events": synthetic.events_for_steps(steps)})
    batch = batch_of(store)
    traces = sorted(set(steps["trace_id"].to_pylist()))
    kept = set(traces[::3])
    sampled = batch.only(lambda trace: trace in kept)
    assert set(sampled.events["trace_hi"].to_pylist()) == {int(t[:16], 16) for t in kept}
    per_pass = sum(p.count for p in synthetic.DEFAULT_PROBES)
    assert sampled.events.num_rows == per_pass * 2 * len(kept)  # 2 passes (tokens) per trace
    store.close()


def test_kernel_classes():
    assert kernel_class("ampere_sgemm_128x64_tn") == "gemm"
    assert kernel_class("void flash_fwd_kernel<Flash_fwd_kernel_traits<128>>") == "attention"
    assert kernel_class("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "collective"
    assert kernel_class("void at::native::vectorized_elementwise_kernel<4>") == "elementwise"
    assert kernel_class("cunn_SoftMaxForward") == "softmax"
    assert kernel_class("some_custom_kernel") == "other" and kernel_class("") == "other"


def test_metrics_histograms_sums_and_exemplars(store):
    batch = batch_of(store)
    ids = SpanIds()
    aggregator = MetricsAggregator(ids, 0, 123, {"service.name": "llmobs"})
    aggregator.observe(batch)
    request = aggregator.encode(now_wall_ns=456)
    metrics = {m.name: m for m in request.resource_metrics[0].scope_metrics[0].metrics}
    loss = metrics["llmobs.token.loss"].histogram.data_points[0]
    values = [r["loss"] for r in batch.steps if not math.isnan(r["loss"])]
    assert loss.count == len(values) == 11 and loss.sum == pytest.approx(sum(values), rel=1e-6)
    expected = np.bincount(np.searchsorted(LOSS_BOUNDS, values, side="left"), minlength=len(LOSS_BOUNDS) + 1)
    assert list(loss.bucket_counts) == expected.tolist()
    step_ids = {ids.step_span_id(r["pid"], r["trace_id"], r["step_seq"], r["batch_row"]) for r in batch.steps}
    assert {e.span_id for e in loss.exemplars} <= step_ids and len(loss.exemplars) >= 1
    latency = metrics["gen_ai.server.time_per_output_token"].histogram.data_points[0]
    assert latency.count == 12 and latency.start_time_unix_nano == 123 and latency.time_unix_nano == 456
    tokens = {
        tuple((kv.key, kv.value.string_value) for kv in p.attributes): p.as_int
        for p in metrics["llmobs.tokens"].sum.data_points
    }
    assert sum(tokens.values()) == 12 and all(
        ("llmobs.tenant", "acme") in k or ("llmobs.tenant", "globex") in k for k in tokens
    )
    allocations = metrics["llmobs.step.allocations"].histogram.data_points[0]
    assert allocations.count == 4 and allocations.sum == 4 * 6  # per forward pass, not per token
    # Cumulative: observing again doubles the counts, keeps the start time.
    aggregator.observe(batch)
    again = {m.name: m for m in aggregator.encode(789).resource_metrics[0].scope_metrics[0].metrics}
    assert again["llmobs.token.loss"].histogram.data_points[0].count == 22
