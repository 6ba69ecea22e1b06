"""An encoded ExportTraceServiceRequest cut into requests under a byte limit, at the wire level.

Why: a collector limits a request's size (rotel and the OpenTelemetry Collector's gRPC receiver: 4 MiB
by default, answering OUT_OF_RANGE / RESOURCE_EXHAUSTED / HTTP 413 above it), while a batch of
`batch_spans` token steps with up to `max_events_per_span` events each can encode to far more. The
encoder writes one request per batch; this module cuts its bytes into several, each a valid request:

- every span whole, exactly once, in the original order;
- each span under its own resource and scope: a request holds, per resource (process) it has spans of,
  that ResourceSpans' resource (and schema_url) and, per scope, the ScopeSpans' scope, with the spans;
- each request at most `max_bytes`, exactly (the protobuf length prefixes are counted), except a span
  that alone, without any event, is larger: it goes in a request of its own for the collector to judge.
  A span too large for a request alone keeps its first events that fit (the earliest: the encoder
  writes them by time) and counts the rest in its `dropped_events_count`, as the per-span event cap does.

The limit is the `max_request_bytes` setting (llmobs.otlp.config), lowered by delivery after a
collector refused a request as too large. Only the three envelope levels are parsed (a tag and a length
per span); span bytes are copied once, into the request they go to. A request already under the limit
is returned as it is, unparsed.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmobs.otlp import wire
from llmobs.otlp.encoder import EncodedTraces

_RESOURCE_SPANS = 1  # ExportTraceServiceRequest.resource_spans
_SCOPE_SPANS = 2  # ResourceSpans.scope_spans
_SPANS = 2  # ScopeSpans.spans
_EVENTS = 11  # Span.events
_DROPPED_EVENTS = 12  # Span.dropped_events_count


@dataclass(frozen=True)
class _Scope:
    head: bytes  # ScopeSpans fields numbered below `spans` (the scope)
    tail: bytes  # and above it (schema_url)
    spans: list[memoryview]  # each a whole `spans` field: tag, length, Span

    @property
    def fixed(self) -> int:
        return len(self.head) + len(self.tail)


@dataclass(frozen=True)
class _Resource:
    head: bytes  # ResourceSpans fields numbered below `scope_spans` (the resource)
    tail: bytes  # and above it (schema_url)
    scopes: list[_Scope]

    @property
    def fixed(self) -> int:
        return len(self.head) + len(self.tail)


@dataclass
class Split:
    requests: list[EncodedTraces]
    events_truncated: int = 0  # span events left out of spans too large for a request alone
    spans_truncated: int = 0  # spans that lost events so


def split_request(request: EncodedTraces, max_bytes: int) -> Split:
    """`request` as requests of at most `max_bytes` each (see the module docstring)."""
    payload = request.SerializeToString()
    if len(payload) <= max_bytes:
        return Split([request])
    out = Split([])
    packer = _Packer()
    for resource in _parse(payload):
        for scope in resource.scopes:
            for span in scope.spans:
                if packer.spans and packer.size_with(resource, scope, len(span)) > max_bytes:
                    out.requests.append(packer.flush())
                if not packer.spans and packer.size_with(resource, scope, len(span)) > max_bytes:
                    span, removed = _truncate_events(span, resource, scope, max_bytes)
                    if removed:
                        out.events_truncated += removed
                        out.spans_truncated += 1
                packer.add(resource, scope, span)
    if packer.spans:
        out.requests.append(packer.flush())
    return out


def halve(request: EncodedTraces) -> tuple[EncodedTraces, EncodedTraces]:
    """`request` (of two spans or more) as two requests with about half its span bytes each."""
    flat = [(r, s, span) for r in _parse(request.SerializeToString()) for s in r.scopes for span in s.spans]
    if len(flat) < 2:
        raise ValueError("a request of one span cannot be halved")
    half = sum(len(span) for _, _, span in flat) / 2
    cut, total = 0, 0
    while cut < len(flat) - 1 and (cut == 0 or total + len(flat[cut][2]) / 2 <= half):
        total += len(flat[cut][2])
        cut += 1
    parts = []
    for piece in (flat[:cut], flat[cut:]):
        packer = _Packer()
        for resource, scope, span in piece:
            packer.add(resource, scope, span)
        parts.append(packer.flush())
    return parts[0], parts[1]


# -- sizes -------------------------------------------------------------------------------------------


def _varint_len(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _enc(length: int) -> int:
    """Bytes of a length-delimited field of a one-byte tag (every field here) holding `length` bytes."""
    return 1 + _varint_len(length) + length


def _alone(resource: _Resource, scope: _Scope, span_field: int) -> int:
    """The size of a request holding only a span field of `span_field` bytes of (resource, scope)."""
    return _enc(resource.fixed + _enc(scope.fixed + span_field))


class _Packer:
    """Spans in order into one request, its exact size kept as they come."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.parts: list[tuple[_Resource, list[tuple[_Scope, list[memoryview | bytes]]]]] = []
        self.spans = 0
        # (bytes of the closed ResourceSpans fields, the open ResourceSpans' length without its open
        # ScopeSpans, the open ScopeSpans' length)
        self._state = (0, 0, 0)

    def _advance(self, resource: _Resource, scope: _Scope) -> tuple[int, int, int]:
        """The state once the open resource and scope are `resource` and `scope`."""
        done, r_len, s_len = self._state
        if not self.parts or self.parts[-1][0] is not resource:
            if self.parts:
                done += _enc(r_len + _enc(s_len))
            return done, resource.fixed, scope.fixed
        if self.parts[-1][1][-1][0] is not scope:
            return done, r_len + _enc(s_len), scope.fixed
        return done, r_len, s_len

    def size_with(self, resource: _Resource, scope: _Scope, span_field: int) -> int:
        done, r_len, s_len = self._advance(resource, scope)
        return done + _enc(r_len + _enc(s_len + span_field))

    def add(self, resource: _Resource, scope: _Scope, span: memoryview | bytes) -> None:
        done, r_len, s_len = self._advance(resource, scope)
        if not self.parts or self.parts[-1][0] is not resource:
            self.parts.append((resource, []))
        scopes = self.parts[-1][1]
        if not scopes or scopes[-1][0] is not scope:
            scopes.append((scope, []))
        scopes[-1][1].append(span)
        self._state = (done, r_len, s_len + len(span))
        self.spans += 1

    def flush(self) -> EncodedTraces:
        out = []
        for resource, scopes in self.parts:
            body = [resource.head]
            for scope, spans in scopes:
                body.append(_field(_SCOPE_SPANS, b"".join([scope.head, *spans, scope.tail])))
            body.append(resource.tail)
            out.append(_field(_RESOURCE_SPANS, b"".join(body)))
        request = EncodedTraces(b"".join(out), self.spans)
        self._reset()
        return request


