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

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from llmobs.otlp import wire
from llmobs.otlp.columns import key_ids, sorted_keys, string_codes
from llmobs.otlp.served import request_span, served_span_id
from llmobs.otlp.source import StepBatch
from llmobs.shm.hashing import stored_trace_words

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
# One event per incident (llmobs.diagnostics.incidents) on its request's span, at its first flagged step.
INCIDENT_EVENT_NAME = "llmobs.anomaly.incident"
INCIDENT_ATTRIBUTES = (
    ("incident_id", "llmobs.incident.id"), ("scope", "llmobs.incident.scope"),
    ("state", "llmobs.incident.state"), ("first_step", "llmobs.incident.first_step"),
    ("last_step", "llmobs.incident.last_step"), ("tokens", "llmobs.incident.tokens"),
    ("rows", "llmobs.incident.rows"), ("peak_score", "llmobs.incident.peak_score"),
    ("peak_kind", "llmobs.incident.peak_kind"), ("peak_step", "llmobs.incident.peak_step"),
    ("detectors", "llmobs.incident.detectors"), ("artifact", "llmobs.incident.artifact"),
)  # fmt: skip
# One event per replay of a token step (llmobs-agent replay, --replay-on-anomaly; docs/replay.md) on the
# step's span, at the step's end: replays column -> llmobs.replay attribute.
REPLAY_EVENT_NAME = "llmobs.replay"
REPLAY_ATTRIBUTES = (
    ("replay_id", "llmobs.replay.id"), ("verdict", "llmobs.replay.verdict"),
    ("first_diverging_layer", "llmobs.replay.first_diverging_layer"), ("cause", "llmobs.replay.cause"),
    ("op_graph_hash", "llmobs.replay.op_graph_hash"), ("loss_diff", "llmobs.replay.loss_diff"),
    ("trigger", "llmobs.replay.trigger"),
)  # fmt: skip
# anomalies column -> llmobs.anomaly event attribute (detail: the detector's numbers as JSON)
ANOMALY_ATTRIBUTES = (
    ("kind", "llmobs.anomaly.kind"),
    ("score", "llmobs.anomaly.score"),
    ("detector", "llmobs.anomaly.detector"),
    ("detail", "llmobs.anomaly.detail"),
    ("artifact", "llmobs.anomaly.artifact"),
)


_blake2b = hashlib.blake2b
_ZERO_ID = bytes(8)


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
        # _hash(("step", pid, trace_hex, step_seq, batch_row), 8), written out: called once per span
        text = f"step\x1f{pid}\x1f{trace_hex}\x1f{step_seq}\x1f{batch_row}".encode()
        digest = _blake2b(text, digest_size=8).digest()
        return digest if digest != _ZERO_ID else b"\x01" + digest[1:]

    def step_ids(
        self,
        pid: np.ndarray,
        trace: pa.Array,
        seq: np.ndarray,
        row: np.ndarray,
        request: np.ndarray | None = None,
    ) -> tuple[bytes, bytes, bytes]:
        """Trace, span and parent (request) span ids of many token steps (columns), each kind back to
        back. A step with a request_seq is parented by its served request's span (llmobs.otlp.served).

        Trace and parent ids are made once per (pid, trace, request) and spread by index; the span id is
        a hash per row (of a per-request prefix and the row's own numbers), the ids of step_span_id."""
        n = len(pid)
        if request is None:
            request = np.zeros(n, np.int64)
        codes, traces = string_codes(trace)
        pid, request = pid.astype(np.int64), request.astype(np.int64)
        inverse, one = sorted_keys((pid, codes, request))
        trace_of, parent_of, prefixes = [], [], []
        for p, code, req in zip(pid[one].tolist(), codes[one].tolist(), request[one].tolist(), strict=True):
            text = traces[code]
            trace_of.append(self.trace_id(p, text))
            parent_of.append(served_span_id(p, text, req) if req else self.request_span_id(p, text))
            prefixes.append(f"step\x1f{p}\x1f{text}\x1f".encode())
        trace_ids = np.frombuffer(b"".join(trace_of), np.uint8).reshape(-1, 16)[inverse]
        parent_ids = np.frombuffer(b"".join(parent_of), np.uint8).reshape(-1, 8)[inverse]
        span_ids = wire.step_span_ids(prefixes, inverse, seq, row)
        return trace_ids.tobytes(), span_ids, parent_ids.tobytes()


