"""Request labels: a request's variant and user labels, validated and bounded before they reach the map.

    with llmobs.context(variant="qlora-r8", labels={"template": "v3"}):
        ...                                   # every request started in here carries both

A label is a key and a value: keys match `[a-z][a-z0-9_.-]{0,31}`, values are strings (ints, floats and
bools are written with str()) of at most 64 utf-8 bytes, at most 8 labels a request, the variant
included (its key is `variant`). A bad label (bad key, bad or too long value, past the cap) is dropped,
counted in `dropped` and warned about once per process: it never raises into the workload. Labels of an
inner llmobs.context() are merged over the outer ones; a request's own labels over its context's.
Each label is one NAME_REQUEST_LABEL names-ring record (docs/shm-abi.md, "Request labels").
"""

from __future__ import annotations

import re
import warnings

KEY = re.compile(r"[a-z][a-z0-9_.-]{0,31}")
VARIANT = "variant"
MAX_VALUE_BYTES = 64
MAX_LABELS = 8  # a request's labels, its variant included
Labels = tuple[tuple[str, str], ...]  # validated (key, value) pairs, keys unique, the variant first

dropped = 0  # labels dropped since the process started (bad key or value, past the cap)
_warned = False


def _drop(why: str) -> None:
    global dropped, _warned
    dropped += 1
    if not _warned:
        _warned = True
        warnings.warn(
            f"llmobs: a request label was dropped ({why}); further drops are only counted "
            "(llmobs.publisher.labels.dropped)",
            stacklevel=5,
        )


def _value(value) -> str | None:
    if isinstance(value, bool | int | float):
        value = str(value)
    if not isinstance(value, str) or not value:
        return None
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate cannot be stored as utf-8
        return None
    return value if size <= MAX_VALUE_BYTES else None


def merge(base: Labels | None, variant=None, labels=None, *, max_labels: int = MAX_LABELS) -> Labels:
    """`base` (already validated) with `labels` and then `variant` merged over it; never raises."""
    try:
        merged = dict(base or ())
        # the variant first (past the cap it is the one kept); variant= wins over labels["variant"]
        items = [(VARIANT, variant)] if variant is not None else []
        if isinstance(labels, dict):
            items += [kv for kv in labels.items() if variant is None or kv[0] != VARIANT]
        elif labels is not None:
            _drop(f"labels must be a dict, not {type(labels).__name__}")
        for key, raw in items:
            if not isinstance(key, str) or KEY.fullmatch(key) is None:
                _drop(f"bad key {key!r}: keys match [a-z][a-z0-9_.-]{{0,31}}")
                continue
            value = _value(raw)
            if value is None:
                _drop(f"bad value for {key!r}: a non-empty string of at most {MAX_VALUE_BYTES} utf-8 bytes")
                continue
            if key not in merged and len(merged) >= max_labels:
                _drop(f"{key!r} is past the cap of {max_labels} labels")
                continue
            merged[key] = value
        if VARIANT in merged:  # the variant first: it is what compare groups by
            return ((VARIANT, merged.pop(VARIANT)), *merged.items())
        return tuple(merged.items())
    except Exception as exc:  # never into the workload
        _drop(repr(exc))
        return tuple(base or ())


def parse_header(text: str | None) -> dict[str, str]:
    """`k=v,k=v` (the x-llmobs-labels header, `--label k=v`) -> a dict; malformed parts are left to
    merge() to count (a part without '=' is kept as a bad key)."""
    out: dict[str, str] = {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        out[key.strip() if sep else part] = value.strip() if sep else ""
    return out


def variant_of(labels: Labels) -> str | None:
    return labels[0][1] if labels and labels[0][0] == VARIANT else None


def publish(writer, request_seq: int, labels: Labels) -> None:
    """One NAME_REQUEST_LABEL record per label of request `request_seq` (before its first step)."""
    for key, value in labels:
        writer.name_request_label(request_seq, key, value)