def _field(number: int, payload: bytes) -> bytes:
    return wire.tag(number, 2) + wire.varint_bytes(len(payload)) + payload


# -- wire parsing ------------------------------------------------------------------------------------


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(buf: memoryview):
    """(number, wire type, the whole field's bytes, its value: an int, or the payload's view)."""
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = _varint(buf, pos)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, pos = _varint(buf, pos)
        elif kind == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + length], pos + length
        elif kind in (1, 5):
            pos += 8 if kind == 1 else 4
            value = None
        else:
            raise ValueError(f"unsupported wire type {kind}")
        if pos > len(buf):
            raise ValueError("truncated field")
        yield number, kind, buf[start:pos], value


def _split_fields(buf: memoryview, number: int) -> tuple[bytes, bytes, list[memoryview]]:
    """(fields numbered below `number`, fields above it, the `number` fields: whole, or payloads)."""
    head, tail, inner = [], [], []
    for field_number, _, whole, value in _fields(buf):
        if field_number == number:
            inner.append((whole, value))
        else:
            (head if field_number < number else tail).append(bytes(whole))
    return b"".join(head), b"".join(tail), inner


def _parse(payload: bytes) -> list[_Resource]:
    buf = memoryview(payload)
    resources = []
    for number, _, _, resource_value in _fields(buf):
        if number != _RESOURCE_SPANS:
            continue  # ExportTraceServiceRequest has no other field
        head, tail, scope_fields = _split_fields(resource_value, _SCOPE_SPANS)
        scopes = []
        for _, scope_value in scope_fields:
            s_head, s_tail, spans = _split_fields(scope_value, _SPANS)
            if spans:
                scopes.append(_Scope(s_head, s_tail, [whole for whole, _ in spans]))
        if scopes:
            resources.append(_Resource(head, tail, scopes))
    return resources


def _truncate_events(
    span_field: memoryview, resource: _Resource, scope: _Scope, max_bytes: int
) -> tuple[bytes | memoryview, int]:
    """The span field keeping its first events that let it fit a request of its own within
    `max_bytes`, the others added to its dropped_events_count; and how many it left out."""
    _, pos = _varint(span_field, 1)  # past the one-byte tag: the length, then the Span
    before, events, after, dropped = [], [], [], 0
    for number, kind, whole, value in _fields(span_field[pos:]):
        if number == _EVENTS:
            events.append(whole)
        elif number == _DROPPED_EVENTS and kind == 0:
            dropped = value
        else:
            (before if number < _EVENTS else after).append(whole)
    if not events:
        return span_field, 0
    # the dropped_events_count field at its largest (every event dropped), so the sum stays an upper bound
    length = sum(map(len, before)) + sum(map(len, after)) + 1 + _varint_len(dropped + len(events))
    kept = 0
    for event in events:
        if _alone(resource, scope, _enc(length + len(event))) > max_bytes:
            break
        length += len(event)
        kept += 1
    removed = len(events) - kept
    if not removed:
        return span_field, 0
    count = wire.tag(_DROPPED_EVENTS, 0) + wire.varint_bytes(dropped + removed)
    return _field(_SPANS, b"".join([*before, *events[:kept], count, *after])), removed