def _first_of(keys: np.ndarray, count: int, last: bool = False) -> np.ndarray:
    """Per key id (0..count-1), the index of its first (or last) row; -1 where it has none."""
    index = np.arange(len(keys), dtype=np.int64)
    if last:
        out = np.full(count, -1, np.int64)
        np.maximum.at(out, keys, index)
        return out
    out = np.full(count, len(keys), np.int64)
    np.minimum.at(out, keys, index)
    return np.where(out == len(keys), -1, out)


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


class EncodedTraces:
    """An ExportTraceServiceRequest already in wire form (what the transports send), parsed into the
    generated message only when something reads its fields (tests, tools)."""

    def __init__(self, payload: bytes, spans: int):
        self.payload = payload
        self.spans = spans
        self._message: ExportTraceServiceRequest | None = None

    def SerializeToString(self) -> bytes:  # noqa: N802 - the protobuf message interface
        return self.payload

    def ByteSize(self) -> int:  # noqa: N802
        return len(self.payload)

    @property
    def message(self) -> ExportTraceServiceRequest:
        if self._message is None:
            self._message = ExportTraceServiceRequest.FromString(self.payload)
        return self._message

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.message, name)


# Wire tags of the fields written here (opentelemetry-proto trace.proto / common.proto).
_T_SCOPE_SPANS_SPAN = wire.tag(2, 2)  # ScopeSpans.spans
_T_SPAN_ATTRIBUTE = wire.tag(9, 2)  # Span.attributes
_T_SPAN_EVENT = wire.tag(11, 2)  # Span.events
_T_EVENT_ATTRIBUTE = wire.tag(3, 2)  # Span.Event.attributes


def _key_prefix(key: str) -> bytes:
    """KeyValue.key, then the tag of KeyValue.value."""
    raw = key.encode()
    return wire.tag(1, 2) + wire.varint_bytes(len(raw)) + raw + wire.tag(2, 2)


def _add_attribute(out: wire.Pieces, field_tag: bytes, key: str, column) -> None:
    """One attribute per row from an Arrow column, by the column's type as set_attribute types the
    Python value: integers -> int_value, floats -> double_value (NaN left out), bools -> bool_value,
    strings -> string_value; NULL left out.

    The usual case (a short key, a value under 100 bytes: every length fits one varint byte) is one
    (rows x bytes) matrix per attribute; anything longer goes through the general nested form."""
    n = out.n
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    kind = column.type
    if pa.types.is_null(kind):  # a column that is NULL in every row (e.g. gpu_ns without CUPTI)
        return
    prefix = np.frombuffer(_key_prefix(key), np.uint8)
    width = len(prefix)
    short = len(field_tag) == 1 and width + 16 < 128
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_dictionary(kind):
        data, start, length, present = wire.string_segments(column)
        if short and n and int(length.max()) + width + 4 < 128:
            head = np.empty((n, width + 5), np.uint8)
            head[:, 0] = field_tag[0]
            head[:, 1] = width + 3 + length
            head[:, 2 : 2 + width] = prefix
            head[:, 2 + width] = 2 + length
            head[:, 3 + width] = 0x0A
            head[:, 4 + width] = length
            out.matrix(head, np.where(present, width + 5, 0))
            out.add(data, start, length)
            return
        value = wire.Pieces(n)
        value.const(b"\x0a").varint(length).add(data, start, length)
    else:
        present = np.ones(n, dtype=bool) if column.null_count == 0 else ~np.asarray(column.is_null())
        if pa.types.is_boolean(kind):
            body, body_length, code = (
                np.asarray(column.fill_null(False)).astype(np.uint8)[:, None],
                None,
                0x10,
            )
        elif pa.types.is_floating(kind):
            values = np.asarray(column.fill_null(0.0), dtype=np.float64)
            present &= ~np.isnan(values)
            body, body_length, code = wire.fixed64_matrix(values), None, 0x21
        elif pa.types.is_integer(kind):
            values = np.asarray(column.fill_null(0)).astype(np.int64)  # uint64 above 2^63: wraps, as int64
            body, body_length = wire.varint_matrix(values)
            code = 0x18
        else:
            raise TypeError(f"no OTLP attribute type for {kind} ({key})")
        if short:
            if body_length is None:
                body_length = np.full(n, body.shape[1], np.int64)
            row = np.empty((n, width + 4 + body.shape[1]), np.uint8)
            row[:, 0] = field_tag[0]
            row[:, 1] = width + 2 + body_length
            row[:, 2 : 2 + width] = prefix
            row[:, 2 + width] = 1 + body_length
            row[:, 3 + width] = code
            row[:, 4 + width :] = body
            out.matrix(row, np.where(present, width + 4 + body_length, 0))
            return
        value = wire.Pieces(n).const(bytes([code]))
        value.matrix(body, body_length)
    keyvalue = wire.Pieces(n).const(_key_prefix(key))
    keyvalue.varint(value.length).extend(value)
    out.const(field_tag, present)
    out.varint(keyvalue.length, present)
    out.extend(keyvalue, present)


