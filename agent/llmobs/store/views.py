"""Canned queries over the store: the questions `llmobs-agent query --slowest-steps` etc. answer.

Each function returns (sql, params). They read token_steps directly (not `requests`), so they answer on a
store the correlator has not visited yet; per-step work columns come from step_rollups and are NULL for
steps not yet rolled up.
"""

from __future__ import annotations

# A request instance: the trace id repeats with the prompt, the first token's forward pass does not.
REQUEST_KEY = "step_seq - coalesce(step, 0)"
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


def _usage(group_columns: tuple[str, ...], tenant: str | None, session: str | None):
    """Token usage, per-token latency p50/p99, mean loss and peak concurrency per group.

    A request is (pid, trace_id, step_seq - step): trace ids repeat when prompts do (see `requests` in
    docs/store-schema.md). Concurrency is the largest number of requests in flight at once: +1 at a request's
    first token start, -1 at its last token end, a running sum ordered by time (ends before starts at
    equal times, so back-to-back requests do not count as overlapping).
    """
    group = ", ".join(group_columns)
    sql = f"""
    WITH steps AS (SELECT * FROM token_steps WHERE {_FILTER}),
    req AS (
        SELECT {group}, pid, trace_id, {REQUEST_KEY} AS first_seq, min(t_start_ns) AS s, max(t_end_ns) AS e
        FROM steps GROUP BY ALL
    ),
    edges AS (
        SELECT {group}, s AS t, 1 AS d FROM req UNION ALL SELECT {group}, e AS t, -1 AS d FROM req
    ),
    running AS (
        SELECT {group}, sum(d) OVER (PARTITION BY {group} ORDER BY t, d ROWS UNBOUNDED PRECEDING) AS c
        FROM edges
    ),
    concurrency AS (SELECT {group}, max(c) AS concurrency FROM running GROUP BY ALL)
    SELECT {group}, count(DISTINCT (pid, trace_id, {REQUEST_KEY})) AS requests, count(*) AS tokens,
        round(count(*) / nullif((max(t_end_ns) - min(t_start_ns)) / 1e9, 0), 2) AS tokens_per_s,
        round(quantile_cont(latency_ns, 0.5) / 1e6, 3) AS p50_ms,
        round(quantile_cont(latency_ns, 0.99) / 1e6, 3) AS p99_ms,
        round(avg(loss) FILTER (NOT isnan(loss)), 4) AS mean_loss,
        any_value(c.concurrency) AS concurrency
    FROM steps JOIN concurrency c USING ({group})
    GROUP BY ALL ORDER BY tokens DESC, {group}
    """
    return sql, _params(tenant, session)


def by_tenant(tenant: str | None = None):
    return _usage(("tenant",), tenant, None)


def by_session(tenant: str | None = None, session: str | None = None):
    return _usage(("tenant", "session"), tenant, session)
