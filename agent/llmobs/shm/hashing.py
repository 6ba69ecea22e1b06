"""The documented hashes of the ABI: the trace id of a prompt and the 64-bit hash of a name.

trace id  = sha256(input_ids as little-endian int64 bytes)[:16]; hi/lo words are its two big-endian
            halves, so f"{hi:016x}{lo:016x}" is the W3C hex form.
name hash = sha256(utf-8 bytes)[:8] as a little-endian u64; 0 means "no name" (and never results).
"""

from __future__ import annotations

import hashlib

import numpy as np


def trace_id(token_ids) -> bytes:
    """The 16-byte trace id of a prompt (a sequence of ints, a numpy array or a CPU tensor)."""
    if hasattr(token_ids, "detach"):  # a torch tensor: the caller moved it to the CPU already
        token_ids = token_ids.detach().numpy()
    data = np.ascontiguousarray(np.asarray(token_ids).reshape(-1), dtype="<i8").tobytes()
    return hashlib.sha256(data).digest()[:16]


def trace_words(tid: bytes) -> tuple[int, int]:
    """(trace_id_hi, trace_id_lo): the big-endian halves of a 16-byte trace id."""
    return int.from_bytes(tid[:8], "big"), int.from_bytes(tid[8:16], "big")


def trace_hex(hi: int, lo: int) -> str:
    return f"{hi:016x}{lo:016x}"


def stored_trace_hex(hi: int, lo: int) -> str:
    """A stored trace id's hex form as the store's trace_hex macro gives it: '' for none (both words 0)."""
    return "" if hi == 0 and lo == 0 else trace_hex(hi, lo)


def stored_trace_words(text: str) -> tuple[int, int] | None:
    """The two words whose stored_trace_hex is `text`; None where no pair gives it (not 32 lowercase hex
    digits): such a trace matches no stored event."""
    if text == "":
        return 0, 0
    if len(text) != 32:
        return None
    try:
        hi, lo = int(text[:16], 16), int(text[16:], 16)
    except ValueError:
        return None
    return (hi, lo) if trace_hex(hi, lo) == text else None


def name_hash(text: str | None) -> int:
    """64-bit hash of a tenant/session/model string; None or "" -> 0."""
    if not text:
        return 0
    h = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")
    return h or 1
