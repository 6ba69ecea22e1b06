"""The serving demo's report, built from a store: per tenant the requests, tokens, time to first token and
per output token (p50 / p99), compute share and prefix-cache hits; then the slowest requests and why.

Every figure is SQL over the store (docs/store-schema.md): a served request's own figures come from its
`request_events` END row (queue, TTFT, TPOT, prompt and prefill tokens, prefix hits, finish reason), its
tokens are its `token_steps` rows (pid, request_seq), a tenant's compute is the sum of its rows' shares of
each forward pass (`pass_shares`, each pass's exact totals split by the tokens each row processed). A store
without `pass_shares` rows shows the tenants' shares of the tokens processed instead, and says so.
Percentiles are DuckDB's `quantile_disc` (an observed value, nearest rank below).

Why a request was slow: its time split into queue (arrival to first scheduled), prefill (to its first
token) and decode (first to last token), against the median request; what ran meanwhile (the passes and
the other requests' rows it shared them with); and its slowest token step explained by the same probe
comparison as the generation demo's report (llmobs.report.text.why_slow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import duckdb

from llmobs.report.text import Token, _medians, _table, why_slow

SLOWEST_REQUESTS = 3
NO_TENANT = "(none)"  # a request sent without an x-llmobs-tenant header
# The engine's own thread runs every forward pass (not the main thread, which serves HTTP): its off-CPU
# time is the one that says why a pass was slow; the exact totals sum every thread, idle ones included.
ENGINE_OFFCPU = "sched_switch (engine thread)"

_TENANTS_SQL = """
WITH ends AS (
    SELECT coalesce(nullif(tenant, ''), ?) AS tenant, * EXCLUDE (tenant)
    FROM request_events WHERE kind = 'end' AND (? IS NULL OR pid = ?)),
steps AS (
    SELECT coalesce(nullif(tenant, ''), ?) AS tenant, count(*) AS tokens
    FROM token_steps WHERE request_seq <> 0 AND (? IS NULL OR pid = ?) GROUP BY 1)
SELECT e.tenant, count(*) AS requests, any_value(s.tokens) AS tokens,
    count(*) FILTER (WHERE finish_reason IN ('error', 'cancelled')) AS failed,
    sum(prompt_tokens) AS prompt_tokens, sum(prefix_hit_tokens) AS prefix_hit_tokens,
    quantile_disc(ttft_ns, 0.5) FILTER (WHERE ttft_ns >= 0) AS ttft_p50,
    quantile_disc(ttft_ns, 0.99) FILTER (WHERE ttft_ns >= 0) AS ttft_p99,
    quantile_disc(tpot_ns, 0.5) FILTER (WHERE tpot_ns >= 0) AS tpot_p50,
    quantile_disc(tpot_ns, 0.99) FILTER (WHERE tpot_ns >= 0) AS tpot_p99
FROM ends e LEFT JOIN steps s USING (tenant)
GROUP BY e.tenant ORDER BY e.tenant
"""
# Each tenant's compute: its rows' shares of every pass's exact totals (pass_shares, migration 9).
_SHARES_SQL = """
SELECT coalesce(nullif(tenant, ''), ?) AS tenant, sum(compute_ns), sum(tokens)
FROM pass_shares WHERE (? IS NULL OR pid = ?) GROUP BY 1
"""
# Without pass_shares: the tokens each tenant's rows processed (token steps and prefill chunks).
_TOKEN_SHARES_SQL = """
SELECT tenant, sum(tokens) FROM (
    SELECT coalesce(nullif(tenant, ''), ?) AS tenant, tokens_in_pass AS tokens
    FROM token_steps WHERE request_seq <> 0 AND (? IS NULL OR pid = ?)
    UNION ALL
    SELECT coalesce(nullif(tenant, ''), ?), prefill_tokens
    FROM request_events WHERE kind = 'chunk' AND (? IS NULL OR pid = ?))
GROUP BY 1
"""
_ENDS_SQL = """
SELECT pid, request_seq, request_id, trace_id, coalesce(nullif(tenant, ''), ?) AS tenant, session,
    t_start_ns, t_scheduled_ns, t_first_token_ns, t_last_token_ns, t_end_ns, queue_ns, ttft_ns, tpot_ns,
    prompt_tokens, prefill_tokens, decoded_tokens, prefix_hit_tokens, kv_blocks, finish_reason
