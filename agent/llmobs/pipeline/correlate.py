"""Correlation: join eBPF events and CUPTI records to token steps, and roll them up per forward pass.

Join keys, in order of trust:
1. the in-kernel tag: an event carrying (pid, step_seq) belongs to that forward pass;
2. CUPTI's external correlation id, which the collector sets to the step_seq (gpu_ops.external_id);
3. for untagged events (step_seq 0: before the first step, or a probe that could not read the cell),
   the time window [t_start_ns, t_end_ns) of the same pid's forward pass they fall in (if two passes
   of one pid overlap, the one that started last).

A forward pass (pid, step_seq) may produce several token steps (one per batch row), and in a served pass
prefill chunks without a token too; its rollup's totals are shared out to those rows by their tokens in
pass_shares (llmobs.pipeline.apportion), in the same transaction. Counts come from the exact kernel
aggregates (probe_aggregates) when the pass has
any, else estimated from the (possibly 1/N sampled, or thinned) tagged events, each counted as the
sample_ratio events it stands for; `counts_exact` says which. The joins run as SQL in
DuckDB: the agent calls `correlate()` after each batch or periodically with `since_ns` set to the
oldest step whose events may still arrive.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import duckdb

from llmobs.pipeline.apportion import WINDOW, share_passes
from llmobs.store.views import REQUEST_KEY

T = TypeVar("T")

# How much earlier than its pass's t_start_ns an event of that pass may be stamped: the tag is bumped
# just before t_start_ns is read, so the skew is tiny; 1 s is a generous bound that still lets an
# incremental run skip the old events.
EVENT_SLACK_NS = 1_000_000_000

# Every eBPF event from `$since - slack` on, up to `$events_until` (the last end of the window's passes;
# NULL: no bound), one schema: the three event tables.
_EVENTS_RANGE = f"ts_ns >= $since - {EVENT_SLACK_NS} AND ($events_until IS NULL OR ts_ns <= $events_until)"
_EVENTS = f"""
    SELECT pid, step_seq, ts_ns, probe, value, duration_ns, sample_ratio FROM mem_events
        WHERE {_EVENTS_RANGE}
    UNION ALL SELECT pid, step_seq, ts_ns, probe, value, duration_ns, sample_ratio FROM host_events
        WHERE {_EVENTS_RANGE}
    UNION ALL SELECT pid, coalesce(external_id, step_seq), ts_ns, probe, value, duration_ns, sample_ratio
        FROM gpu_ops WHERE source = 'ebpf' AND {_EVENTS_RANGE}
