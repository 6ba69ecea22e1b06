"""Apportionment: each forward pass's exact totals shared out to the rows of the pass, by the tokens each
row processed in it, into `pass_shares` (store migration 9; the rule is in docs/store-schema.md).

Why: a continuously batching server runs prefill chunks and decodes of many requests, of many tenants,
in one forward pass; the kernel tags the pass's work with its step_seq only (the context cell of a mixed
pass has no single trace id). Charging the pass to each of its rows would count it once per row; charging
it by rows would let a 512-token prefill chunk cost what one decode token costs. Tokens are what the
pass's compute is proportional to, to first order.

The rule, per pass (pid, step_seq):
- its rows are its token steps and its prefill chunks that produced no token (request_events 'chunk');
- a row's weight is the tokens it processed in the pass (`tokens_in_pass`; a chunk's `prefill_tokens`).
  A row with 0 (unknown: a v2 map, a manual `req.step`, `generate()`) weighs the mean of the pass's
  known rows, rounded, at least 1; a pass with no known row therefore splits evenly (one request per
  pass, as `generate()` publishes, keeps the whole pass: today's per-request numbers);
- each integer total T (nanoseconds and counts) goes to the rows as floor(T * w / W) plus one unit to
  the T - sum(floors) rows with the largest remainders (T * w mod W; ties by row order): largest
  remainder, so a pass's shares add up to T exactly and each is within 1 of its exact quota. Seconds
  are these integer nanoseconds / 1e9, so they add up exactly too (before the division's rounding).
- gpu_ns stays NULL where the pass has none (no CUPTI).

compute_ns is the pass's duration (t_end_ns - t_start_ns of its step_rollups row): the time the engine
spent on the pass, which its rows share. No probe counts a pass's on-CPU time; off-CPU time (sched_switch
intervals of the process's threads tagged with the pass) is apportioned separately.
"""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa

# pass_shares column -> the pass's total, from its step_rollups row `r`
SHARED_TOTALS: dict[str, str] = {
    "compute_ns": "greatest(r.t_end_ns - r.t_start_ns, 0)",
    "off_cpu_ns": "r.off_cpu_ns",
    "allocations": "r.allocations",
    "alloc_bytes": "r.alloc_bytes",
    "compute_calls": "r.compute_calls",
    "launches": "r.launches",
    "gpu_ns": "r.gpu_ns",
}


def window(table: str = "") -> str:
    """The rows of a correlate window, as a predicate on `table`'s columns (a name or alias; none:
    unqualified): passes starting in [$since, $until) ($until NULL: from $since on), of $pid (NULL: every
    pid). Every row of a pass carries the pass's t_start_ns (one publish per pass): a bound never splits a
    pass."""
    t = f"{table}." if table else ""
    return (
        f"{t}t_start_ns >= $since AND ($until IS NULL OR {t}t_start_ns < $until)"
        f" AND ($pid IS NULL OR {t}pid = $pid)"
    )


WINDOW = window()
# Below this pass weight W, floor(T * w / W) and its remainder are exact in 64-bit integers as
# (T // W) * w + ((T % W) * w) // W: (T // W) * w <= T, and (T % W) * w < W^2 < 2^62. A pass at or above it
# (no real pass: 2^31 tokens) is computed in Python integers.
BIGINT_WEIGHT = 1 << 31
# Sorts after every batch_row, step and position: a chunk's (NULL) ones, as DuckDB orders NULLs last.
_NULL_LAST = (1 << 62) - 1