FROM request_events WHERE kind = 'end' AND (? IS NULL OR pid = ?)
ORDER BY t_end_ns - t_start_ns DESC, request_seq
"""
# The rows of every pass: its token steps and its prefill chunks (what its totals are split over).
_PASS_ROWS_SQL = """
SELECT pid, step_seq, request_seq, tokens FROM (
    SELECT pid, step_seq, request_seq, tokens_in_pass AS tokens FROM token_steps
    WHERE request_seq <> 0 AND (? IS NULL OR pid = ?)
    UNION ALL
    SELECT pid, step_seq, request_seq, prefill_tokens FROM request_events
    WHERE kind = 'chunk' AND (? IS NULL OR pid = ?))
"""
_PASSES_SQL = """
SELECT pid, step_seq, t_start_ns, t_end_ns FROM step_rollups WHERE (? IS NULL OR pid = ?)
"""
_TOKENS_SQL = """
SELECT t.pid, t.request_seq, t.step_seq, t.step, t.position, t.token_id, t.loss, t.entropy, t.target_prob,
    t.latency_ns, t.t_start_ns, r.allocations, r.alloc_bytes, r.off_cpu_ns, r.page_faults, r.compute_calls
FROM token_steps t LEFT JOIN step_rollups r USING (pid, step_seq)
WHERE t.request_seq <> 0 AND (? IS NULL OR t.pid = ?)
ORDER BY t.pid, t.request_seq, t.step
"""
_PROBES_SQL = """
SELECT pid, step_seq, probe, sum(count), sum(sum_value), sum(sum_duration_ns)
FROM probe_aggregates WHERE step_seq <> 0 AND (? IS NULL OR pid = ?) GROUP BY ALL
"""
# The engine thread: the one whose sampled compute events (the linear layers' GEMMs) are the most.
_ENGINE_OFFCPU_SQL = """
WITH engine AS (
    SELECT pid, arg_max(tid, n) AS tid FROM (
        SELECT pid, tid, count(*) AS n FROM host_events
        WHERE kind = 'compute' AND (? IS NULL OR pid = ?) GROUP BY ALL)
    GROUP BY pid)
