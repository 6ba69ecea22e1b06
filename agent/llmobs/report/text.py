"""The demo's readable report, built from a store: per request a per-token table, the slowest steps and
why they were slow (the probes that stand out against the median step), and the probes per step.

Everything comes from the store's tables (token_steps, step_rollups, probe_aggregates), so the same
report can be made from any store; `decode` turns a token id into its text (the tokenizer lives in the
caller, which may not have one: ids are shown then).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median

import duckdb

from llmobs.store import schema
from llmobs.store.schema import probe_class
from llmobs.store.views import LEGACY_REQUEST_KEY, REQUEST_KEY, REQUEST_SEQ_VERSION

# What a probe's excess over the median step means, in words (by probe class, see probe_class).
_WHY = {
    "offcpu": "off the CPU (descheduled by other work, or waiting)",
    "compute": "the linear layers / matrix multiplies took longer",
    "alloc": "more or slower memory allocations",
    "free": "more memory frees",
    "fault": "page faults: first touch of new memory",
    "launch": "more GPU kernel launches",
    "memcpy": "more host/device copies",
    "other": "",
}
_BYTES = {"alloc", "free", "memcpy"}  # classes whose event value is a byte count
SLOWEST = 5
STANDS_OUT = 1.5  # a probe stands out when its count or time is this many times the median step's


@dataclass
class Token:
    pid: int
    step_seq: int
    step: int
    position: int
    token_id: int
    loss: float
    entropy: float
    target_prob: float
    latency_ns: int
    t_start_ns: int
    allocations: int | None
    alloc_bytes: int | None
    off_cpu_ns: int | None
    page_faults: int | None
    compute_calls: int | None
    text: str = ""
    probes: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # probe -> count, value, ns
    batch_row: int = 0  # its row in the forward pass: which of a served pass's tokens it is


@dataclass
class Request:
    pid: int
    trace_id: str
    tenant: str
    session: str
    model_id: str
    key: int = 0  # its request key (views.REQUEST_KEY): with pid and trace id, which request it is
    tokens: list[Token] = field(default_factory=list)

    @property
    def mean_loss(self) -> float:
        losses = [t.loss for t in self.tokens if not math.isnan(t.loss)]
        return sum(losses) / len(losses) if losses else math.nan


# Per request (pid, trace id, request key: views.REQUEST_KEY) its tokens, requests in the order of their
# first forward pass: a served request's steps interleave with other requests' across passes, so neither
# step_seq - step nor consecutive rows say which request a step is. A generate() request shows batch row
# 0 (its other rows are other prompts of the same call); a served request (request_seq <> 0) is its own
# row in every pass, whichever row number the pass gave it.
_STEPS_SQL = """
SELECT t.pid, t.trace_id, t.tenant, t.session, t.model_id, t.request_key, t.step_seq, t.step, t.position,
    t.token_id, t.loss, t.entropy, t.target_prob, t.latency_ns, t.t_start_ns, r.allocations, r.alloc_bytes,
    r.off_cpu_ns, r.page_faults, r.compute_calls, coalesce(t.batch_row, 0)
