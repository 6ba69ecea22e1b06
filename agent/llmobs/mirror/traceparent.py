"""The W3C `traceparent` both copies of a request carry, so the primary's and the shadow's records of it
share one trace id.

The client's own header is kept when it is well formed (https://www.w3.org/TR/trace-context/: lowercase
hex; version 00 with exactly four fields, or a later version, not ff, with more; trace and parent ids not
all zero - the rule llmobs.publisher.traceparent applies in the server). When it is absent, or malformed
(the servers would ignore it and the two records would not pair), the mirror makes a new one, sampled.
This is the one change the mirror makes to a request besides Host; the response is never changed.
"""

from __future__ import annotations

import os
import re

HEADER = b"traceparent"
_FORM = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.S)

KEPT, ADDED, REPLACED = "kept", "added", "replaced"


def is_valid(value: bytes) -> bool:
    match = _FORM.fullmatch(value.strip())
    if match is None:
        return False
    version, trace_id, span_id, _flags, rest = match.groups()
    return (
        version != b"ff" and not (version == b"00" and rest) and bool(int(trace_id, 16) and int(span_id, 16))
    )


def new() -> bytes:
    """A traceparent of a new trace: version 00, random trace and parent ids (never all zero), sampled."""
    while True:
        ids = os.urandom(24).hex().encode()
        if int(ids[:32], 16) and int(ids[32:], 16):
            return b"00-%s-%s-01" % (ids[:32], ids[32:])


def choose(values: list[bytes]) -> tuple[bytes, str]:
    """(the traceparent both copies get, what was done): the client's single valid header is kept; none
    is added; a malformed one, or several (W3C: not one trace context), is replaced."""
    if not values:
        return new(), ADDED
    if len(values) == 1 and is_valid(values[0]):
        return values[0].strip(), KEPT
    return new(), REPLACED


def trace_id(value: bytes) -> str:
    """The 32-hex trace id of a well-formed traceparent."""
    return value.split(b"-")[1].decode()
