"""Render query results for people (an aligned table) and for programs (CSV, JSON). No dependencies."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from decimal import Decimal

MAX_CELL = 64  # a table cell longer than this is cut (CSV and JSON are never cut)


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float | Decimal):
        value = float(value)
        if math.isnan(value):
            return "nan"
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        if abs(value) >= 1e6 or abs(value) < 1e-3:
            return f"{value:.4g}"
        return f"{value:.3f}".rstrip("0").rstrip(".")
    if isinstance(value, bytes):
        return value.hex()
    text = str(value)
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def _is_number(value: object) -> bool:
    return isinstance(value, int | float | Decimal) and not isinstance(value, bool)


def render_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns aligned, numbers right-aligned, a dashed rule under the header and a row count."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(c) for c in columns]
    for row in cells:
        for i, text in enumerate(row):
            widths[i] = max(widths[i], len(text))
    numeric = [
        any(_is_number(row[i]) for row in rows) and all(row[i] is None or _is_number(row[i]) for row in rows)
        for i in range(len(columns))
    ]
    lines = [
        "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(columns, widths, numeric, strict=True))
    ]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append(
            "  ".join(t.rjust(w) if n else t.ljust(w) for t, w, n in zip(row, widths, numeric, strict=True))
        )
    lines = [line.rstrip() for line in lines]
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines) + "\n"


def render_csv(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if v is None else v.hex() if isinstance(v, bytes) else v for v in row])
    return out.getvalue()


def _json_value(value: object) -> object:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None  # JSON has no NaN
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    return str(value)


def render_json(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    records = [{c: _json_value(v) for c, v in zip(columns, row, strict=True)} for row in rows]
    return json.dumps(records, indent=1) + "\n"


RENDERERS = {"table": render_table, "csv": render_csv, "json": render_json}