FROM (
    SELECT *, {key} AS request_key, min(step_seq) OVER (PARTITION BY pid, trace_id, {key}) AS first_seq
    FROM token_steps WHERE coalesce(batch_row, 0) = 0 OR {served}
) t LEFT JOIN step_rollups r USING (pid, step_seq)
ORDER BY t.pid, t.first_seq, t.trace_id, t.request_key, t.step
"""
_PROBES_SQL = """
SELECT pid, step_seq, probe, sum(count), sum(sum_value), sum(sum_duration_ns)
FROM probe_aggregates WHERE step_seq <> 0 GROUP BY ALL
"""
# Off-CPU time of the thread that runs the forward pass (tid = pid: the workload's main thread). The
# exact totals sum every thread of the process, and an idle intra-op pool thread is off-CPU the whole
# step, which says nothing about why the step was slow; the sampled events keep the tid.
MAIN_OFFCPU = "sched_switch (main thread)"
_MAIN_OFFCPU_SQL = """
SELECT pid, step_seq, sum(sample_ratio), sum(duration_ns * sample_ratio)
FROM host_events WHERE probe = 'sched_switch' AND tid = pid AND step_seq <> 0 GROUP BY ALL
"""


def load_requests(
    conn: duckdb.DuckDBPyConnection, decode: Callable[[int], str] | None = None
) -> list[Request]:
    """The store's requests in time order, each with its tokens (batch row 0) and their probe totals."""
    probes: dict[tuple[int, int], dict[str, tuple[int, int, int]]] = {}
    for pid, step_seq, probe, count, value, ns in conn.execute(_PROBES_SQL).fetchall():
        probes.setdefault((pid, step_seq), {})[probe] = (int(count), int(value or 0), int(ns or 0))
    main_offcpu = {
        (pid, seq): (int(n), 0, int(ns)) for pid, seq, n, ns in conn.execute(_MAIN_OFFCPU_SQL).fetchall()
    }
    requests: list[Request] = []
    if schema.current_version(conn) >= REQUEST_SEQ_VERSION:
        steps_sql = _STEPS_SQL.format(key=REQUEST_KEY, served="coalesce(request_seq, 0) <> 0")
    else:  # older than request_seq (read-only, not migrated): generate() requests only
        steps_sql = _STEPS_SQL.format(key=LEGACY_REQUEST_KEY, served="false")
    for row in conn.execute(steps_sql).fetchall():
        pid, trace, tenant, session, model, key = row[:6]
        token = Token(pid, *row[6:-1], batch_row=row[-1])
        token.loss = math.nan if token.loss is None else float(token.loss)
        token.probes = dict(probes.get((pid, token.step_seq), {}))
        if main_offcpu:  # the main thread's own off-CPU time, where the events say it (0 if none)
            token.probes[MAIN_OFFCPU] = main_offcpu.get((pid, token.step_seq), (0, 0, 0))
            token.off_cpu_ns = token.probes[MAIN_OFFCPU][2]
        token.text = decode(token.token_id) if decode else f"#{token.token_id}"
        last = requests[-1] if requests else None
        if last is None or (last.pid, last.trace_id, last.key) != (pid, trace, key):
            requests.append(Request(pid, trace, tenant or "", session or "", model or "", key))
        requests[-1].tokens.append(token)
    return requests


def _show(text: str, width: int = 16) -> str:
    """A token's text on one line: newlines and tabs visible, quoted, cut to width."""
    shown = repr(text)[1:-1] if any(c in text for c in "\n\t\r") or not text.isprintable() else text
    shown = f"'{shown}'"
    return shown if len(shown) <= width else shown[: width - 2] + "…'"


def _ms(ns: int | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.1f}"