SELECT h.pid, h.step_seq, sum(h.sample_ratio), sum(h.duration_ns * h.sample_ratio)
FROM host_events h JOIN engine e ON h.pid = e.pid AND h.tid = e.tid
WHERE h.probe = 'sched_switch' AND h.step_seq <> 0 GROUP BY ALL
"""


@dataclass
class TenantRow:
    tenant: str
    requests: int
    tokens: int
    failed: int
    prompt_tokens: int
    prefix_hit_tokens: int
    ttft_p50: int | None
    ttft_p99: int | None
    tpot_p50: int | None
    tpot_p99: int | None
    compute_ns: int | None = None  # its rows' shares of the passes' exact totals (None: no pass_shares)
    share: float | None = None  # of the compute, or (no pass_shares) of the tokens processed


def _table_exists(conn: duckdb.DuckDBPyConnection, table: str) -> bool:
    sql = "SELECT count(*) FROM information_schema.tables WHERE table_name = ?"
    return bool(conn.execute(sql, [table]).fetchall()[0][0])


def tenant_rows(conn: duckdb.DuckDBPyConnection, pid: int | None = None) -> tuple[list[TenantRow], str]:
    """Per tenant its figures, and what its share is of: 'compute' (pass_shares) or 'tokens'."""
    rows = [
        TenantRow(*(0 if v is None and i in (2, 3, 4, 5) else v for i, v in enumerate(r)))
        for r in conn.execute(_TENANTS_SQL, [NO_TENANT, pid, pid, NO_TENANT, pid, pid]).fetchall()
    ]
    shares: dict[str, float] = {}
    basis = "tokens"
    if _table_exists(conn, "pass_shares"):
        found = conn.execute(_SHARES_SQL, [NO_TENANT, pid, pid]).fetchall()
        if found and sum(ns or 0 for _, ns, _ in found) > 0:
            basis = "compute"
            compute = {tenant: int(ns or 0) for tenant, ns, _ in found}
            total = sum(compute.values())
            for row in rows:
                row.compute_ns = compute.get(row.tenant, 0)
                shares[row.tenant] = row.compute_ns / total
    if basis == "tokens":
        found = dict(conn.execute(_TOKEN_SHARES_SQL, [NO_TENANT, pid, pid, NO_TENANT, pid, pid]).fetchall())
        total = sum(v or 0 for v in found.values())
        shares = {tenant: (v or 0) / total for tenant, v in found.items()} if total else {}
    for row in rows:
        row.share = shares.get(row.tenant)
    return rows, basis


def _ms(ns: float | None) -> str:
    return "-" if ns is None or ns < 0 else f"{ns / 1e6:,.1f}"


def tenants_section(conn: duckdb.DuckDBPyConnection, pid: int | None = None) -> list[str]:
    rows, basis = tenant_rows(conn, pid)
    if not rows:
        return ["Per tenant: no served request finished (no request_events END rows in the store)"]
    table = []
    for r in rows:
        hit = (
            f"{r.prefix_hit_tokens:,} ({r.prefix_hit_tokens / r.prompt_tokens:.0%})"
            if r.prompt_tokens
            else "-"
        )
        compute = "-" if r.compute_ns is None else f"{r.compute_ns / 1e9:,.2f}"
        share = "-" if r.share is None else f"{r.share:.1%}"
        table.append([
            r.tenant, f"{r.requests}" + (f" ({r.failed} failed)" if r.failed else ""), f"{r.tokens:,}",
            f"{r.prompt_tokens:,}", hit, _ms(r.ttft_p50), _ms(r.ttft_p99), _ms(r.tpot_p50), _ms(r.tpot_p99),
            compute, share,
        ])  # fmt: skip
    header = ["tenant", "requests", "tokens", "prompt", "prefix hits", "TTFT p50", "p99", "TPOT p50", "p99",
              "compute s", "share"]  # fmt: skip
    if basis == "compute":
        note = (
            "(tokens: token steps stored; TTFT, TPOT in ms from each request's end record; compute s: the "
            "tenant's shares of every forward pass's duration, each pass split over its rows by the tokens "
            "each processed (pass_shares); share: of all passes' time)"
        )
    else:
        note = (
            "(tokens: token steps stored; TTFT, TPOT in ms from each request's end record; share: of the "
            "tokens processed in the forward passes, prompt chunks included - this store has no per-row "
            "compute (pass_shares), so compute s is not shown)"
        )
    return ["Per tenant:", *_table(header, table, {0}), *_wrap(note)]


def _wrap(text: str, width: int = 104) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return [f"  {line}" for line in [*lines, line] if line]


@dataclass
class Served:
    """One served request's END row and what it took part in."""

    pid: int
    request_seq: int
    request_id: str
    trace_id: str
    tenant: str
    session: str
    t_start_ns: int
    t_scheduled_ns: int
    t_first_token_ns: int
    t_last_token_ns: int
    t_end_ns: int
    queue_ns: int
    ttft_ns: int
    tpot_ns: int
    prompt_tokens: int
    prefill_tokens: int
    decoded_tokens: int
    prefix_hit_tokens: int
    kv_blocks: int
    finish_reason: str

    @property
    def total_ns(self) -> int:
        return self.t_end_ns - self.t_start_ns

    def phases(self) -> list[tuple[str, int]]:
        """(phase, ns): queue, prefill, decode, and what came after the last token; 0 where never reached."""

        def span(a: int, b: int) -> int:
            return max(b - a, 0) if a > 0 and b > 0 else 0

        return [
            ("queue", span(self.t_start_ns, self.t_scheduled_ns)),
            ("prefill", span(self.t_scheduled_ns, self.t_first_token_ns)),
            ("decode", span(self.t_first_token_ns, self.t_last_token_ns)),
            ("finishing", span(self.t_last_token_ns, self.t_end_ns)),
        ]


def _n(n: int, what: str) -> str:
    """'1 row', '2 rows', '2 forward passes'."""
    return f"{n} {what}" if n == 1 else f"{n} {what}{'es' if what.endswith('s') else 's'}"


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