def _const_attribute(field_tag: bytes, key: str, value: object) -> bytes:
    """The bytes of one attribute that is the same on every span."""
    holder = Span()
    set_attribute(holder.attributes, key, value)
    if not holder.attributes:
        return b""
    raw = holder.attributes[0].SerializeToString()
    return field_tag + wire.varint_bytes(len(raw)) + raw


def _field(field: int, payload: bytes) -> bytes:
    return wire.tag(field, 2) + wire.varint_bytes(len(payload)) + payload


class TraceEncoder:
    """Encodes a StepBatch into one ExportTraceServiceRequest: a ResourceSpans per workload pid.

    Token-step spans and their events are encoded in bulk from the batch's columns (llmobs.otlp.wire);
    request spans (a few per batch) and the resource through the generated classes. The bytes are those
    the generated classes would write for the same spans, field by field."""

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
        self._span_head = (
            _field(5, STEP_SPAN_NAME.encode()) + wire.tag(6, 0) + wire.varint_bytes(Span.SPAN_KIND_INTERNAL)
        )
        self._operation_attribute = _const_attribute(_T_SPAN_ATTRIBUTE, "gen_ai.operation.name", operation)
        scope = InstrumentationScope(name=SCOPE_NAME, version=SCOPE_VERSION)
        self._scope_field = _field(1, scope.SerializeToString())

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

    def encode(self, batch: StepBatch) -> EncodedTraces:
        steps = batch.step_table
        pid = steps.column("pid").to_numpy() if steps.num_rows else np.zeros(0, np.int64)
        # Spans are grouped by process (one ResourceSpans each) in the order processes first appear.
        distinct, first_index, group = np.unique(pid, return_index=True, return_inverse=True)
        if len(distinct) > 1:
            rank = np.empty(len(distinct), np.int64)
            rank[np.argsort(first_index, kind="stable")] = np.arange(len(distinct))
            order = np.argsort(rank[group.reshape(-1)], kind="stable")
            steps = steps.take(pa.array(order))
            pid = pid[order]
        span_bytes, span_offsets = self._step_spans(batch, steps, pid)

        # each process's rows are one run now: its first and last row, in order of appearance
        starts = np.flatnonzero(np.r_[True, pid[1:] != pid[:-1]]) if len(pid) else np.zeros(0, np.int64)
        ends = np.r_[starts[1:], len(pid)][: len(starts)] - 1
        models = steps.column("model_id").take(pa.array(starts)).to_pylist() if len(starts) else []
        first_row = dict(zip(pid[starts].tolist(), starts.tolist(), strict=True))
        last_row = dict(zip(pid[starts].tolist(), ends.tolist(), strict=True))
        model_of = dict(zip(pid[starts].tolist(), models, strict=True))
        requests_of: dict[int, list[bytes]] = {}
        request_model: dict[int, str | None] = {}
        for req in batch.requests:
            raw = self._request_span(req).SerializeToString()
            requests_of.setdefault(req["pid"], []).append(
                _T_SCOPE_SPANS_SPAN + wire.varint_bytes(len(raw)) + raw
            )
            request_model.setdefault(req["pid"], req["model_id"])
        if batch.served or batch.unfinished:
            for row in (*batch.served, *batch.unfinished):
                raw = request_span(self.ids, row, self.wall_offset_ns, self.operation).SerializeToString()
                requests_of.setdefault(row["pid"], []).append(
                    _T_SCOPE_SPANS_SPAN + wire.varint_bytes(len(raw)) + raw
                )
                request_model.setdefault(row["pid"], row["model_id"])
        # The request is written by one join: the span bytes (a few MB) are copied once, the envelopes'
        # length prefixes computed from the parts' lengths instead of by wrapping bytes in bytes.
        out: list[bytes | memoryview] = []
        spans_view = memoryview(span_bytes)
        for pid in [*first_row, *(p for p in requests_of if p not in first_row)]:
            model = model_of[pid] if pid in first_row else request_model[pid]
            resource = Resource()
            resource.attributes.extend(key_values(self.resource(pid, batch.processes.get(pid, {}), model)))
            parts: list[bytes | memoryview] = [self._scope_field]
            if pid in first_row:
                lo, hi = span_offsets[first_row[pid]], span_offsets[last_row[pid] + 1]
                parts.append(spans_view[lo:hi])
            parts.extend(requests_of.get(pid, ()))
            scope_length = sum(len(part) for part in parts)
            resource_field = _field(1, resource.SerializeToString())
            scope_head = wire.tag(2, 2) + wire.varint_bytes(scope_length)
            resource_length = len(resource_field) + len(scope_head) + scope_length
            out += [wire.tag(1, 2) + wire.varint_bytes(resource_length), resource_field, scope_head, *parts]
        return EncodedTraces(b"".join(out), batch.span_count)

    # -- token-step spans, in bulk -------------------------------------------------------------------

    def _step_spans(
        self, batch: StepBatch, steps: pa.Table, pid: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Every step's span, each wrapped as a ScopeSpans.spans field: (bytes, row offsets)."""
        n = steps.num_rows
        if n == 0:
            return np.zeros(0, np.uint8), np.zeros(1, np.int64)
        seq = steps.column("step_seq").to_numpy()
        row = steps.column("batch_row").to_numpy()
        request = (
            steps.column("request_seq").fill_null(0).to_numpy()
            if "request_seq" in steps.column_names
            else None
        )
        trace_ids, span_ids, parent_ids = self.ids.step_ids(pid, steps.column("trace_id"), seq, row, request)
        offset = self.wall_offset_ns
        start = steps.column("t_start_ns").to_numpy().astype(np.int64)
        end = np.maximum(steps.column("t_end_ns").to_numpy().astype(np.int64), start)

        def column_of(blob: bytes, rows: int = n) -> np.ndarray:
            return np.broadcast_to(np.frombuffer(blob, np.uint8), (rows, len(blob)))

        head = np.concatenate(  # ids, name, kind, start and end: the same width in every span
            [
                column_of(wire.tag(1, 2) + b"\x10"),
                np.frombuffer(trace_ids, np.uint8).reshape(n, 16),
                column_of(wire.tag(2, 2) + b"\x08"),
                np.frombuffer(span_ids, np.uint8).reshape(n, 8),
                column_of(wire.tag(4, 2) + b"\x08"),
                np.frombuffer(parent_ids, np.uint8).reshape(n, 8),
                column_of(self._span_head),
                column_of(wire.tag(7, 1)),
                wire.fixed64_matrix(start + offset),
                column_of(wire.tag(8, 1)),
                wire.fixed64_matrix(end + offset),
            ],
            axis=1,
        )
        span = wire.Pieces(n).matrix(head)
        if self._operation_attribute:
            span.const(self._operation_attribute)
        for column, name in STEP_ATTRIBUTES:
            _add_attribute(span, _T_SPAN_ATTRIBUTE, name, steps.column(column))
        self._add_rollups(span, batch, pid, seq)
        owners = _Owners(steps, pid, seq)
        dropped = self._add_events(span, batch, owners, n, end + offset)
        span.const(wire.tag(12, 0), dropped > 0).varint(dropped, dropped > 0)

        wrapped = wire.Pieces(n)
        wrapped.const(_T_SCOPE_SPANS_SPAN).varint(span.length).extend(span)
        return wrapped.gather()

    def _add_rollups(self, span: wire.Pieces, batch: StepBatch, pid: np.ndarray, seq: np.ndarray) -> None:
        """The forward pass's rollup attributes on each of its rows (absent until correlate ran)."""
        table = batch.rollups
        if table is None or not table.num_rows:
            return
        n = len(pid)
        rollup_pid = table.column("pid").to_numpy().astype(np.int64)
        rollup_seq = table.column("step_seq").to_numpy().astype(np.int64)
        ids = key_ids(np.r_[pid, rollup_pid], np.r_[seq, rollup_seq])
        # the rollup of each key (keys are unique: one per pass), then of each step's key
        of_key = np.full(int(ids.max()) + 1, -1, np.int64)
        of_key[ids[n:]] = np.arange(table.num_rows)
        which = of_key[ids[:n]]
        has = which >= 0
        if not has.any():
            return
        take = pa.array(np.where(has, which, 0))
        for column, name in ROLLUP_ATTRIBUTES:
            values = table.column(column).take(take)
            if not has.all():
                values = pc.if_else(pa.array(has), values, pa.nulls(len(has), values.type))
            _add_attribute(span, _T_SPAN_ATTRIBUTE, name, values)

    def _add_events(
        self,
        span: wire.Pieces,
        batch: StepBatch,
        owners: _Owners,
        n: int,
        end_wall: np.ndarray,
    ) -> np.ndarray:
        """The sampled probe events and the anomalies of each span as its Span.events; returns each
        span's dropped_events_count (its pass's events beyond the cap)."""
        dropped = np.zeros(n, dtype=np.int64)
        events = batch.events
        if events is not None and events.num_rows:
            owner = owners.of(
                events.column("pid").to_numpy(),
                events.column("step_seq").to_numpy(),
                events.column("trace_hi").to_numpy(),
                events.column("trace_lo").to_numpy(),
            )
            keep = np.flatnonzero(owner >= 0)
            order = keep[np.argsort(owner[keep], kind="stable")]  # per span, in the query's order
            events = events.take(pa.array(order))
            owner = owner[order]
            m = len(order)
            event = wire.Pieces(m)
            ts = events.column("ts_ns").to_numpy().astype(np.int64) + self.wall_offset_ns
            time_field = np.empty((m, 9), np.uint8)
            time_field[:, 0] = wire.tag(1, 1)[0]
            time_field[:, 1:] = wire.fixed64_matrix(ts)
            event.matrix(time_field)
            data, start, length, _ = wire.string_segments(events.column("probe"))
            event.const(wire.tag(2, 2)).varint(length).add(data, start, length)
            for column, name in EVENT_ATTRIBUTES:
                _add_attribute(event, _T_EVENT_ATTRIBUTE, name, events.column(column))
            fields = wire.Pieces(m)
            fields.const(_T_SPAN_EVENT).varint(event.length).extend(event)
            event_bytes, event_offsets = fields.gather()
            first = np.searchsorted(owner, np.arange(n), side="left")
            after = np.searchsorted(owner, np.arange(n), side="right")
            count = after - first
            span.add(event_bytes, event_offsets[first], event_offsets[after] - event_offsets[first])
            totals = events.column("pass_total").to_numpy().astype(np.int64)
            with_events = count > 0
            dropped[with_events] = np.maximum(totals[after[with_events] - 1] - count[with_events], 0)
        if batch.anomalies:
            by_trace, by_pass = owners.dicts()
            self._add_anomalies(span, batch.anomalies, by_trace, by_pass, n, end_wall)
        if batch.replays:
            by_trace, _by_pass = owners.dicts()
            self._add_replays(span, batch.replays, by_trace, n, end_wall)
        return dropped

    def _add_anomalies(self, span, anomalies, by_trace, by_pass, n, end_wall) -> None:
        """llmobs.anomaly events (a few per batch), after the span's probe events, at the step's end: the
        loss is known once the pass is over."""
        per_span: dict[int, list[bytes]] = {}
        for anomaly in anomalies:
            key = (anomaly["pid"], anomaly["step_seq"])
            index = by_trace.get((*key, anomaly["trace_id"]), by_pass.get(key))
            if index is None:
                continue
            evidence = (("llmobs.anomaly.evidence", evidence_summary(anomaly["evidence"])),)
            per_span.setdefault(index, []).append(
                _event_bytes(int(end_wall[index]), ANOMALY_EVENT_NAME, anomaly, ANOMALY_ATTRIBUTES, evidence)
            )
        _add_events(span, per_span, n)

    def _add_replays(self, span, replays, by_trace, n, end_wall) -> None:
        """llmobs.replay events on the replayed token step's own span (its trace's row of the pass)."""
        per_span: dict[int, list[bytes]] = {}
        for replay in replays:
            index = by_trace.get((replay["pid"], replay["step_seq"], replay["trace_id"]))
            if index is None:
                continue
            per_span.setdefault(index, []).append(
                _event_bytes(int(end_wall[index]), REPLAY_EVENT_NAME, replay, REPLAY_ATTRIBUTES)
            )
        _add_events(span, per_span, n)

    # -- request spans ---------------------------------------------------------------------------------

    def _request_span(self, req: Mapping[str, object]) -> Span:
        pid, trace_hex = req["pid"], req["trace_id"]
        offset = self.wall_offset_ns
        span = Span()
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
        for incident in req.get("incidents", ()):
            event = span.events.add()
            event.time_unix_nano = int(incident["t_ns"]) + offset
            event.name = INCIDENT_EVENT_NAME
            for column, name in INCIDENT_ATTRIBUTES:
                set_attribute(event.attributes, name, incident[column])
            set_attribute(
                event.attributes, "llmobs.incident.evidence", evidence_summary(incident["evidence"])
            )
        return span


class _Owners:
    """Which step span carries a forward pass's events: the one of the event's own trace if the pass has
    it (its last such row), else the pass's first batch row."""

    def __init__(self, steps: pa.Table, pid: np.ndarray, seq: np.ndarray):
        self.steps, self.pid, self.seq = steps, pid, seq

    def of(self, pid: np.ndarray, seq: np.ndarray, trace_hi: np.ndarray, trace_lo: np.ndarray) -> np.ndarray:
        """The owning step row of each event (pid, step_seq and the trace id's two stored words); -1 for
        none. The steps' hex trace ids are turned into words once per distinct trace (a few a batch); a
        step whose trace no pair of words writes gets its own key, which no event has."""
        n = len(self.pid)
        codes, traces = string_codes(self.steps.column("trace_id"))
        words = [stored_trace_words(text) for text in traces]
        odd = np.array([w is None for w in words], dtype=np.int64)
        hi = np.array([w[0] if w else 0 for w in words], dtype=np.uint64)
        lo = np.array([w[1] if w else 0 for w in words], dtype=np.uint64)
        all_pid, all_seq = np.r_[self.pid, pid], np.r_[self.seq, seq]
        all_hi = np.r_[hi[codes], np.asarray(trace_hi, np.uint64)].view(np.int64)
        all_lo = np.r_[lo[codes], np.asarray(trace_lo, np.uint64)].view(np.int64)
        all_odd = np.r_[np.where(odd[codes] == 1, codes + 1, 0), np.zeros(len(pid), np.int64)]
        by_trace = key_ids(all_pid, all_seq, all_hi, all_lo, all_odd)
        by_pass = key_ids(all_pid, all_seq)
        last = _first_of(by_trace[:n], int(by_trace.max()) + 1, last=True)[by_trace[n:]]
        first = _first_of(by_pass[:n], int(by_pass.max()) + 1)[by_pass[n:]]
        return np.where(last >= 0, last, first)

    def dicts(self) -> tuple[dict, dict]:
        """The same as dicts (pid, step_seq, trace_id) -> row and (pid, step_seq) -> row: for the few
        anomalies of a batch."""
        by_trace: dict[tuple[int, int, str], int] = {}
        by_pass: dict[tuple[int, int], int] = {}
        keys = zip(
            self.pid.tolist(), self.seq.tolist(), self.steps.column("trace_id").to_pylist(), strict=True
        )
        for index, key in enumerate(keys):
            by_trace[key] = index
            by_pass.setdefault(key[:2], index)
        return by_trace, by_pass


def evidence_summary(evidence: str | None) -> str | None:
    """The one-line summary of an anomaly's evidence JSON (None until correlate has rolled it up)."""
    if not evidence:
        return None
    try:
        return json.loads(evidence).get("summary")
    except (ValueError, AttributeError):
        return None


def span_count(request: ExportTraceServiceRequest | EncodedTraces) -> int:
    if isinstance(request, EncodedTraces):
        return request.spans
    return sum(len(scope.spans) for rs in request.resource_spans for scope in rs.scope_spans)


def _event_bytes(time_unix_nano: int, name: str, row, attributes, extra=()) -> bytes:
    """One span event as its wire bytes, field tag and length included: `attributes` are (row column,
    attribute name) pairs, `extra` (attribute name, value) pairs."""
    event = Span.Event()
    event.time_unix_nano = time_unix_nano
    event.name = name
    for column, attribute in attributes:
        set_attribute(event.attributes, attribute, row[column])
    for attribute, value in extra:
        set_attribute(event.attributes, attribute, value)
    raw = event.SerializeToString()
    return _T_SPAN_EVENT + wire.varint_bytes(len(raw)) + raw


def _add_events(span, per_span: dict[int, list[bytes]], n: int) -> None:
    """Span events (encoded, by span index) into the span column of n token-step spans."""
    if not per_span:
        return
    blobs = [b"".join(per_span.get(index, ())) for index in range(n)]
    lengths = np.array([len(b) for b in blobs], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    span.add(np.frombuffer(b"".join(blobs), np.uint8), starts, lengths)
