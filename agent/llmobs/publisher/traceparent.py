"""W3C Trace Context `traceparent` values: parsed once where a caller hands one in (llmobs.context).

    00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01
    version-trace id (32 hex)-parent span id (16 hex)-flags (2 hex)

Accepted (https://www.w3.org/TR/trace-context/#traceparent-header): lowercase hex; version 00 with exactly
these four fields, or a later version (not ff) whose extra fields, after a "-", are ignored; trace id and
parent id not all zero. Anything else is malformed: the caller's request then keeps llmobs' own
(prompt-hash) trace id, and the malformed value is counted in `malformed` and warned about once - never
an error, since the value comes from a client the workload does not control.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

_FORM = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.S)
TEXT_CHARS = 55  # "00-" + 32 + "-" + 16 + "-" + 2

malformed = 0  # traceparent values that were ignored (the request went on with its default trace id)
_warned = False


@dataclass(frozen=True)
class TraceParent:
    trace_hi: int  # trace id bytes 0..7, big-endian: the map's trace_id_hi word
    trace_lo: int
    parent_span_id: int  # the caller's span (the parent of llmobs' request span)
    flags: int  # trace-flags (bit 0: sampled)

    @property
    def trace_id(self) -> str:
        return f"{self.trace_hi:016x}{self.trace_lo:016x}"

    @property
    def span_id(self) -> str:
        return f"{self.parent_span_id:016x}"

    def text(self) -> str:
        """The version-00 form (what the names ring carries)."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"


def parse(value: str | None) -> TraceParent | None:
    """The TraceParent `value` holds, or None when it is absent or malformed (never raises)."""
    if value is None:
        return None
    try:
        match = _FORM.fullmatch(value.strip()) if isinstance(value, str) else None
        if match is not None:
            version, trace, span, flags, rest = match.groups()
            if version != "ff" and not (version == "00" and rest) and int(trace, 16) and int(span, 16):
                return TraceParent(int(trace[:16], 16), int(trace[16:], 16), int(span, 16), int(flags, 16))
    except Exception:  # a str subclass with odd behaviour: malformed, like anything else
        pass
    _count_malformed(value)
    return None


def _count_malformed(value: object) -> None:
    global malformed, _warned
    malformed += 1
    if not _warned:
        _warned = True
        shown = repr(value)[:80]
        warnings.warn(
            f"llmobs: ignored a malformed traceparent {shown} (counted; the request keeps its default "
            "trace id)",
            stacklevel=4,
        )