# Each total as a BIGINT (NULL as 0) and whether it was NULL (a pass without CUPTI has no gpu_ns).
_TOTALS_AND_NULLS = ", ".join(
    f"coalesce(p.total_{c}, 0)::BIGINT AS total_{c}, p.total_{c} IS NULL AS null_{c}" for c in SHARED_TOTALS
)
# The rows of the window's passes, with what the rule needs: a token step or a chunk that produced no token,
# its tokens, its place in the row order (NULLs sort last), and its pass's totals (NULL and 0 apart).
_ROWS_SQL = f"""
WITH passes AS (
    SELECT r.pid, r.step_seq, r.t_start_ns, {", ".join(f"{e} AS total_{c}" for c, e in SHARED_TOTALS.items())}
    FROM step_rollups r WHERE {WINDOW}
),
pass_rows AS (  -- a pass's rows: its token steps, and its prefill chunks that produced no token
    SELECT pid, step_seq, 0 AS kind_order, 'step' AS row_kind, batch_row, step, position,
        coalesce(request_seq, 0) AS request_seq, trace_id, tenant, session,
        coalesce(tokens_in_pass, 0)::BIGINT AS tokens
    FROM token_steps WHERE step_seq <> 0 AND {WINDOW}
    UNION ALL
    SELECT pid, step_seq, 1, 'chunk', NULL, NULL, position, request_seq, trace_id, tenant, session,
        coalesce(prefill_tokens, 0)::BIGINT
    FROM request_events WHERE kind = 'chunk' AND step_seq <> 0 AND {WINDOW}
)
SELECT r.pid, r.step_seq, p.t_start_ns, r.row_kind, r.batch_row, r.step, r.position, r.request_seq,
    r.trace_id, r.tenant, r.session, r.tokens, r.kind_order,
    coalesce(r.batch_row, {_NULL_LAST})::BIGINT AS order_batch_row,
    coalesce(r.position, {_NULL_LAST})::BIGINT AS order_position,
    coalesce(r.step, {_NULL_LAST})::BIGINT AS order_step,
    {_TOTALS_AND_NULLS}
FROM pass_rows r JOIN passes p USING (pid, step_seq)
"""

# Where no pass in the window has more than one row (one request decoding alone: generate() of one prompt,
# a slowly stepping target), each row's weight is its pass's whole weight and the rule above gives it the
# pass's totals unchanged: a join, not the general rule's fetch, numpy and insert (its SQL form's planning
# and dozen operators cost ~48 ms a correlate run on this project's VM however few rows; this one ~6 ms,
# the look ~3.5 ms). tests/unit/test_apportion.py checks that both give the same rows.
_MIXED_PASSES = f"""
SELECT EXISTS (SELECT 1 FROM token_steps WHERE step_seq <> 0 AND {WINDOW}
               GROUP BY pid, step_seq HAVING count(*) > 1)
    OR EXISTS (SELECT 1 FROM request_events WHERE kind = 'chunk' AND step_seq <> 0 AND {WINDOW})
"""
WHOLE_PASS_SQL = f"""
SELECT t.pid, t.step_seq, r.t_start_ns, 'step', t.batch_row, t.step, t.position, coalesce(t.request_seq, 0),
    t.trace_id, t.tenant, t.session, coalesce(t.tokens_in_pass, 0) AS tokens,
    greatest(coalesce(t.tokens_in_pass, 0), 1)::BIGINT AS weight,  -- an unknown (0) row alone weighs 1
    {", ".join(f"({expr})::BIGINT AS {col}" for col, expr in SHARED_TOTALS.items())}
FROM token_steps t JOIN step_rollups r USING (pid, step_seq)
WHERE t.step_seq <> 0 AND {window("t")} AND {window("r")}
"""
_COLUMNS = (
    "pid, step_seq, t_start_ns, row_kind, batch_row, step, position, request_seq, trace_id, tenant, session,"
    f" tokens, weight, {', '.join(SHARED_TOTALS)}"
)


def share_passes(conn: duckdb.DuckDBPyConnection, params: dict, any_passes: bool = True) -> None:
    """Recompute pass_shares for the passes correlate just rolled up (step_rollups rows starting in
    [params['since'], params['until']), of params['pid'] or all): call inside correlate's transaction,
    after the rollups, so readers see shares and rollups of the same passes together."""
    conn.execute(f"DELETE FROM pass_shares WHERE {WINDOW}", params)
    if not any_passes:
        return
    if not conn.execute(_MIXED_PASSES, params).fetchall()[0][0]:
        conn.execute(f"INSERT INTO pass_shares ({_COLUMNS}) {WHOLE_PASS_SQL}", params)
        return
    rows = conn.sql(_ROWS_SQL, params=params).to_arrow_table()
    if rows.num_rows:
        conn.register("_pass_shares", shares(rows))
        try:
            conn.execute(f"INSERT INTO pass_shares ({_COLUMNS}) SELECT * FROM _pass_shares")
        finally:
            conn.unregister("_pass_shares")


