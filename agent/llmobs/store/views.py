"""Canned queries over the store: the questions `llmobs-agent query --slowest-steps` etc. answer.

Each function returns (sql, params). They read token_steps directly (not `requests`), so they answer on a
store the correlator has not visited yet; per-step work columns come from step_rollups and are NULL for
steps not yet rolled up.
"""

from __future__ import annotations

# A request instance, with pid and trace_id (the trace id repeats with the prompt): a served request
# (continuous batching: request_seq <> 0) is its request_seq, negated so it never meets the other kind;
# a generate() request is its first token's forward pass, step_seq - step, the same for all its tokens
# since it takes part in every pass until it ends (a served request skips passes, so it cannot be).
REQUEST_KEY = (
    "CASE WHEN coalesce(request_seq, 0) <> 0 THEN -request_seq ELSE step_seq - coalesce(step, 0) END"
)
# Optional filters shared by the views; a NULL parameter means "no filter".
_FILTER = "($tenant IS NULL OR tenant = $tenant) AND ($session IS NULL OR session = $session)"


def _params(tenant: str | None, session: str | None, **extra: object) -> dict[str, object]:
    return {"tenant": tenant, "session": session, **extra}


def slowest_steps(limit: int = 20, tenant: str | None = None, session: str | None = None):
    """The `limit` token steps with the highest decode latency, with the work their forward pass did.

    The top-N runs on token_steps alone and only its N rows are joined to rollups: on 10 M steps the
    join would otherwise dominate.
    """
    sql = f"""
    WITH slow AS (
        SELECT pid, step_seq, trace_id, tenant, session, step, token_id, latency_ns, loss, entropy
        FROM token_steps WHERE {_FILTER}
        ORDER BY latency_ns DESC NULLS LAST LIMIT $limit
    )
    SELECT s.pid, left(s.trace_id, 16) AS trace, s.tenant, s.session, s.step, s.token_id,
        round(s.latency_ns / 1e6, 3) AS latency_ms, round(s.loss, 3) AS loss, round(s.entropy, 3) AS entropy,
        r.launches, r.allocations, round(r.alloc_bytes / 1024, 1) AS alloc_kib, r.frees,
        round(r.off_cpu_ns / 1e6, 3) AS off_cpu_ms, r.page_faults, r.compute_calls,
        round(r.gpu_ns / 1e6, 3) AS gpu_ms
    FROM slow s LEFT JOIN step_rollups r USING (pid, step_seq)
    ORDER BY s.latency_ns DESC NULLS LAST
    """
    return sql, _params(tenant, session, limit=int(limit))


def top_probes(limit: int = 50):
    """Per probe: exact totals from the kernel aggregates, next to what the sampled events show."""
    sql = """
    WITH exact AS (
        SELECT probe, sum(count) AS n, count(DISTINCT (pid, step_seq)) FILTER (step_seq <> 0) AS steps,
               sum(sum_value) AS total_value, sum(sum_duration_ns) AS total_ns
        FROM probe_aggregates GROUP BY probe
    ),
    events AS (
        SELECT probe, ts_ns, value, duration_ns, sample_ratio, pid, step_seq FROM mem_events
        UNION ALL SELECT probe, ts_ns, value, duration_ns, sample_ratio, pid, step_seq FROM host_events
        UNION ALL SELECT probe, ts_ns, value, duration_ns, sample_ratio, pid, step_seq FROM gpu_ops
    ),
    sampled AS (
        SELECT probe, count(*) AS samples, sum(sample_ratio) AS estimated,
               count(DISTINCT (pid, step_seq)) FILTER (step_seq <> 0) AS steps,
               sum(value * sample_ratio) AS est_value, sum(duration_ns * sample_ratio) AS est_ns
        FROM events GROUP BY probe
    )
    SELECT probe, probe_class(probe) AS class,
        coalesce(x.n, s.estimated) AS count, x.n IS NOT NULL AS exact, coalesce(s.samples, 0) AS samples,
        coalesce(x.steps, s.steps) AS steps,
        round(coalesce(x.n, s.estimated) / nullif(coalesce(x.steps, s.steps), 0), 1) AS per_step,
        coalesce(x.total_value, s.est_value) AS total_value,
        round(coalesce(x.total_ns, s.est_ns) / 1e6, 3) AS total_ms,
        round(coalesce(x.total_ns, s.est_ns) / nullif(coalesce(x.n, s.estimated), 0) / 1e3, 3) AS mean_us
    FROM exact x FULL OUTER JOIN sampled s USING (probe)
    ORDER BY count DESC NULLS LAST, probe
    LIMIT $limit
    """
    return sql, {"limit": int(limit)}