def _num(value: float | None, spec: str = ",") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _table(header: list[str], rows: list[list[str]], left: set[int] = frozenset()) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [
            str(c).ljust(w) if i in left else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def request_table(request: Request) -> list[str]:
    rows = [
        [t.step, _show(t.text), _num(t.loss, ".3f"), _num(t.entropy, ".3f"), _num(t.target_prob, ".3f"),
         _ms(t.latency_ns), _num(t.allocations), _num(t.compute_calls), _ms(t.off_cpu_ns),
         _num(t.page_faults)]
        for t in request.tokens
    ]  # fmt: skip
    header = ["step", "token", "loss", "entropy", "p(token)", "latency ms", "allocs", "compute", "off-CPU ms",
              "faults"]  # fmt: skip
    return _table(header, rows, left={1})


def _medians(tokens: list[Token]) -> tuple[float, dict[str, tuple[float, float]]]:
    """Median latency, and per probe the median (count, ns) over the given steps (absent = 0)."""
    names = sorted({p for t in tokens for p in t.probes})
    per_probe = {}
    for name in names:
        counts = [t.probes.get(name, (0, 0, 0))[0] for t in tokens]
        times = [t.probes.get(name, (0, 0, 0))[2] for t in tokens]
        per_probe[name] = (median(counts), median(times))
    return median(t.latency_ns for t in tokens), per_probe


def why_slow(token: Token, median_latency: float, medians: dict[str, tuple[float, float]]) -> list[str]:
    """The reasons a step took longer than the median step, most time first."""
    reasons: list[tuple[float, str]] = []
    if token.step == 0:
        reasons.append(
            (
                math.inf,
                f"prefill: the request's first forward pass reads the whole {token.position}-token prompt",
            )
        )
    excess = max(token.latency_ns - median_latency, 1.0)
    for name, (count, _value, ns) in token.probes.items():
        if name == "sched_switch" and MAIN_OFFCPU in token.probes:
            continue  # all threads, idle pool threads included: the main thread's figure says more
        med_count, med_ns = medians.get(name, (0.0, 0.0))
        cls = probe_class(name)
        timed_out = ns > STANDS_OUT * med_ns and ns - med_ns > 0.05 * excess
        counted_out = count > STANDS_OUT * med_count + 1 and count - med_count >= 10
        if not (timed_out or counted_out):
            continue
        what = _WHY.get(cls, "")
        if timed_out:
            detail = (
                f"{name} {ns / 1e6:.1f} ms vs {med_ns / 1e6:.1f} ms median"
                f" ({count:,} vs {med_count:,.0f} calls)"
            )
            weight = ns - med_ns
        else:
            detail = f"{name} {count:,} calls vs {med_count:,.0f} median"
            weight = 0.0
        reasons.append((weight, detail + (f": {what}" if what else "")))
    reasons.sort(key=lambda r: -r[0])
    if len(reasons) == (1 if token.step == 0 else 0):
        reasons.append((0.0, "no probe stands out: the extra time went to work the probes do not see"))
    return [text for _, text in reasons]


def _step_tokens(requests: list[Request]) -> list[Token]:
    """The tokens the per-step sections count: each of a generate() request's, but of a served forward
    pass only its first row's. The rows of a served pass are tokens of different requests that share the
    pass's latency and probe totals, so counting each would count the pass once per row."""
    seen: set[tuple[int, int]] = set()
    tokens = []
    for request in requests:
        for token in request.tokens:
            if request.key < 0:  # served (views.REQUEST_KEY: -request_seq)
                if (token.pid, token.step_seq) in seen:
                    continue
                seen.add((token.pid, token.step_seq))
            tokens.append(token)
    return tokens


def slowest_section(requests: list[Request], limit: int = SLOWEST) -> list[str]:
    tokens = _step_tokens(requests)
    if not tokens:
        return []
    owner = {id(t): (i, r) for i, r in enumerate(requests) for t in r.tokens}
    median_latency, medians = _medians(tokens)
    lines = [f"Slowest steps (median step {median_latency / 1e6:.1f} ms) and why:"]
    for token in sorted(tokens, key=lambda t: -t.latency_ns)[:limit]:
        index, request = owner[id(token)]
        lines.append(
            f"  request {index + 1} step {token.step} {_show(token.text)}: {token.latency_ns / 1e6:.1f} ms "
            f"= {token.latency_ns / max(median_latency, 1):.1f}x the median"
        )
        lines += [f"      - {reason}" for reason in why_slow(token, median_latency, medians)]
    return lines


def _per_step_value(probe: str, value: float) -> str:
    """What a probe's event value adds up to per step, in its unit: bytes, or FLOPs for a GEMM."""
    cls = probe_class(probe)
    if not value or (cls not in _BYTES and cls != "compute"):
        return "-"
    return f"{value / 1024:,.1f} KiB" if cls in _BYTES else f"{value / 1e6:,.1f} MFLOP"


def probes_section(requests: list[Request]) -> list[str]:
    tokens = _step_tokens(requests)
    names = sorted({p for t in tokens for p in t.probes})
    if not names:
        return ["Probes per step: none recorded (no probe hit during the token steps)"]
    rows = []
    for name in names:
        counts = [t.probes.get(name, (0, 0, 0))[0] for t in tokens]
        values = sum(t.probes.get(name, (0, 0, 0))[1] for t in tokens)
        times = sum(t.probes.get(name, (0, 0, 0))[2] for t in tokens)
        total = sum(counts)
        rows.append([
            name, probe_class(name), f"{total / len(tokens):,.1f}", f"{min(counts):,}", f"{max(counts):,}",
            _per_step_value(name, values / len(tokens)),
            f"{times / total / 1e3:,.2f}" if total and times else "-",
            f"{times / 1e6:,.1f}" if times else "-",
        ])  # fmt: skip
    header = ["probe", "class", "per step", "min", "max", "value/step", "us/call", "total ms"]
    return [
        f"Probes per step (exact kernel totals over {len(tokens)} token steps; main thread: its events):",
        *_table(header, rows, {0, 1}),
    ]


# One line per flagged token: its pass, request and row (a served pass has a row per request; the
# detectors write which). Every row is read; surprising_section keeps those of the tokens the report shows.
_ANOMALIES_SQL = """
SELECT pid, step_seq, trace_id, coalesce(batch_row, 0) AS pass_row, list(detector ORDER BY detector),
    max(score), any_value(evidence)
FROM anomalies WHERE kind LIKE 'loss_%'
GROUP BY pid, step_seq, trace_id, pass_row ORDER BY max(score) DESC, pid, step_seq, pass_row
"""


def surprising_section(
    conn: duckdb.DuckDBPyConnection, requests: list[Request], limit: int = SLOWEST, db: str | None = None
) -> list[str]:
    """The tokens the live loss detectors flagged (the `anomalies` table), each with its request, its
    loss against the request's, the GPU/host evidence of its forward pass, and the `explain` command."""
    try:
        flagged = conn.execute(_ANOMALIES_SQL).fetchall()
    except duckdb.Error:  # a store from before the anomalies columns (migration 4): nothing to show
        return []
    # a served pass has one token of each of its requests: its row (and trace id) says whose was flagged.
    # Rows the report does not show (a generate() call's other prompts) are not counted as listed.
    where = {
        (t.pid, t.step_seq, r.trace_id, t.batch_row): (i, r, t)
        for i, r in enumerate(requests)
        for t in r.tokens
    }
    flagged = [row for row in flagged if tuple(row[:4]) in where]
    db_flag = f" --db {db}" if db else ""
    lines = [
        f"Surprising tokens ({len(flagged)} flagged live by the loss detectors: the calibrated one ranks "
        "each token's loss against the process's earlier tokens; t-test and median/MAD, when selected, "
        "against its request's earlier tokens):"
    ]
    if not flagged:
        none = (
            "  none: no token's loss stood out (the calibrated detector tests a position once its process "
            "has scored 1 / alarm rate tokens there: a run shorter than that is not tested)"
        )
        return [*lines, none]
    for pid, step_seq, trace_id, batch_row, detectors, score, evidence in flagged[:limit]:
        index, request, token = where[(pid, step_seq, trace_id, batch_row)]
        losses = sorted(t.loss for t in request.tokens if not math.isnan(t.loss))
        summary = _evidence_summary(evidence)
        lines += [
            f"  request {index + 1} step {token.step} {token.text!r}: loss {token.loss:.3f} vs the request's "
            f"median {losses[len(losses) // 2]:.3f}, p(token) {token.target_prob:.3f}; flagged by "
            f"{', '.join(detectors)} (score {score:.1f})",
            f"      - GPU/host: {summary or 'evidence not computed yet'}",
            f"      - llmobs-agent explain{db_flag} --trace {trace_id[:16]} --step {token.step}",
        ]
    return lines


# One line per incident (llmobs.diagnostics.incidents): the flagged tokens of a request (or the flagged
# training passes of a process) merged; the evidence of its peak row when correlate has filled it.
_INCIDENTS_SQL = """
SELECT i.incident_id, i.pid, i.scope, i.trace_id, i.state, i.first_step, i.last_step, i.first_seq,
    i.last_seq, i.tokens, i.rows, i.peak_score, i.peak_kind, i.peak_step, i.detectors, i.artifact,
    (SELECT any_value(a.evidence) FROM anomalies a WHERE a.incident_id = i.incident_id
        AND a.step_seq = i.peak_seq AND a.kind = i.peak_kind) AS evidence
FROM incidents i ORDER BY i.peak_score DESC NULLS LAST, i.pid, i.first_seq
"""


def incidents_section(
    conn: duckdb.DuckDBPyConnection, requests: list[Request], limit: int = SLOWEST, db: str | None = None
) -> list[str]:
    """The incidents first (what a user is paged about), then the tokens (`surprising_section`): each
    with its request, its span of steps, how many tokens and rows it merged, its peak and detectors, the
    evidence summary, and the explain command for its peak token."""
    try:
        found = conn.execute(_INCIDENTS_SQL).fetchall()
    except duckdb.Error:  # a store from before incidents (migration 11): nothing to show
        return []
    index = {(r.pid, r.trace_id): i for i, r in enumerate(requests)}
    shown = [row for row in found if row[2] == "pass" or (row[1], row[3]) in index]
    lines = [f"Incidents ({len(shown)}: flagged tokens of a request within a few passes of each other, or "
             "flagged training passes, merged into one):"]  # fmt: skip
    if not shown:
        return [*lines, "  none"]
    db_flag = f" --db {db}" if db else ""
    for (_id, pid, scope, trace, state, first, last, first_seq, last_seq, tokens, rows, peak, kind, peak_step,
         detectors, artifact, evidence) in shown[:limit]:  # fmt: skip
        summary = _evidence_summary(evidence)
        if scope == "pass":
            where = f"training/teacher-forced passes {first_seq}..{last_seq} of pid {pid}"
        else:
            where = f"request {index[(pid, trace)] + 1} steps {first}..{last}"
        peak_text = "-" if peak is None or math.isnan(peak) else f"{peak:.1f}"
        lines.append(f"  {where} ({state}): {tokens} token(s) in {rows} row(s), peak {peak_text} ({kind}), "
                     f"detectors {detectors.replace(',', ', ')}")  # fmt: skip
        lines.append(f"      - GPU/host: {summary or 'evidence not computed yet'}")
        if artifact:
            lines.append(f"      - artifact: {artifact}")
        if scope == "request":
            lines.append(f"      - llmobs-agent explain{db_flag} --trace {trace[:16]} --step {peak_step}")
    return lines


def build_report(
    conn: duckdb.DuckDBPyConnection,
    decode: Callable[[int], str] | None = None,
    header: list[str] | None = None,
    requests: list[Request] | None = None,
    db: str | None = None,
) -> str:
    requests = load_requests(conn, decode) if requests is None else requests
    lines = list(header or [])
    for index, request in enumerate(requests):
        latencies = sorted(t.latency_ns for t in request.tokens)
        text = "".join(t.text for t in request.tokens)
        lines += [
            "",
            f"Request {index + 1}/{len(requests)}  tenant {request.tenant}  session {request.session}  "
            f"trace {request.trace_id[:16]}  {len(request.tokens)} tokens  "
            f"mean loss {request.mean_loss:.3f}  "
            f"p50 {latencies[len(latencies) // 2] / 1e6:.1f} ms",
            f"  generated: {text!r}" if decode else "  (token ids: no tokenizer given)",
            *request_table(request),
        ]
    lines += [
        "",
        "(allocs, compute (linear/GEMM calls), faults: exact kernel counts per forward pass; off-CPU: the",
        " main thread's time descheduled or waiting during the step, from its sched_switch events)",
        "",
        *slowest_section(requests),
        "",
        *incidents_section(conn, requests, db=db),
        "",
        *surprising_section(conn, requests, db=db),
        "",
        *probes_section(requests),
    ]
    return "\n".join(lines) + "\n"


def _evidence_summary(evidence: str | None) -> str:
    """The one-line summary of an anomaly's or incident's evidence JSON ('' before correlate filled it)."""
    if not evidence:
        return ""
    try:
        return json.loads(evidence).get("summary", "")
    except ValueError:
        return ""