def shares(rows: pa.Table) -> pa.Table:
    """The rule applied to the rows of whole passes (_ROWS_SQL's columns, any order): pass_shares' columns.
    In numpy, not SQL: the statement (a window for the row order, a list sort per pass and column) was
    most of a correlate run at a 20k steps/s server (1.96 of 2.38 s of CPU for a 21 s window)."""
    n = rows.num_rows
    col = {name: rows.column(name).to_numpy() for name in ("pid", "step_seq", "tokens", "kind_order",
           "order_batch_row", "order_position", "order_step", "request_seq")}  # fmt: skip
    # rows in row order within their pass; pass p's rows are order[starts[p]:starts[p + 1]]
    order = np.lexsort(tuple(col[k] for k in ("request_seq", "order_step", "order_position",
                       "order_batch_row", "kind_order", "step_seq", "pid")))  # fmt: skip
    pid, seq, tokens = col["pid"][order], col["step_seq"][order], col["tokens"][order]
    first = np.ones(n, bool)
    first[1:] = (pid[1:] != pid[:-1]) | (seq[1:] != seq[:-1])
    starts = np.flatnonzero(first)
    pass_of = np.cumsum(first) - 1
    rank = np.arange(n) - starts[pass_of]  # 0 for the pass's first row
    # an unknown row (0 tokens) weighs the mean known row of its pass, rounded half up, at least 1
    known = tokens > 0
    known_weight = np.add.reduceat(np.where(known, tokens, 0), starts)
    known_rows = np.add.reduceat(known.astype(np.int64), starts)
    unknown_rows = np.diff(np.append(starts, n)) - known_rows
    mean = known_weight / np.maximum(known_rows, 1)
    fill = np.where(known_rows > 0, np.maximum(np.floor(mean + 0.5), 1), 1).astype(np.int64)
    weight = np.where(known, tokens, fill[pass_of])
    pass_weight = (known_weight + unknown_rows * fill)[pass_of]
    unsorted = np.empty_like(order)  # the inverse of order: a sorted array, back in the rows' order
    unsorted[order] = np.arange(n)
    out = {}
    for c in SHARED_TOTALS:
        total = rows.column(f"total_{c}").to_numpy()[order]
        share = _largest_remainder(total, weight, pass_weight, starts, pass_of, rank)[unsorted]
        out[c] = pa.array(share, mask=rows.column(f"null_{c}").to_numpy(zero_copy_only=False))
    kept = ("pid", "step_seq", "t_start_ns", "row_kind", "batch_row", "step", "position", "request_seq",
            "trace_id", "tenant", "session", "tokens")  # fmt: skip
    return pa.table({**{k: rows.column(k) for k in kept}, "weight": weight[unsorted], **out})


def _largest_remainder(total, weight, pass_weight, starts, pass_of, rank) -> np.ndarray:
    """floor(T * w / W) for each row, plus one unit to each of the T - sum(floors) rows of its pass with
    the largest remainders (ties to the earlier row). Rows sorted by pass, then row order; `total` is the
    row's pass's T, `rank` the row's place in its pass."""
    base, remainder = np.empty_like(total), np.empty_like(total)
    narrow = pass_weight < BIGINT_WEIGHT
    t, w, big_w = total[narrow], weight[narrow], pass_weight[narrow]
    part = (t % big_w) * w
    base[narrow] = (t // big_w) * w + part // big_w
    remainder[narrow] = part % big_w
    if not narrow.all():  # Python integers: T * w may pass 2^63
        wide = ~narrow
        product = total[wide].astype(object) * weight[wide].astype(object)
        big_w = pass_weight[wide].astype(object)
        base[wide] = (product // big_w).astype(np.int64)
        remainder[wide] = (product % big_w).astype(np.int64)
    short = total[starts] - np.add.reduceat(base, starts)  # units floor() left over, per pass
    # each row's place among its pass's rows by remainder, largest first, ties in row order
    by_remainder = np.lexsort((rank, -remainder, pass_of))
    place = np.empty_like(rank)
    place[by_remainder] = np.arange(len(rank)) - starts[pass_of[by_remainder]]
    return base + (place < short[pass_of])