# What the views need of the store's schema: token_steps.request_seq (migration 8) for the request key,
# pass_shares (migration 9) for the compute columns. An older store, opened read-only (readers never
# migrate), gets the generate() key and NULL compute columns instead of a failed query.
LEGACY_REQUEST_KEY = "step_seq - coalesce(step, 0)"
REQUEST_SEQ_VERSION = 8
SHARES_VERSION = 9  # pass_shares (migration 9)
_NO_SHARES = """SELECT NULL::VARCHAR AS tenant, NULL::VARCHAR AS session, 0::BIGINT AS weight,
    0::BIGINT AS compute_ns, 0::BIGINT AS off_cpu_ns, NULL::BIGINT AS gpu_ns, 0::BIGINT AS allocations,
    0::BIGINT AS alloc_bytes WHERE false"""


def _usage(group_columns: tuple[str, ...], tenant: str | None, session: str | None, version: int):
    """Token usage, per-token latency p50/p99, mean loss, peak concurrency, and the group's share of the
    forward passes' work (compute-, off-CPU and GPU-seconds, allocations, tokens processed), per group.

    A request is REQUEST_KEY with pid and trace_id: trace ids repeat when prompts do (see `requests` in
    docs/store-schema.md). Concurrency is the largest number of requests in flight at once: +1 at a request's
    first token start, -1 at its last token end, a running sum ordered by time (ends before starts at
    equal times, so back-to-back requests do not count as overlapping).

    The work columns add up the group's rows of pass_shares (each forward pass's exact totals shared by
    tokens: llmobs.pipeline.apportion); a `*_pct` is the group's percentage of the whole store's total
    (all tenants, whatever --tenant/--session select), so the groups of an unfiltered query add up to
    100. They are NULL until correlate has shared the passes, and for a store older than pass_shares.
    """
    group = ", ".join(group_columns)
    key = REQUEST_KEY if version >= REQUEST_SEQ_VERSION else LEGACY_REQUEST_KEY
    shares = "SELECT * FROM pass_shares" if version >= SHARES_VERSION else _NO_SHARES
    matches = " AND ".join(f"u.{c} IS NOT DISTINCT FROM w.{c}" for c in group_columns)
    sql = f"""
    WITH steps AS (SELECT * FROM token_steps WHERE {_FILTER}),
    req AS (
        SELECT {group}, pid, trace_id, {key} AS first_seq, min(t_start_ns) AS s, max(t_end_ns) AS e
        FROM steps GROUP BY ALL
    ),
    edges AS (
        SELECT {group}, s AS t, 1 AS d FROM req UNION ALL SELECT {group}, e AS t, -1 AS d FROM req
    ),
    running AS (
        SELECT {group}, sum(d) OVER (PARTITION BY {group} ORDER BY t, d ROWS UNBOUNDED PRECEDING) AS c
        FROM edges
    ),
    concurrency AS (SELECT {group}, max(c) AS concurrency FROM running GROUP BY ALL),
    usage AS (
        SELECT {group}, count(DISTINCT (pid, trace_id, {key})) AS requests, count(*) AS tokens,
            round(count(*) / nullif((max(t_end_ns) - min(t_start_ns)) / 1e9, 0), 2) AS tokens_per_s,
            round(quantile_cont(latency_ns, 0.5) / 1e6, 3) AS p50_ms,
            round(quantile_cont(latency_ns, 0.99) / 1e6, 3) AS p99_ms,
            round(avg(loss) FILTER (NOT isnan(loss)), 4) AS mean_loss,
            any_value(c.concurrency) AS concurrency
        FROM steps JOIN concurrency c USING ({group})
        GROUP BY ALL
    ),
    all_shares AS ({shares}),
    work AS (
        SELECT {group}, sum(weight) AS processed, sum(compute_ns) AS compute_ns,
            sum(off_cpu_ns) AS off_cpu_ns,
            sum(gpu_ns) AS gpu_ns, sum(allocations) AS allocations, sum(alloc_bytes) AS alloc_bytes
        FROM all_shares WHERE {_FILTER} GROUP BY ALL
    ),
    total AS (
        SELECT sum(weight) AS processed, sum(compute_ns) AS compute_ns, sum(off_cpu_ns) AS off_cpu_ns,
            sum(gpu_ns) AS gpu_ns, sum(allocations) AS allocations
        FROM all_shares
    )
    SELECT u.*,
        round(w.compute_ns / 1e9, 3) AS compute_s,
        round(100 * w.compute_ns / nullif(t.compute_ns, 0), 2) AS compute_pct,
        round(w.off_cpu_ns / 1e9, 3) AS off_cpu_s,
        round(100 * w.off_cpu_ns / nullif(t.off_cpu_ns, 0), 2) AS off_cpu_pct,
        round(w.gpu_ns / 1e9, 3) AS gpu_s,
        round(100 * w.gpu_ns / nullif(t.gpu_ns, 0), 2) AS gpu_pct,
        w.allocations, round(100 * w.allocations / nullif(t.allocations, 0), 2) AS alloc_pct,
        round(w.alloc_bytes / 2 ^ 20, 1) AS alloc_mib,
        w.processed, round(100 * w.processed / nullif(t.processed, 0), 2) AS processed_pct
    FROM usage u LEFT JOIN work w ON {matches} CROSS JOIN total t
    ORDER BY u.tokens DESC, {", ".join(f"u.{c}" for c in group_columns)}
    """
    return sql, _params(tenant, session)


