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
# A row's place in the largest-remainder order as one BIGINT: its remainder, then its row order (earlier
# first) in the low ORD_BITS. Bounds: fewer than 2^24 rows and 2^39 tokens in one pass.
ORD_BITS = 24
# Below this pass weight W, floor(T * w / W) and its remainder are exact in BIGINT as
# (T // W) * w + ((T % W) * w) // W: (T // W) * w <= T, and (T % W) * w < W^2 < 2^62. Above it (no real
# pass: 2^31 tokens) the product goes through 128-bit integers, ~3x the cost a row (and a HUGEINT pass
# weight made every row take it: ~0.5 us a row of the INSERT at a 20k steps/s server).
BIGINT_WEIGHT = 1 << 31


def _floor_and_remainder(c: str) -> tuple[str, str]:
    """SQL for floor(total_c * weight / pass_weight) and its remainder, exact for totals >= 0."""
    part = f"(total_{c} % pass_weight) * weight"
    wide = f"total_{c}::HUGEINT * weight"
    return (
        f"CASE WHEN pass_weight < {BIGINT_WEIGHT} THEN (total_{c} // pass_weight) * weight"
        f" + {part} // pass_weight ELSE ({wide} // pass_weight)::BIGINT END",
        f"CASE WHEN pass_weight < {BIGINT_WEIGHT} THEN {part} % pass_weight"
        f" ELSE ({wide} % pass_weight)::BIGINT END",
    )


def _sql() -> str:
    totals = ", ".join(f"{expr} AS total_{col}" for col, expr in SHARED_TOTALS.items())
    # floor and remainder of T * w / W, and the row's largest-remainder key
    quota = ", ".join(
        f"{floor} AS base_{c}, ({remainder} << {ORD_BITS}) + ((1 << {ORD_BITS}) - 1 - ord) AS key_{c}"
        for c in SHARED_TOTALS
        for floor, remainder in [_floor_and_remainder(c)]
    )
    # per pass: the units floor() left over (short), and the key of the short-th largest remainder; a
    # group-by and a small list sort per pass, not one window sort of all rows per column (3x faster)
    cuts = ", ".join(
        f"(any_value(total_{c}) - sum(base_{c}))::BIGINT AS short_{c},"
        f" list_sort(list(key_{c}), 'DESC')[short_{c}] AS cut_{c}"
        for c in SHARED_TOTALS
    )
    shares = ", ".join(
        f"(q.base_{c} + CASE WHEN c.short_{c} > 0 AND q.key_{c} >= c.cut_{c} THEN 1 ELSE 0 END)::BIGINT"
        f" AS {c}"
        for c in SHARED_TOTALS
    )
    return f"""
WITH passes AS (
    SELECT r.pid, r.step_seq, r.t_start_ns, {totals} FROM step_rollups r WHERE {WINDOW}
),
pass_rows AS (  -- a pass's rows: its token steps, and its prefill chunks that produced no token
    SELECT pid, step_seq, 0 AS kind_order, 'step' AS row_kind, batch_row, step, position,
        coalesce(request_seq, 0) AS request_seq, trace_id, tenant, session,
        coalesce(tokens_in_pass, 0) AS tokens
    FROM token_steps WHERE step_seq <> 0 AND {WINDOW}
    UNION ALL
    SELECT pid, step_seq, 1, 'chunk', NULL, NULL, position, request_seq, trace_id, tenant, session,
        coalesce(prefill_tokens, 0)
    FROM request_events WHERE kind = 'chunk' AND step_seq <> 0 AND {WINDOW}
),
known AS (  -- an unknown row (0 tokens) weighs the mean known row of its pass, at least 1
    SELECT pid, step_seq, greatest(coalesce(round(avg(tokens) FILTER (tokens > 0)), 1), 1)::BIGINT AS fill,
        sum(CASE WHEN tokens > 0 THEN tokens ELSE 0 END)::BIGINT AS known_weight,  -- < 2^55: 2^24 rows
        count(*) FILTER (tokens <= 0) AS unknown
    FROM pass_rows GROUP BY pid, step_seq
),
weighted AS (
    SELECT r.*, CASE WHEN r.tokens > 0 THEN r.tokens ELSE k.fill END::BIGINT AS weight,
        (k.known_weight + k.unknown * k.fill)::BIGINT AS pass_weight,
        row_number() OVER (PARTITION BY r.pid, r.step_seq
                           ORDER BY r.kind_order, r.batch_row, r.position, r.step, r.request_seq) AS ord,
        p.t_start_ns AS pass_start_ns, p.* EXCLUDE (pid, step_seq, t_start_ns)
    FROM pass_rows r JOIN known k USING (pid, step_seq) JOIN passes p USING (pid, step_seq)
),
quota AS MATERIALIZED (SELECT *, {quota} FROM weighted),  -- read twice: computed once
cut AS (SELECT pid, step_seq, {cuts} FROM quota GROUP BY pid, step_seq)
SELECT q.pid, q.step_seq, q.pass_start_ns, q.row_kind, q.batch_row, q.step, q.position, q.request_seq,
    q.trace_id, q.tenant, q.session, q.tokens, q.weight, {shares}
FROM quota q JOIN cut c USING (pid, step_seq)
"""


APPORTION_SQL = _sql()

# Where no pass in the window has more than one row (one request decoding alone: generate() of one prompt,
# a slowly stepping target), each row's weight is its pass's whole weight and the rule above gives it the
# pass's totals unchanged: a join, not the general statement, whose planning and dozen operators cost
# ~48 ms a correlate run on this project's VM however few rows (this one ~6 ms, the look ~3.5 ms).
# tests/unit/test_apportion.py checks that both give the same rows.
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
    if any_passes:
        mixed = conn.execute(_MIXED_PASSES, params).fetchall()[0][0]
        conn.execute(
            f"INSERT INTO pass_shares ({_COLUMNS}) {APPORTION_SQL if mixed else WHOLE_PASS_SQL}", params
        )