def slowest_section(
    conn: duckdb.DuckDBPyConnection,
    pid: int | None = None,
    limit: int = SLOWEST_REQUESTS,
    db: str | None = None,
) -> list[str]:
    ends = [Served(*row) for row in conn.execute(_ENDS_SQL, [NO_TENANT, pid, pid]).fetchall()]
    if not ends:
        return []
    rows_of: dict[tuple[int, int], list[tuple[int, int]]] = {}  # pass -> [(request_seq, tokens)]
    passes_of: dict[tuple[int, int], set[int]] = {}  # request -> its passes
    for p, seq, request_seq, tokens in conn.execute(_PASS_ROWS_SQL, [pid, pid, pid, pid]).fetchall():
        rows_of.setdefault((p, seq), []).append((request_seq, tokens or 0))
        passes_of.setdefault((p, request_seq), set()).add(seq)
    windows = conn.execute(_PASSES_SQL, [pid, pid]).fetchall()
    tokens = _tokens(conn, pid)
    per_pass = list({(t.pid, t.step_seq): t for ts in tokens.values() for t in ts}.values())
    median_latency, medians = _medians(per_pass) if per_pass else (0.0, {})
    phase_medians = {
        name: _median([dict(e.phases())[name] for e in ends]) for name in ("queue", "prefill", "decode")
    }
    median_total = _median([e.total_ns for e in ends])
    db_flag = f" --db {db}" if db else ""
    lines = [
        f"Slowest requests (of {len(ends)}; the median request took {median_total / 1e6:,.1f} ms: queue "
        f"{phase_medians['queue'] / 1e6:,.1f}, prefill {phase_medians['prefill'] / 1e6:,.1f}, decode "
        f"{phase_medians['decode'] / 1e6:,.1f}) and why:"
    ]
    explained: dict[tuple[int, int], int] = {}  # pass -> the rank whose slowest step it was (said once)
    for rank, end in enumerate(ends[:limit], 1):
        phases = end.phases()
        worst, worst_ns, verdict = _slowest_phase(phases, phase_medians)
        mine = sorted(passes_of.get((end.pid, end.request_seq), ()))
        lines += [
            f"  {rank}. request {end.request_id or end.request_seq}  tenant {end.tenant}  trace "
            f"{(end.trace_id or '')[:16]}: {end.total_ns / 1e6:,.1f} ms",
            "      = "
            + ", ".join(f"{name} {ns / 1e6:,.1f}" for name, ns in phases if ns or name != "finishing")
            + f" ms; {end.prompt_tokens} prompt tokens ({end.prefix_hit_tokens} from the prefix cache), "
            f"{end.decoded_tokens} decoded, finished: {end.finish_reason}",
            f"      - {verdict} {worst}: "
            + _why_phase(end, worst, worst_ns, phase_medians, windows, rows_of, mine),
        ]
        slowest = max(tokens.get((end.pid, end.request_seq), []), key=lambda t: t.latency_ns, default=None)
        if slowest is not None and (slowest.pid, slowest.step_seq) in explained:
            lines.append(
                f"      - its slowest token step, step {slowest.step}: {slowest.latency_ns / 1e6:,.1f} ms, "
                f"the same forward pass as request {explained[(slowest.pid, slowest.step_seq)]}'s (above)"
            )
        elif slowest is not None and per_pass:
            explained[(slowest.pid, slowest.step_seq)] = rank
            sharing = rows_of.get((slowest.pid, slowest.step_seq), [])
            lines.append(
                f"      - its slowest token step, step {slowest.step}: {slowest.latency_ns / 1e6:,.1f} ms vs "
                f"{median_latency / 1e6:,.1f} ms the median pass, in a pass of {_n(len(sharing), 'row')} "
                f"({sum(t for _, t in sharing)} tokens)"
            )
            lines += [f"          {reason}" for reason in why_slow(slowest, median_latency, medians)]
            if end.trace_id:
                explain = f"llmobs-agent explain{db_flag} --trace {end.trace_id[:16]} --step {slowest.step}"
                lines.append(f"          {explain}")
    return lines


def _slowest_phase(phases: list[tuple[str, int]], medians: dict[str, float]) -> tuple[str, int, str]:
    """(phase, ns, verdict): the phase furthest over the median request's ("mostly"), or, where none is
    over it by more than a tenth, the longest one ("like the median request, mostly")."""
    timed = [(name, ns) for name, ns in phases if name in medians]
    name, ns = max(timed, key=lambda p: p[1] - medians[p[0]])
    if ns - medians[name] > 0.1 * max(medians[name], 1.0):
        return name, ns, "mostly"
    name, ns = max(timed, key=lambda p: p[1])
    return name, ns, "like the median request, mostly"


