"""The exporter's per-batch fold (otlp.source._fold), column-wise, against the row-by-row loop it
replaced (kept here as the reference): the same request aggregates, in the same order, and the same
cursor row per pid, on random batches with empty and NULL texts, NaN and NULL losses, served steps
(request_seq) and ties in the cursor key."""

from __future__ import annotations

import math
import random

import pyarrow as pa
import pytest
from llmobs.otlp.source import _fold

TEXTS = ("tenant", "session", "model_id")


def reference_fold(table: pa.Table):
    folded: dict = {}
    advance: dict = {}
    rows = table.to_pylist()
    for row in rows:
        if row.get("request_seq"):
            continue
        loss = row["loss"]
        has_loss = loss is not None and loss == loss
        key = (row["pid"], row["trace_id"])
        agg = folded.get(key)
        if agg is None:
            folded[key] = {
                "pid": row["pid"], "trace_id": row["trace_id"],
                **{name: row[name] for name in TEXTS},
                "t_start_ns": row["t_start_ns"], "t_end_ns": row["t_end_ns"], "tokens": 1,
                "loss_sum": float(loss) if has_loss else 0.0, "loss_count": int(has_loss), "exported": False,
            }  # fmt: skip
            continue
        agg["t_start_ns"] = min(agg["t_start_ns"], row["t_start_ns"])
        agg["t_end_ns"] = max(agg["t_end_ns"], row["t_end_ns"])
        agg["tokens"] += 1
        if has_loss:
            agg["loss_sum"] += float(loss)
            agg["loss_count"] += 1
        for name in TEXTS:
            agg[name] = agg[name] or row[name]
    for row in rows:
        key = (row["t_start_ns"], row["step_seq"], row["batch_row"])
        prev = advance.get(row["pid"])
        if prev is None:
            advance[row["pid"]] = (*key, 1, row["ingest_seq"])
        elif key > prev[:3]:
            advance[row["pid"]] = (*key, prev[3] + 1, max(prev[4], row["ingest_seq"]))
        else:
            advance[row["pid"]] = (*prev[:3], prev[3] + 1, max(prev[4], row["ingest_seq"]))
    return folded, advance


def random_batch(rng: random.Random, rows: int, served: bool) -> pa.Table:
    columns: dict[str, list] = {name: [] for name in (
        "pid", "trace_id", *TEXTS, "t_start_ns", "t_end_ns", "loss", "step_seq", "batch_row", "ingest_seq"
    )}  # fmt: skip
    if served:
        columns["request_seq"] = []
    for index in range(rows):
        columns["pid"].append(rng.choice((101, 202, 303)))
        columns["trace_id"].append(rng.choice(("", "a" * 32, "b" * 32, "c" * 32)))
        for name in TEXTS:
            columns[name].append(rng.choice((None, "", "acme", "globex")))
        start = rng.randrange(1_000, 1_050)  # few distinct: ties in the cursor key
        columns["t_start_ns"].append(start)
        columns["t_end_ns"].append(start + rng.randrange(0, 30))
        columns["loss"].append(rng.choice((None, math.nan, rng.random() * 5)))
        columns["step_seq"].append(rng.randrange(0, 4))
        columns["batch_row"].append(rng.randrange(0, 3))
        columns["ingest_seq"].append(rng.randrange(1, 10_000) + index)
        if served:
            columns["request_seq"].append(rng.choice((None, 0, 0, 7)))
    types = {"loss": pa.float32(), "request_seq": pa.int64()}
    return pa.table({name: pa.array(values, types.get(name)) for name, values in columns.items()})


@pytest.mark.parametrize("seed", range(40))
def test_fold_equals_the_row_by_row_loop(seed):
    rng = random.Random(seed)
    table = random_batch(rng, rng.choice((1, 2, 17, 300)), served=seed % 2 == 0)
    folded, advance = _fold(table)
    want_folded, want_advance = reference_fold(table)
    assert list(folded) == list(want_folded)  # the order of first appearance
    for key, want in want_folded.items():
        got = folded[key]
        assert got["loss_sum"] == pytest.approx(want["loss_sum"], rel=1e-12, abs=1e-12)
        assert {k: v for k, v in got.items() if k != "loss_sum"} == {
            k: v for k, v in want.items() if k != "loss_sum"
        }
    assert advance == want_advance


def test_fold_of_an_empty_batch():
    assert _fold(random_batch(random.Random(0), 0, served=True)) == ({}, {})
