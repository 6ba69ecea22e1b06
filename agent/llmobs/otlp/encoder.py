"""Store rows -> OTLP trace protobuf (opentelemetry-proto's generated classes). No I/O here.

Span structure (docs/otlp.md has the full attribute table):

    request span  "<gen_ai.operation.name> <model>"       one per (pid, trace_id), sent once closed
      └─ token-step span "gen_ai.token_step"                one per token step, child of its request
           └─ span events, one per sampled probe event    each with llmobs.sample_ratio (N of 1/N)
           └─ span event "llmobs.anomaly" per loss anomaly  kind, score, detector, detail, evidence

Span ids are derived from the row keys (a keyed hash), never random: a batch retried after a lost ack,
or re-read after an agent restart, carries the same ids, so the backend sees duplicates it can drop,
and a step span exported before its request span still points at the right parent.
"""

from __future__ import annotations

import hashlib
import json
import math
import socket
from collections.abc import Iterable, Mapping

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from llmobs.otlp.source import StepBatch

SCOPE_NAME = "llmobs-agent"
SCOPE_VERSION = "0.1.0"
STEP_SPAN_NAME = "gen_ai.token_step"
DEFAULT_OPERATION = "text_completion"  # gen_ai.operation.name: a prompt in, generated tokens out

# token_steps column -> span attribute (None values and NaN floats are left out).
STEP_ATTRIBUTES = (
    ("model_id", "gen_ai.request.model"),
    ("session", "gen_ai.conversation.id"),
    ("tenant", "llmobs.tenant"),
    ("step", "llmobs.token.step"),
    ("position", "llmobs.token.position"),
    ("token_id", "llmobs.token.id"),
    ("target_id", "llmobs.token.target_id"),
    ("loss", "llmobs.token.loss"),
    ("entropy", "llmobs.token.entropy"),
    ("target_prob", "llmobs.token.target_prob"),
    ("target_rank", "llmobs.token.target_rank"),
    ("top1_prob", "llmobs.token.top1_prob"),
    ("latency_ns", "llmobs.token.latency_ns"),
    ("kv_len", "llmobs.token.kv_len"),
    ("step_seq", "llmobs.step_seq"),
    ("batch_row", "llmobs.batch_row"),
)
# step_rollups column -> token-step span attribute (what the forward pass did; shared by its batch rows).
ROLLUP_ATTRIBUTES = (
    ("tokens", "llmobs.step.tokens"),
    ("launches", "llmobs.step.launches"),
    ("allocations", "llmobs.step.allocations"),
    ("alloc_bytes", "llmobs.step.alloc_bytes"),
    ("frees", "llmobs.step.frees"),
    ("memcpy_bytes", "llmobs.step.memcpy_bytes"),
    ("off_cpu_ns", "llmobs.step.off_cpu_ns"),
    ("page_faults", "llmobs.step.page_faults"),
    ("compute_calls", "llmobs.step.compute_calls"),
    ("gpu_ns", "llmobs.step.gpu_ns"),
    ("counts_exact", "llmobs.step.counts_exact"),
)
# Event table column -> span event attribute.
EVENT_ATTRIBUTES = (
    ("kind", "llmobs.probe.kind"),
    ("sample_ratio", "llmobs.sample_ratio"),
    ("value", "llmobs.probe.value"),
    ("duration_ns", "llmobs.probe.duration_ns"),
    ("tid", "thread.id"),
    ("cpu", "llmobs.cpu"),
    ("name", "llmobs.kernel.name"),
    ("gpu_ns", "llmobs.kernel.gpu_ns"),
)


ANOMALY_EVENT_NAME = "llmobs.anomaly"
# anomalies column -> llmobs.anomaly event attribute (detail: the detector's numbers as JSON)
ANOMALY_ATTRIBUTES = (
    ("kind", "llmobs.anomaly.kind"),
    ("score", "llmobs.anomaly.score"),
    ("detector", "llmobs.anomaly.detector"),
    ("detail", "llmobs.anomaly.detail"),
    ("artifact", "llmobs.anomaly.artifact"),
)


def _hash(parts: Iterable[object], size: int, key: bytes = b"") -> bytes:
    text = "\x1f".join(str(p) for p in parts).encode()
    digest = hashlib.blake2b(text, digest_size=size, key=key).digest()
    return digest if any(digest) else b"\x01" + digest[1:]  # all-zero ids are invalid in OTLP