def _why_phase(end: Served, phase: str, ns: int, phase_medians: dict, windows, rows_of, mine) -> str:
    """What the agent saw during the request's slowest phase (against the median request's)."""
    if phase == "queue":
        during = [  # the passes that ran while it waited (overlapping its wait)
            (p, seq) for p, seq, start, stop in windows
            if p == end.pid and start < end.t_scheduled_ns and stop > end.t_start_ns
        ]  # fmt: skip
        others = {r for key in during for r, _ in rows_of.get(key, []) if r != end.request_seq}
        waited = f"{ns / 1e6:,.1f} ms waiting to be scheduled (median {phase_medians['queue'] / 1e6:,.1f})"
        if not during:  # nothing ran: the engine was not running passes (starting: the first requests)
            return f"{waited}: no forward pass ran meanwhile (the engine was starting or between batches)"
        return (
            f"{waited}: {_n(len(during), 'forward pass')} of {_n(len(others), 'other request')} ran meanwhile"
        )
    if phase == "prefill":
        computed = end.prefill_tokens
        return (
            f"{ns / 1e6:,.1f} ms to the first token (median {phase_medians['prefill'] / 1e6:,.1f}): "
            f"{computed} prompt tokens computed ({end.prompt_tokens - computed} reused)"
        )
    if phase == "decode":
        keys = [(end.pid, seq) for seq in mine]
        batch = [len(rows_of.get(k, [])) for k in keys]
        tokens = [sum(t for _, t in rows_of.get(k, [])) for k in keys]
        mean_rows = sum(batch) / len(batch) if batch else math.nan
        return (
            f"{ns / 1e6:,.1f} ms for {end.decoded_tokens} tokens, {_ms(end.tpot_ns)} ms per token (median "
            f"request's decode {phase_medians['decode'] / 1e6:,.1f} ms): its {len(keys)} passes carried "
            f"{mean_rows:.1f} rows and {sum(tokens) / max(len(tokens), 1):.1f} tokens on average"
        )
    return f"{ns / 1e6:,.1f} ms from its last token to its end record"


def _tokens(conn: duckdb.DuckDBPyConnection, pid: int | None) -> dict[tuple[int, int], list[Token]]:
    """Each served request's token steps, with their passes' probe totals (the generation report's Token)."""
    probes: dict[tuple[int, int], dict[str, tuple[int, int, int]]] = {}
    for p, seq, probe, count, value, ns in conn.execute(_PROBES_SQL, [pid, pid]).fetchall():
        probes.setdefault((p, seq), {})[probe] = (int(count), int(value or 0), int(ns or 0))
    engine = {
        (p, seq): (int(n), 0, int(ns))
        for p, seq, n, ns in conn.execute(_ENGINE_OFFCPU_SQL, [pid, pid]).fetchall()
    }
    out: dict[tuple[int, int], list[Token]] = {}
    for row in conn.execute(_TOKENS_SQL, [pid, pid]).fetchall():
        p, request_seq = row[:2]
        token = Token(p, *row[2:])
        token.loss = math.nan if token.loss is None else float(token.loss)
        token.probes = dict(probes.get((p, token.step_seq), {}))
        if engine:  # the engine thread's own off-CPU time replaces every thread's (idle ones included)
            token.probes.pop("sched_switch", None)
            token.probes[ENGINE_OFFCPU] = engine.get((p, token.step_seq), (0, 0, 0))
            token.off_cpu_ns = token.probes[ENGINE_OFFCPU][2]
        out.setdefault((p, request_seq), []).append(token)
    return out


def header_lines(
    *, model: str, clients: int, requests: int, max_tokens: int, tenants, summary, session, records, wall_s
) -> list[str]:
    """The run in a few lines: what was served, what the clients got, what the agent stored and dropped."""
    ok = [r for r in records if not r["error"]]
    received = sum(r["completion_tokens"] or 0 for r in ok)
    lines = [
        f"llmobs demo --serve: {model}, {clients} clients x {requests} requests x up to {max_tokens} tokens, "
        f"tenants {','.join(tenants)}",
        f"  clients: {len(ok)} of {len(records)} requests answered, {received} tokens received"
        + (f" in {wall_s:.1f} s ({received / wall_s:.1f} tokens/s, under the probes)" if wall_s else ""),
    ]
    if summary is not None:
        lines.append(
            f"  store: {summary.steps_read} token steps published, {summary.steps_lost} lost; "
            f"{summary.rows_by_table.get('request_events', 0)} request events; drops: store queue "
            f"{summary.dropped_rows}"
        )
    if session is not None:
        lines.append(f"  probes: {', '.join(p.name for p in session.attached_probes)}")
    return lines


def build_report(
    conn: duckdb.DuckDBPyConnection,
    header: list[str] | None = None,
    pid: int | None = None,
    db: str | None = None,
) -> str:
    lines = [*(header or []), "", *tenants_section(conn, pid), "", *slowest_section(conn, pid, db=db)]
    return "\n".join(lines) + "\n"
