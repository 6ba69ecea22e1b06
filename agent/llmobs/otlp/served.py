"""Request spans of served requests (request_events 'end' rows): one span per request, in its caller's trace.

A request with a request_seq (a continuously batching server's, or llmobs.request under a traceparent)
gets its request span from its request-end row, not from folding its token steps: the row is exact and
complete (arrival to end, prompt and generated tokens, finish reason), and two requests of one trace
(a caller that makes several calls under one span, or identical prompts) stay two spans. Its token-step
spans point at it by the same deterministic id (`served_span_id`), whichever is exported first.

With `trace_from_caller` the span is in the caller's trace (the caller's trace id verbatim) and its
parent is the caller's span (parent_span_id); the prompt-hash stays the attribute llmobs.prompt_hash. In
trace-id mode "random" (traces unlinkable across stores) a caller's trace is not joined: the span gets the
keyed-hash trace id and no parent, like every other span of that mode.

A request the engine had not finished when the export's final flush ran (detach, one-shot) has no end
row; its span is built from its token steps instead (served_rows.unfinished): the same span id, first
step to last step, `llmobs.request.unfinished` true, no finish reason, status unset, and none of what only
the end row knows (prompt tokens, queue/TTFT/TPOT, the caller's parent span id). When its end row arrives
(a later export over the same store) the complete span goes out with the same id (docs/otlp.md).

The rows come from llmobs.otlp.served_rows (which of them the collector has not acknowledged yet).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

PROVIDER = "transformers"  # gen_ai.provider.name: no well-known value fits a self-hosted engine (custom)
ERROR_REASONS = ("error", "cancelled")  # finish reasons that end the span with an error status


def served_span_id(pid: int, trace_hex: str, request_seq: int) -> bytes:
    """The request span id of request `request_seq` of `pid`: its token steps' parent. A request with a
    request_seq is one span of its own however many share its trace id."""
    text = f"served\x1f{pid}\x1f{trace_hex}\x1f{request_seq}".encode()
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return digest if any(digest) else b"\x01" + digest[1:]  # all-zero ids are invalid in OTLP


def set_attribute(attributes, key: str, value: object) -> None:
    """key=value onto a repeated KeyValue field (None left out): the few types a request span has."""
    if value is None:
        return
    kv = attributes.add()
    kv.key = key
    if isinstance(value, bool):
        kv.value.bool_value = value
    elif isinstance(value, int):
        kv.value.int_value = value
    else:
        kv.value.string_value = str(value)


def joins_caller(ids, row: Mapping[str, object]) -> bool:
    return (
        bool(row.get("trace_from_caller")) and ids.mode == "prompt" and len(str(row["parent_span_id"])) == 16
    )


def request_span(ids, row: Mapping[str, object], wall_offset_ns: int, operation: str) -> Span:
    """The request span of one request-end row, or of an unfinished request's steps (`unfinished`
    true: served_rows.unfinished). `ids`: the exporter's llmobs.otlp.encoder.SpanIds."""
    pid, trace_hex, seq = int(row["pid"]), str(row["trace_id"] or ""), int(row["request_seq"])
    span = Span()
    span.trace_id = ids.trace_id(pid, trace_hex)  # prompt mode: the id itself (the caller's, if joined)
    span.span_id = served_span_id(pid, trace_hex, seq)
    if joins_caller(ids, row):
        span.parent_span_id = bytes.fromhex(str(row["parent_span_id"]))
    model = row["model_id"] or "unknown"
    span.name = f"{operation} {model}"
    span.kind = Span.SPAN_KIND_SERVER  # the model server's handling of a caller's request
    start = int(row["t_start_ns"] or row["t_end_ns"])
    span.start_time_unix_nano = start + wall_offset_ns
    span.end_time_unix_nano = max(int(row["t_end_ns"]), start) + wall_offset_ns
    reason = row.get("finish_reason") or ""
    unfinished = bool(row.get("unfinished"))
    a = span.attributes
    set_attribute(a, "gen_ai.operation.name", operation)
    set_attribute(a, "gen_ai.provider.name", PROVIDER)
    set_attribute(a, "gen_ai.request.model", row["model_id"] or None)
    set_attribute(a, "gen_ai.response.model", row["model_id"] or None)
    set_attribute(a, "gen_ai.response.id", row["request_id"] or None)
    set_attribute(a, "gen_ai.conversation.id", row["session"] or None)
    if not unfinished:  # its prompt tokens are on the end row only
        set_attribute(a, "gen_ai.usage.input_tokens", int(row["prompt_tokens"] or 0))
    set_attribute(a, "gen_ai.usage.output_tokens", int(row["decoded_tokens"] or 0))  # so far, if unfinished
    if reason:
        kv = a.add()
        kv.key = "gen_ai.response.finish_reasons"
        kv.value.array_value.values.append(AnyValue(string_value=reason))
    set_attribute(a, "llmobs.request.id", row["request_id"] or None)  # the engine's own id
    set_attribute(a, "llmobs.request_seq", seq)
    set_attribute(a, "llmobs.tenant", row["tenant"] or None)
    if unfinished:
        # what only the end row knows (the prompt hash of a caller's trace, whether it joined one, the
        # timings and cache figures) is left out rather than guessed
        set_attribute(a, "llmobs.request.unfinished", True)
        return span
    if ids.mode == "prompt":  # in random mode it would undo the unlinking
        set_attribute(a, "llmobs.prompt_hash", str(row["prompt_hash"] or trace_hex))
    set_attribute(a, "llmobs.trace_from_caller", bool(row.get("trace_from_caller")))
    for column in ("queue_ns", "ttft_ns", "tpot_ns"):
        value = row[column]
        if value is not None and value >= 0:
            set_attribute(a, f"llmobs.request.{column}", int(value))
    for column in ("prefill_tokens", "kv_blocks", "prefix_hit_tokens"):
        set_attribute(a, f"llmobs.request.{column}", int(row[column] or 0))
    if reason in ERROR_REASONS:
        set_attribute(a, "error.type", reason)
        span.status.code = Status.STATUS_CODE_ERROR
        span.status.message = f"request {reason}"
    return span