class SpanIds:
    """Trace and span ids from row keys. mode "prompt": the request's own (prompt-hash) trace id;
    "random": a keyed hash of it with a per-store secret salt, unlinkable across stores."""

    def __init__(self, mode: str = "prompt", salt: bytes = b""):
        if mode not in ("prompt", "random"):
            raise ValueError(f"unknown trace id mode {mode!r}")
        self.mode = mode
        self._salt = salt
        self._cache: dict[tuple[int, str], bytes] = {}

    def trace_id(self, pid: int, trace_hex: str) -> bytes:
        key = (pid, trace_hex)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        value: bytes | None = None
        if self.mode == "prompt" and len(trace_hex) == 32:
            try:
                value = bytes.fromhex(trace_hex)
            except ValueError:
                value = None
            if value is not None and not any(value):
                value = None
        if value is None:
            value = _hash((pid, trace_hex), 16, key=self._salt[:64])
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[key] = value
        return value

    @staticmethod
    def request_span_id(pid: int, trace_hex: str) -> bytes:
        return _hash(("request", pid, trace_hex), 8)

    @staticmethod
    def step_span_id(pid: int, trace_hex: str, step_seq: int, batch_row: int) -> bytes:
        return _hash(("step", pid, trace_hex, step_seq, batch_row), 8)


def set_attribute(attributes, key: str, value: object) -> None:
    """Append key=value to a repeated KeyValue field by Python type; None and NaN are skipped.

    Dispatches on the exact type first (the hot path: ~50 attributes per span; bool is not int here)."""
    kind = type(value)
    if kind is int:
        kv = attributes.add()
        kv.key = key
        kv.value.int_value = value
    elif kind is float:
        if value != value:  # NaN: a token without a target has no loss
            return
        kv = attributes.add()
        kv.key = key
        kv.value.double_value = value
    elif kind is str:
        kv = attributes.add()
        kv.key = key
        kv.value.string_value = value
    elif value is None:
        return
    elif kind is bool:
        kv = attributes.add()
        kv.key = key
        kv.value.bool_value = value
    elif isinstance(value, float) and math.isnan(value):
        return
    else:
        kv = attributes.add()
        kv.key = key
        if isinstance(value, int):
            kv.value.int_value = int(value)
        elif isinstance(value, float):
            kv.value.double_value = float(value)
        else:
            kv.value.string_value = str(value)


def key_values(items: Mapping[str, object]) -> list[KeyValue]:
    out = []
    for key, value in items.items():
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(KeyValue(key=key, value=AnyValue(bool_value=value)))
        elif isinstance(value, int):
            out.append(KeyValue(key=key, value=AnyValue(int_value=value)))
        elif isinstance(value, float):
            out.append(KeyValue(key=key, value=AnyValue(double_value=value)))
        else:
            out.append(KeyValue(key=key, value=AnyValue(string_value=str(value))))
    return out


