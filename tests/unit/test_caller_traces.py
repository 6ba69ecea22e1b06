"""Traces a caller can follow: a W3C traceparent -> the caller's trace id on every record of the request,
its parent span id through the map and the store -> an OTLP request span that is a child of the caller's
span, token-step spans children of it; GenAI server histograms from request_events."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from llmobs.otlp import genai_metrics
from llmobs.otlp.encoder import SpanIds, TraceEncoder
from llmobs.otlp.metrics import MetricsAggregator
from llmobs.otlp.served import served_span_id
from llmobs.otlp.source import ExportCursor
from llmobs.publisher import request as publisher
from llmobs.publisher import traceparent as w3c
from llmobs.publisher.serving import Row, ServingPublisher
from llmobs.shm.hashing import trace_id
from llmobs.shm.reader import ShmReader
from llmobs.shm.writer import ShmWriter
from llmobs.store.sink import DuckDBStore
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
GOOD = f"00-{TRACE}-{PARENT}-01"


@pytest.mark.parametrize(
    "value",
    [GOOD, f"01-{TRACE}-{PARENT}-00-later-fields", f"  {GOOD}  "],
)
def test_good_traceparents_parse(value):
    parsed = w3c.parse(value)
    assert parsed is not None and parsed.trace_id == TRACE and parsed.span_id == PARENT
    assert parsed.text() in (GOOD, f"00-{TRACE}-{PARENT}-00")


@pytest.mark.parametrize(
    "value",
    [
        f"00-{'0' * 32}-{PARENT}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
        f"00-{TRACE[:-1]}-{PARENT}-01",  # short trace id
        f"00-{TRACE}-{PARENT}0-01",  # long parent id
        f"00-{TRACE.upper()}-{PARENT}-01",  # uppercase is not hex here
        f"00-{TRACE[:-1]}g-{PARENT}-01",  # not hex
        f"ff-{TRACE}-{PARENT}-01",  # version ff is invalid
        f"00-{TRACE}-{PARENT}-01-extra",  # version 00 has exactly four fields
        "",
        "garbage",
    ],
)
def test_malformed_traceparents_are_none(value):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert w3c.parse(value) is None


def test_a_malformed_traceparent_is_counted_and_warned_once_and_keeps_the_default(monkeypatch):
    monkeypatch.setattr(w3c, "malformed", 0)
    monkeypatch.setattr(w3c, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with publisher.context(tenant="t", traceparent="00-nothex-00f067aa0ba902b7-01"):
                assert publisher._traceparent.get() is None  # the default trace id, no error
    assert w3c.malformed == 3
    assert len([w for w in caught if "traceparent" in str(w.message)]) == 1
    with publisher.context(traceparent=GOOD):
        assert publisher._traceparent.get().trace_id == TRACE
    assert publisher._traceparent.get() is None  # reset on exit


@pytest.fixture
def writer(tmp_path):
    w = ShmWriter(shm_dir=str(tmp_path), names_capacity=64, steps_capacity=64, requests_capacity=16)
    yield w
    w.close()


def _serve(writer, prompts: dict[str, tuple[list[int], str | None]], tokens: int = 3) -> None:
    """Requests `prompts` (id -> prompt, traceparent) through a ServingPublisher, all in every pass."""
    pub = ServingPublisher("tiny", writer=writer)
    for rid, (prompt, parent) in prompts.items():
        with publisher.context(tenant=f"tenant-{rid}", traceparent=parent):
            pub.request_arrived(rid, prompt)
    for step in range(tokens):
        rows = [
            Row(rid, len(p) if step == 0 else 1, 0 if step == 0 else len(p) + step - 1, True)
            for rid, (p, _) in prompts.items()
        ]
        p = pub.pass_begin(rows)
        pub.pass_logits(torch.randn(len(rows), 11))
        pub.pass_end(p, [7] * len(rows))
    for rid in prompts:
        pub.request_finished(rid, "length")


def _read(tmp_path):
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as reader:
        steps = reader.read_steps()
        events = reader.read_request_events()
    return steps.columns, events.columns


def test_a_served_request_with_a_traceparent_carries_the_callers_trace(writer, tmp_path):
    prompt = [5, 6, 7, 8]
    _serve(writer, {"a": (prompt, GOOD), "b": ([9, 9, 9], None)})
    steps, events = _read(tmp_path)
    own = trace_id(np.asarray([9, 9, 9], np.int64)).hex()
    seq_a = {r: s for r, s in zip(events["request_id"], events["request_seq"].tolist(), strict=True)}["a"]
    for trace, seq in zip(steps["trace_id"], steps["request_seq"].tolist(), strict=True):
        assert trace == (TRACE if seq == seq_a else own)  # every token step of "a": the caller's trace id
    assert sorted(steps["request_id"]) == ["a"] * 3 + ["b"] * 3
    by_id = {rid: i for i, rid in enumerate(events["request_id"])}
    a, b = by_id["a"], by_id["b"]
    assert events["trace_id"][a] == TRACE and events["trace_from_caller"][a] is True
    assert events["parent_span_id"][a] == PARENT and events["trace_flags"][a] == 1
    assert events["prompt_hash"][a] == trace_id(np.asarray(prompt, np.int64)).hex()  # identical prompts group
    assert events["trace_from_caller"][b] is False and events["parent_span_id"][b] == ""
    assert events["trace_id"][b] == events["prompt_hash"][b] == own


def test_llmobs_request_honours_the_traceparent(writer, tmp_path, monkeypatch):
    monkeypatch.setattr("llmobs.publisher.request.get_writer", lambda: writer)
    with publisher.context(traceparent=GOOD), publisher.request(torch.tensor([[1, 2, 3], [4, 5, 6]])) as req:
        for _ in range(2):
            req.begin_step()
            req.step(torch.randn(2, 11), [1, 2])
    steps, events = _read(tmp_path)
    assert set(steps["trace_id"]) == {TRACE} and len(set(steps["request_seq"].tolist())) == 2
    assert list(events["parent_span_id"]) == [PARENT, PARENT] and all(events["trace_from_caller"])
    assert list(events["decoded_tokens"]) == [2, 2]


def _store_with(tmp_path, writer, prompts):
    _serve(writer, prompts)
    steps, events = _read(tmp_path)
    store = DuckDBStore(tmp_path / "s.duckdb")
    store.append({"token_steps": steps, "request_events": events})
    return store


def test_the_request_span_is_a_child_of_the_callers_span_and_parents_its_steps(writer, tmp_path):
    store = _store_with(tmp_path, writer, {"a": ([5, 6, 7, 8], GOOD), "b": ([9, 9, 9], None)})
    try:
        cursor = ExportCursor(store.connection.cursor())
        batch = cursor.next_batch(limit=100, max_events_per_span=8, flush=True)
        assert len(batch.served) == 2 and batch.requests == []  # served requests: spans from their ends
        encoded = TraceEncoder(SpanIds(), wall_offset_ns=0).encode(batch)
        spans = [s for rs in encoded.resource_spans for sc in rs.scope_spans for s in sc.spans]
        served = {s.span_id: s for s in spans if s.kind == Span.SPAN_KIND_SERVER}
        attrs = {sid: {kv.key: kv.value for kv in s.attributes} for sid, s in served.items()}
        a = next(s for sid, s in served.items() if attrs[sid]["llmobs.request.id"].string_value == "a")
        b = next(s for sid, s in served.items() if attrs[sid]["llmobs.request.id"].string_value == "b")
        assert a.trace_id.hex() == TRACE and a.parent_span_id.hex() == PARENT
        assert not b.parent_span_id and b.trace_id.hex() != TRACE
        a_attrs = attrs[a.span_id]
        assert (
            a_attrs["llmobs.prompt_hash"].string_value == trace_id(np.asarray([5, 6, 7, 8], np.int64)).hex()
        )
        assert a_attrs["gen_ai.usage.input_tokens"].int_value == 4
        assert a_attrs["gen_ai.usage.output_tokens"].int_value == 3
        assert a_attrs["gen_ai.provider.name"].string_value and a.status.code != Status.STATUS_CODE_ERROR
        steps = [s for s in spans if s.kind != Span.SPAN_KIND_SERVER]
        assert len(steps) == 6
        for s in steps:
            assert s.parent_span_id in (a.span_id, b.span_id)
            assert s.trace_id == served[s.parent_span_id].trace_id
        assert sum(s.parent_span_id == a.span_id for s in steps) == 3
        cursor.commit(batch)
        again = cursor.next_batch(limit=100, max_events_per_span=8, flush=True)
        assert again.served == [] and again.span_count == 0  # acknowledged once
    finally:
        store.close()


def test_random_mode_does_not_join_the_callers_trace(writer, tmp_path):
    store = _store_with(tmp_path, writer, {"a": ([5, 6, 7, 8], GOOD)})
    try:
        batch = ExportCursor(store.connection.cursor()).next_batch(
            limit=100, max_events_per_span=8, flush=True
        )
        encoded = TraceEncoder(SpanIds("random", b"salt"), wall_offset_ns=0).encode(batch)
        spans = [s for rs in encoded.resource_spans for sc in rs.scope_spans for s in sc.spans]
        request = next(s for s in spans if s.kind == Span.SPAN_KIND_SERVER)
        assert not request.parent_span_id and request.trace_id.hex() != TRACE
        assert all(s.trace_id == request.trace_id for s in spans)
    finally:
        store.close()


def _row(seq, ttft_s, tpot_s, duration_s, reason="stop", tenant="t"):
    end = 10**12
    return {
        "pid": 1, "request_seq": seq, "trace_id": TRACE, "model_id": "m", "tenant": tenant,
        "t_start_ns": end - int(duration_s * 1e9), "t_end_ns": end, "ttft_ns": int(ttft_s * 1e9),
        "tpot_ns": int(tpot_s * 1e9), "finish_reason": reason,
    }  # fmt: skip


def test_genai_histograms_use_the_conventions_buckets():
    agg = MetricsAggregator(SpanIds(), 0, 0, {})
    rows = [_row(1, 0.03, 0.02, 0.5), _row(2, 0.3, 0.2, 3.0), _row(3, 0.0, 0.0, 1.0, reason="error")]
    agg._observe_served(rows, None)
    series = agg.histograms["gen_ai.server.time_to_first_token"]
    ((attrs, ttft),) = series.items()
    assert dict(attrs) == {"gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "transformers",
                           "gen_ai.request.model": "m", "llmobs.tenant": "t"}  # fmt: skip
    assert ttft.bounds == genai_metrics.TIME_TO_FIRST_TOKEN_BOUNDS and ttft.count == 2  # successful only
    assert ttft.counts[genai_metrics.TIME_TO_FIRST_TOKEN_BOUNDS.index(0.04)] == 1  # 0.03 in (0.02, 0.04]
    assert ttft.counts[genai_metrics.TIME_TO_FIRST_TOKEN_BOUNDS.index(0.5)] == 1  # 0.3 in (0.25, 0.5]
    tpot = next(iter(agg.histograms["gen_ai.server.time_per_output_token"].values()))
    assert tpot.bounds == genai_metrics.TIME_PER_OUTPUT_TOKEN_BOUNDS
    assert tpot.counts[1] == 1 and tpot.counts[genai_metrics.TIME_PER_OUTPUT_TOKEN_BOUNDS.index(0.2)] == 1
    durations = agg.histograms["gen_ai.server.request.duration"]
    assert {dict(a).get("error.type") for a in durations} == {None, "error"}
    ok = next(p for a, p in durations.items() if "error.type" not in dict(a))
    assert ok.bounds == genai_metrics.REQUEST_DURATION_BOUNDS
    assert ok.counts[genai_metrics.REQUEST_DURATION_BOUNDS.index(0.64)] == 1  # 0.5 in (0.32, 0.64]
    assert ok.counts[genai_metrics.REQUEST_DURATION_BOUNDS.index(5.12)] == 1  # 3.0 in (2.56, 5.12]
    exemplar = next(iter(ok.exemplars.values()))
    assert exemplar.trace_id.hex() == TRACE and exemplar.span_id in (
        served_span_id(1, TRACE, 1),
        served_span_id(1, TRACE, 2),
    )


def test_tenants_past_the_cap_fold_into_other_and_are_counted():
    cap = genai_metrics.TenantCap(cap=2)
    assert [cap.label(t) for t in ("a", "b", "a", "c", "d", "c")] == [
        "a",
        "b",
        "a",
        "other",
        "other",
        "other",
    ]
    assert cap.folded == 3 and cap.folded_tenants == {"c", "d"}