def by_tenant(tenant: str | None = None, version: int = SHARES_VERSION):
    return _usage(("tenant",), tenant, None, version)


def by_session(tenant: str | None = None, session: str | None = None, version: int = SHARES_VERSION):
    return _usage(("tenant", "session"), tenant, session, version)


def request_variants(catalog: str = "") -> str:
    """SQL (a SELECT, for a CTE or a view) of every request with a request_seq and its variant: (pid,
    request_seq, trace_id, variant, model_id). The one rule (docs/compare.md): a request's variant is
    its `variant` label if it has one, else its model id. Requests come from their token steps and from
    request-end rows (a served request that failed before its first token has no step); a generate()
    request without a request_seq has no labels, so its variant is its token steps' model_id.

    `catalog`: the attached database to read ("" = the connection's own); it needs migration 13.
    """
    p = f"{catalog}." if catalog else ""
    return f"""
    WITH seen AS (
        SELECT pid, request_seq, any_value(trace_id) AS trace_id, any_value(model_id) AS model_id
        FROM {p}token_steps WHERE request_seq <> 0 GROUP BY pid, request_seq
        UNION ALL
        SELECT pid, request_seq, any_value(trace_id), any_value(model_id)
        FROM {p}request_events WHERE kind = 'end' AND request_seq <> 0 GROUP BY pid, request_seq
    ),
    req AS (
        SELECT pid, request_seq, any_value(trace_id) AS trace_id, max(model_id) AS model_id
        FROM seen GROUP BY pid, request_seq
    )
    SELECT r.pid, r.request_seq, r.trace_id, coalesce(l.value, r.model_id) AS variant, r.model_id
    FROM req r LEFT JOIN {p}request_labels l
        ON l.pid = r.pid AND l.request_seq = r.request_seq AND l.key = 'variant'
    """