class TraceEncoder:
    """Encodes a StepBatch into one ExportTraceServiceRequest: a ResourceSpans per workload pid."""

    def __init__(
        self,
        ids: SpanIds,
        wall_offset_ns: int,
        service_name: str = "llmobs",
        resource_attributes: Mapping[str, str] | None = None,
        operation: str = DEFAULT_OPERATION,
        host_name: str | None = None,
    ):
        self.ids = ids
        self.wall_offset_ns = wall_offset_ns
        self.service_name = service_name
        self.extra_resource = dict(resource_attributes or {})
        self.operation = operation
        self.host_name = host_name or socket.gethostname()

    def resource(self, pid: int, process: Mapping[str, object], model_id: str | None) -> dict[str, object]:
        attributes: dict[str, object] = {
            "service.name": self.service_name,
            "host.name": self.host_name,
            "process.pid": pid,
            "process.executable.path": process.get("exe"),
            "process.command_line": process.get("cmdline"),
            "llmobs.model.id": model_id,
        }
        attributes.update(self.extra_resource)  # OTEL_RESOURCE_ATTRIBUTES / --resource-attr win
        return attributes

    def encode(self, batch: StepBatch) -> ExportTraceServiceRequest:
        request = ExportTraceServiceRequest()
        scopes: dict[int, object] = {}

        def scope_for(pid: int, model_id: str | None):
            scope = scopes.get(pid)
            if scope is None:
                resource_spans = request.resource_spans.add()
                process = batch.processes.get(pid, {})
                resource_spans.resource.attributes.extend(key_values(self.resource(pid, process, model_id)))
                scope = resource_spans.scope_spans.add()
                scope.scope.name = SCOPE_NAME
                scope.scope.version = SCOPE_VERSION
                scopes[pid] = scope
            return scope

        # Which step span carries a forward pass's events: the one of the event's own trace if the pass
        # has it, else the pass's first batch row.
        by_trace: dict[tuple[int, int, str], Span] = {}
        by_pass: dict[tuple[int, int], Span] = {}
        offset = self.wall_offset_ns
        for step in batch.steps:
            pid, trace_hex = step["pid"], step["trace_id"]
            span = scope_for(pid, step["model_id"]).spans.add()
            span.trace_id = self.ids.trace_id(pid, trace_hex)
            span.span_id = self.ids.step_span_id(pid, trace_hex, step["step_seq"], step["batch_row"])
            span.parent_span_id = self.ids.request_span_id(pid, trace_hex)
            span.name = STEP_SPAN_NAME
            span.kind = Span.SPAN_KIND_INTERNAL
            span.start_time_unix_nano = step["t_start_ns"] + offset
            span.end_time_unix_nano = max(step["t_end_ns"], step["t_start_ns"]) + offset
            attributes = span.attributes
            set_attribute(attributes, "gen_ai.operation.name", self.operation)
            for column, name in STEP_ATTRIBUTES:
                set_attribute(attributes, name, step[column])
            rollup = batch.rollups.get((pid, step["step_seq"]))
            if rollup is not None:
                for column, name in ROLLUP_ATTRIBUTES:
                    set_attribute(attributes, name, rollup[column])
            by_trace[(pid, step["step_seq"], trace_hex)] = span
            by_pass.setdefault((pid, step["step_seq"]), span)

        totals: dict[int, tuple[Span, int]] = {}
        for event in batch.events:
            key = (event["pid"], event["step_seq"])
            span = by_trace.get((*key, event["trace_id"])) or by_pass.get(key)
            if span is None:
                continue
            span_event = span.events.add()
            span_event.time_unix_nano = event["ts_ns"] + offset
            span_event.name = event["probe"]
            for column, name in EVENT_ATTRIBUTES:
                set_attribute(span_event.attributes, name, event[column])
            totals[id(span)] = (span, event["pass_total"])
        for span, total in totals.values():
            span.dropped_events_count = max(total - len(span.events), 0)

        for anomaly in batch.anomalies:  # at the step's end: the loss is known once the pass is over
            key = (anomaly["pid"], anomaly["step_seq"])
            span = by_trace.get((*key, anomaly["trace_id"])) or by_pass.get(key)
            if span is None:
                continue
            span_event = span.events.add()
            span_event.time_unix_nano = span.end_time_unix_nano
            span_event.name = ANOMALY_EVENT_NAME
            for column, name in ANOMALY_ATTRIBUTES:
                set_attribute(span_event.attributes, name, anomaly[column])
            set_attribute(
                span_event.attributes, "llmobs.anomaly.evidence", evidence_summary(anomaly["evidence"])
            )

        for req in batch.requests:
            pid, trace_hex = req["pid"], req["trace_id"]
            span = scope_for(pid, req["model_id"]).spans.add()
            span.trace_id = self.ids.trace_id(pid, trace_hex)
            span.span_id = self.ids.request_span_id(pid, trace_hex)
            model = req["model_id"] or "unknown"
            span.name = f"{self.operation} {model}"
            span.kind = Span.SPAN_KIND_INTERNAL
            span.start_time_unix_nano = req["t_start_ns"] + offset
            span.end_time_unix_nano = max(req["t_end_ns"], req["t_start_ns"]) + offset
            attributes = span.attributes
            set_attribute(attributes, "gen_ai.operation.name", self.operation)
            set_attribute(attributes, "gen_ai.request.model", req["model_id"])
            set_attribute(attributes, "gen_ai.response.model", req["model_id"])
            set_attribute(attributes, "gen_ai.conversation.id", req["session"])
            set_attribute(attributes, "gen_ai.usage.output_tokens", req["tokens"])
            set_attribute(attributes, "llmobs.tenant", req["tenant"])
            if req["loss_count"]:
                set_attribute(attributes, "llmobs.request.mean_loss", req["loss_sum"] / req["loss_count"])
            if self.ids.mode == "prompt":  # in random mode exporting it would undo the unlinking
                set_attribute(attributes, "llmobs.prompt_hash", trace_hex)
        return request


def evidence_summary(evidence: str | None) -> str | None:
    """The one-line summary of an anomaly's evidence JSON (None until correlate has rolled it up)."""
    if not evidence:
        return None
    try:
        return json.loads(evidence).get("summary")
    except (ValueError, AttributeError):
        return None


def span_count(request: ExportTraceServiceRequest) -> int:
    return sum(len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans)