"""

_ROLLUP_SQL = f"""
WITH passes AS (
    SELECT pid, step_seq, count(*) FILTER (is_token) AS tokens, min(t_start_ns) AS t_start_ns,
           max(t_end_ns) AS t_end_ns, max(latency_ns) AS decode_latency_ns
    FROM (
        SELECT pid, step_seq, t_start_ns, t_end_ns, latency_ns, true AS is_token FROM token_steps
        WHERE step_seq <> 0 AND {WINDOW}
        UNION ALL  -- a pass of prefill chunks only (a served long prompt) has no token step: still a pass
        SELECT pid, step_seq, t_start_ns, t_end_ns, NULL, false FROM request_events
        WHERE kind = 'chunk' AND step_seq <> 0 AND {WINDOW}
    )
    GROUP BY pid, step_seq
),
events AS ({_EVENTS}),
tagged AS (  -- each event stands for sample_ratio events (the 1/N sampler's N, x THIN for a thinned probe)
    SELECT e.pid, e.step_seq, e.probe, sum(e.sample_ratio) AS n, sum(e.value * e.sample_ratio) AS bytes,
           sum(e.duration_ns * e.sample_ratio) AS ns
    FROM events e SEMI JOIN passes p ON e.pid = p.pid AND e.step_seq = p.step_seq
    GROUP BY ALL
),
exact AS (
    SELECT a.pid, a.step_seq, a.probe, sum(a.count) AS n, sum(a.sum_value) AS bytes,
           sum(a.sum_duration_ns) AS ns
    FROM probe_aggregates a SEMI JOIN passes p ON a.pid = p.pid AND a.step_seq = p.step_seq
    WHERE a.ts_ns IS NULL OR a.ts_ns >= $since - {EVENT_SLACK_NS}  -- read after its events happened
    GROUP BY ALL
),
exact_passes AS (SELECT DISTINCT pid, step_seq FROM exact),
per_step AS (  -- exact totals where the kernel kept them, else what the events say
    SELECT * FROM exact
    UNION ALL
    SELECT t.* FROM tagged t ANTI JOIN exact_passes x ON t.pid = x.pid AND t.step_seq = x.step_seq
),
windowed AS (  -- untagged events, placed by time in the same pid's forward pass
    -- ASOF: each event meets only the latest pass of its pid that started at or before it (a sort-merge,
    -- not events x passes), and counts if it falls before that pass's end.
    SELECT p.pid, p.step_seq, e.probe, count(*) AS n, sum(e.value) AS bytes, sum(e.duration_ns) AS ns
    FROM (SELECT * FROM events WHERE step_seq = 0) e
    ASOF JOIN passes p ON e.pid = p.pid AND e.ts_ns >= p.t_start_ns
    WHERE e.ts_ns < p.t_end_ns
    GROUP BY ALL
),
classified AS (
    SELECT pid, step_seq, probe_class(probe) AS cls, n, bytes, ns, 0 AS windowed FROM per_step
    UNION ALL
    SELECT pid, step_seq, probe_class(probe), n, bytes, ns, n FROM windowed
),
sums AS (
    SELECT pid, step_seq,
        sum(n) FILTER (cls = 'launch') AS launches,
        sum(n) FILTER (cls = 'alloc') AS allocations,
        sum(bytes) FILTER (cls = 'alloc') AS alloc_bytes,
        sum(n) FILTER (cls = 'free') AS frees,
        sum(bytes) FILTER (cls = 'memcpy') AS memcpy_bytes,
        sum(ns) FILTER (cls = 'offcpu') AS off_cpu_ns,
        sum(n) FILTER (cls = 'fault') AS page_faults,
        sum(n) FILTER (cls = 'compute') AS compute_calls,
        sum(n) - sum(windowed) AS tagged_events,
        sum(windowed) AS windowed_events
    FROM classified GROUP BY pid, step_seq
),
gpu AS (  -- device time from CUPTI records (converted to CLOCK_MONOTONIC), when CUPTI ran
    SELECT g.pid, coalesce(g.external_id, g.step_seq) AS step_seq,
           sum(g.gpu_end_ns - g.gpu_start_ns) AS gpu_ns
    FROM gpu_ops g
    WHERE g.source = 'cupti' AND g.gpu_start_ns IS NOT NULL AND g.gpu_end_ns IS NOT NULL
    GROUP BY ALL
)
SELECT p.pid, p.step_seq, p.tokens, p.t_start_ns, p.t_end_ns, p.decode_latency_ns,
    coalesce(s.launches, 0), coalesce(s.allocations, 0), coalesce(s.alloc_bytes, 0), coalesce(s.frees, 0),
    coalesce(s.memcpy_bytes, 0), coalesce(s.off_cpu_ns, 0), coalesce(s.page_faults, 0),
    coalesce(s.compute_calls, 0), g.gpu_ns, coalesce(s.tagged_events, 0), coalesce(s.windowed_events, 0),
    x.pid IS NOT NULL
FROM passes p
LEFT JOIN sums s USING (pid, step_seq)
LEFT JOIN gpu g USING (pid, step_seq)
LEFT JOIN exact_passes x USING (pid, step_seq)
"""

# Requests are derived from their token steps: one row per (pid, trace_id, first_step_seq, request_seq),
# refreshed for the requests that have steps in the window just correlated. A served request (request_seq
# <> 0: continuous batching) is its request_seq: it skips passes, so step_seq - step varies; its
# first_step_seq is its first stored token's pass. Otherwise (generate()) a request's tokens come from
# consecutive passes, so step_seq - step is the same for all of them: the pass of its first token.
_FIRST_STEP_SEQ = (
    "CASE WHEN coalesce(request_seq, 0) <> 0 THEN step_seq ELSE step_seq - coalesce(step, 0) END"
)
_WINDOW_REQUESTS = f"SELECT DISTINCT pid, trace_id, {REQUEST_KEY} FROM token_steps WHERE {WINDOW}"
# Where the steps of the window's requests begin, so the refresh below reads token_steps from there and
# not from the store's start (the whole table each run: 0.02 s of CPU with 20,000 steps stored, 0.65 s with
# 18 M, at a 2 s window of a 20k steps/s server). A request rolled up before starts where its row says: its
# steps are committed in the order they were published, so none lands before its first; one not rolled up
# yet has all its steps in this window, as LATE_NS (llmobs.pipeline.core) already assumes of a late step.
_REQUESTS_FROM_SQL = f"""
SELECT coalesce(least($since, min(t_start_ns)), $since) FROM requests
WHERE ($pid IS NULL OR pid = $pid)
    AND (pid, trace_id, CASE WHEN request_seq <> 0 THEN -request_seq ELSE first_step_seq END)
        IN ({_WINDOW_REQUESTS})
"""
_REQUESTS_SQL = f"""
INSERT OR REPLACE INTO requests (pid, trace_id, first_step_seq, tenant, session, model_id, t_start_ns,
    t_end_ns, tokens, mean_loss, request_seq)
SELECT pid, trace_id, min({_FIRST_STEP_SEQ}), any_value(tenant), any_value(session), any_value(model_id),
       min(t_start_ns), max(t_end_ns), count(*), avg(loss) FILTER (NOT isnan(loss)),
       any_value(coalesce(request_seq, 0))
FROM token_steps
WHERE t_start_ns >= $steps_from AND (pid, trace_id, {REQUEST_KEY}) IN ({_WINDOW_REQUESTS})
GROUP BY pid, trace_id, {REQUEST_KEY}
"""


# A window's token steps, and those of a forward pass (step_seq 0: before the first step, or untracked).
_COUNT_SQL = f"SELECT count(*), count(*) FILTER (step_seq <> 0) FROM token_steps WHERE {WINDOW}"

# The last end of a slice's passes (token steps, and prefill chunks that made no token): its events end there.
_PASSES_END_SQL = f"""
SELECT greatest((SELECT max(t_end_ns) FROM token_steps WHERE {WINDOW}),
                (SELECT max(t_end_ns) FROM request_events WHERE kind = 'chunk' AND {WINDOW}))
"""

# A window of more token steps than this is correlated in slices of about this many, each its own
# transaction, each run again alone if it runs out of the store's memory cap. Why: a 15 s window of a
# 20k steps/s server plus the re-rolled LATE_NS is ~400,000 pass_shares rows, and its one transaction ran
# out of the agent's 32 MB DuckDB cap in every run and was run whole again at a 256 MB headroom, which
# DuckDB then kept resident (RSS 287-424 MB). A slice's statements are bounded by its rows, so the
# headroom is too (store/sink.py HEADROOM_MEMORY_LIMIT). Slices of 16k, 32k and 64k steps ran out of the
# 32 MB cap about as often (it is shared with the writer's commits): 64k has the fewest statements.
SLICE_STEPS = 65_536


@dataclass(frozen=True)
class CorrelateStats:
    passes: int  # forward passes (re)rolled up
    tagged_events: int  # events (or exact counts) joined by tag
    windowed_events: int  # untagged events placed by time window
    orphan_events: int  # tagged events whose step has no token step (yet) in the store
    requests: int  # request rows refreshed
    slices: int = 1  # transactions the window was correlated in (SLICE_STEPS)


def correlate(
    conn: duckdb.DuckDBPyConnection,
    since_ns: int = 0,
    pid: int | None = None,
    report_since_ns: int | None = None,
    run: Callable[[Callable[[], T]], T] | None = None,
) -> CorrelateStats:
    """Recompute step_rollups and requests for the forward passes starting at or after `since_ns`
    (of one pid, or all). A window of up to SLICE_STEPS token steps is one transaction; a larger one is
    cut at pass starts into slices of about that many, each a transaction: readers never see a pass
    half-updated (its rollup without its shares), though they may see a large window's earlier slices
    updated before its later ones.

    The returned passes and tagged/windowed events cover the rollups from `report_since_ns` on
    (default: `since_ns`), read back from step_rollups (a small table), and so do the requests (those
    ending from then on; default: the rows refreshed, a request that spans slices once per slice), so a
    caller can re-roll only the last few seconds and still report a whole session; orphans cover
    `since_ns` on.

    `run`, if given, runs each slice (the store's DuckDBStore.with_headroom: a slice that runs out of the
    memory cap is run again alone, not the slices already committed).
    """
    bounds, counts = _slice_bounds(conn, since_ns, pid)
    orphans = requests = 0
    for since, until in zip(bounds, [*bounds[1:], None], strict=True):
        window = {"since": since, "until": until, "pid": pid}
        one = functools.partial(_correlate_slice, conn, window, counts if len(bounds) == 1 else None)
        slice_orphans, slice_requests = run(one) if run is not None else one()
        orphans += slice_orphans
        requests += slice_requests
    report = {"since": since_ns if report_since_ns is None else report_since_ns, "pid": pid}
    passes, tagged, windowed = conn.execute(
        "SELECT count(*), coalesce(sum(tagged_events), 0), coalesce(sum(windowed_events), 0)"
        " FROM step_rollups WHERE t_start_ns >= $since AND ($pid IS NULL OR pid = $pid)",
        report,
    ).fetchall()[0]
    if report_since_ns is not None and report_since_ns != since_ns:  # the report's window, by end
        requests = conn.execute(
            "SELECT count(*) FROM requests WHERE t_end_ns >= $since AND ($pid IS NULL OR pid = $pid)", report
        ).fetchall()[0][0]
    return CorrelateStats(int(passes), int(tagged), int(windowed), int(orphans), int(requests), len(bounds))


def _slice_bounds(
    conn: duckdb.DuckDBPyConnection, since_ns: int, pid: int | None
) -> tuple[list[int], tuple[int, int]]:
    """Where the window's slices start: [since_ns] alone for up to SLICE_STEPS token steps, else since_ns
    and the t_start_ns of every ~SLICE_STEPS-th step after it (a pass start: a pass is never cut); and the
    window's token steps and those of a pass (step_seq <> 0), counted."""
    window = {"since": since_ns, "until": None, "pid": pid}
    counts = conn.execute(_COUNT_SQL, window).fetchall()[0]
    steps = counts[0]
    if steps <= SLICE_STEPS:
        return [since_ns], counts
    slices = -(-steps // SLICE_STEPS)
    cuts = conn.execute(
        f"SELECT quantile_disc(t_start_ns, $fractions) FROM token_steps WHERE {WINDOW}",
        {**window, "fractions": [i / slices for i in range(1, slices)]},
    ).fetchall()[0][0]
    return [since_ns, *sorted({c for c in cuts if c > since_ns})], counts


def _correlate_slice(
    conn: duckdb.DuckDBPyConnection, window: dict, counts: tuple[int, int] | None = None
) -> tuple[int, int]:
    """Roll up, share and refresh the requests of the passes starting in [since, until), in one
    transaction; returns (orphan events, request rows refreshed). `counts`: the window's, counted just
    before (a window of one slice: one query a run less, ~5 us a step at a 20 steps/s target), else counted
    here. Counted before the transaction they may be off: too high (retention removed old rows meanwhile)
    costs statements that find nothing; a 0 that became more leaves those steps, none of them rolled up
    before, to the next run, whose window starts before them."""
    conn.execute("BEGIN TRANSACTION")
    try:
        # Why look first: with no token step in the window (an untracked process, an idle model) the
        # rollup query still scans every event of the window (its ASOF and semi joins do not prune on
        # an empty side) - 11-16 s over 48 M events, 114 s over 90 M - to produce nothing.
        steps, passes_now = counts if counts is not None else conn.execute(_COUNT_SQL, window).fetchall()[0]
        conn.execute(f"DELETE FROM step_rollups WHERE {WINDOW}", window)
        if not passes_now:  # a window of prefill chunks only is still passes to roll up and share
            passes_now = conn.execute(
                f"SELECT count(*) FROM request_events WHERE kind = 'chunk' AND step_seq <> 0 AND {WINDOW}",
                window,
            ).fetchall()[0][0]
        # A slice's passes read events up to the last of their ends; the last slice, to the store's end.
        events = {**window, "events_until": None}
        if passes_now and window["until"] is not None:
            events["events_until"] = conn.execute(_PASSES_END_SQL, window).fetchall()[0][0]
        if passes_now:
            conn.execute(f"INSERT OR REPLACE INTO step_rollups {_ROLLUP_SQL}", events)
        share_passes(conn, window, any_passes=bool(passes_now))  # pass_shares of the same passes
        requests = 0
        if steps:
            steps_from = conn.execute(_REQUESTS_FROM_SQL, window).fetchall()[0][0]
            requests = conn.execute(_REQUESTS_SQL, {**window, "steps_from": steps_from}).fetchall()[0][0]
        # Cheap when the events are untagged: every row group's step_seq is 0 and its zone map prunes it.
        # Counted by event time, each slice the events of [since, until).
        orphans = conn.execute(
            f"""SELECT count(*) FROM ({_EVENTS}) e
                WHERE e.step_seq <> 0 AND e.ts_ns >= $since AND ($pid IS NULL OR e.pid = $pid)
                AND NOT EXISTS (SELECT 1 FROM token_steps t
                                WHERE t.pid = e.pid AND t.step_seq = e.step_seq)""",
            {
                "since": window["since"],
                "pid": window["pid"],
                "events_until": None if window["until"] is None else window["until"] - 1,
            },
        ).fetchall()[0][0]
        conn.execute("COMMIT")
    except Exception:
        conn.execute("ROLLBACK")
        raise
    return int(orphans), int(requests)
