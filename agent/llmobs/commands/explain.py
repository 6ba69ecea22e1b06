"""`llmobs-agent explain --trace T --step S`: everything the store knows about one token step.

Prints the token step (token, loss, entropy, rank, latency against the request's median), both loss
detectors' verdicts with their numbers (recomputed from the request's losses, next to the anomaly rows
the live agent stored), the GPU/host evidence of its forward pass against the process's baseline, the
layer streams of that step, and the root-cause candidate when llmobs.diagnostics.rootcause is there.
T is a full 32-hex trace id or a unique prefix; S the token's index within its request. A trace id
that names several requests (a repeated prompt) needs --first-step-seq (the error lists them).

Errors, one line each: no store (11), unknown trace (7), ambiguous prefix or request, step out of
range (2).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import duckdb
import numpy as np

from llmobs.diagnostics import evidence as evidence_mod
from llmobs.diagnostics.detectors import DetectorConfig, score_sequence
from llmobs.errors import NotTracked, UsageError
from llmobs.store import default_db_path
from llmobs.store.sink import DuckDBStore

LAYER_KINDS = {1: "attention entropy", 2: "MLP output variance"}  # shm layout LLMOBS_LAYER_* kinds
STEP_COLUMNS = (
    "pid", "step_seq", "trace_id", "step", "position", "token_id", "target_id", "loss", "entropy",
    "target_prob", "target_rank", "top1_prob", "latency_ns", "t_start_ns", "t_end_ns", "batch_row",
    "tenant", "session", "model_id",
)  # fmt: skip


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", help=f"the store (default: $LLMOBS_DB or {default_db_path()})")
    parser.add_argument(
        "--trace", required=True, metavar="T", help="trace id: 32 hex chars or a unique prefix"
    )
    parser.add_argument("--step", required=True, type=int, metavar="S", help="token index within the request")
    parser.add_argument("--pid", type=int, help="only requests of this process")
    parser.add_argument(
        "--first-step-seq", type=int, metavar="N", help="which request, when the trace id names several"
    )
    parser.add_argument(
        "--batch-row", type=int, help="which row of a batched request (default: the only one)"
    )
    parser.add_argument("--json", action="store_true", help="print the explanation as one JSON object")


def run(args: argparse.Namespace) -> int:
    prefix = args.trace.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{1,32}", prefix):
        raise UsageError(
            f"--trace {args.trace!r} is not a hex trace id (or prefix)", hint="e.g. --trace 4bf92f35"
        )
    with DuckDBStore(args.db or default_db_path(), read_only=True) as store:
        conn = store.connection
        request = find_request(conn, prefix, args.pid, args.first_step_seq, args.batch_row)
        report = explain(conn, request, args.step)
    if args.json:
        print(json.dumps(_finite(report), default=_json_default, indent=1))
    else:
        print_report(report)
    return 0


# ---- finding the step ------------------------------------------------------------------------------


# A request's first forward pass (its `origin`): step_seq - step for generated tokens (one pass each), the
# pass itself for a forward with labels (teacher forcing: all its tokens share one step_seq), as the
# live detectors group them (llmobs.diagnostics.detectors).
_STEPS_OF_TRACE = """
WITH s AS (
    SELECT *, coalesce(batch_row, 0) AS row,
        CASE WHEN count(*) OVER (PARTITION BY pid, trace_id, step_seq, coalesce(batch_row, 0)) > 1
             THEN step_seq ELSE step_seq - coalesce(step, 0) END AS origin
    FROM token_steps WHERE starts_with(trace_id, $prefix) AND ($pid IS NULL OR pid = $pid)
)
"""


def find_request(conn, prefix: str, pid: int | None, first: int | None, batch_row: int | None) -> dict:
    """The one request (pid, trace_id, first_step_seq, batch_row) the arguments name, or a clear error."""
    rows = conn.execute(
        _STEPS_OF_TRACE
        + """SELECT pid, trace_id, origin, row, count(*) AS tokens, min(t_start_ns) AS t0 FROM s
             WHERE ($first IS NULL OR origin = $first) AND ($row IS NULL OR row = $row)
             GROUP BY ALL ORDER BY t0""",
        {"prefix": prefix, "pid": pid, "first": first, "row": batch_row},
    ).fetchall()
    if not rows:
        raise NotTracked(
            f"no token steps of a trace {prefix}{'' if len(prefix) == 32 else '...'} in the store"
            + (f" for pid {pid}" if pid is not None else ""),
            hint='list traces: llmobs-agent query "SELECT DISTINCT trace_id FROM requests"',
        )
    traces = sorted({r[1] for r in rows})
    if len(traces) > 1:
        shown = ", ".join(traces[:5]) + (", ..." if len(traces) > 5 else "")
        raise UsageError(f"trace prefix {prefix} is ambiguous: {len(traces)} traces match ({shown})",
                         hint="give more hex digits of the trace id")  # fmt: skip
    if len(rows) > 1:
        shown = "; ".join(f"pid {r[0]} first_step_seq {r[2]} row {r[3]} ({r[4]} tokens)" for r in rows[:5])
        raise UsageError(f"trace {traces[0]} names {len(rows)} requests: {shown}",
                         hint="pick one with --first-step-seq N (and --pid / --batch-row)")  # fmt: skip
    pid, trace, first, row, tokens, _t0 = rows[0]
    return {"pid": pid, "trace_id": trace, "first_step_seq": first, "batch_row": row, "tokens": tokens}


def _steps(conn, request: dict) -> list[dict]:
    cursor = conn.execute(
        _STEPS_OF_TRACE
        + f"""SELECT {", ".join(STEP_COLUMNS)} FROM s WHERE origin = $first AND row = $row ORDER BY step""",
        {"prefix": request["trace_id"], "pid": request["pid"], "first": request["first_step_seq"],
         "row": request["batch_row"]},
    )  # fmt: skip
    return [dict(zip(STEP_COLUMNS, r, strict=True)) for r in cursor.fetchall()]


# ---- the explanation -------------------------------------------------------------------------------


def explain(conn, request: dict, step_index: int) -> dict:
    steps = _steps(conn, request)
    by_index = {s["step"]: i for i, s in enumerate(steps)}
    if step_index not in by_index:
        low, high = (steps[0]["step"], steps[-1]["step"]) if steps else (0, -1)
        raise UsageError(
            f"request {request['trace_id']} has token steps {low}..{high}; there is no step {step_index}",
            hint=f"--step takes a token index within the request ({low}..{high})",
        )
    i = by_index[step_index]
    step = steps[i]
    losses = np.asarray([np.nan if s["loss"] is None else s["loss"] for s in steps], np.float64)
    latencies = np.asarray([s["latency_ns"] or 0 for s in steps], np.float64)
    report = {
        "request": {
            **request,
            "tenant": step["tenant"],
            "session": step["session"],
            "model_id": step["model_id"],
        },
        "step": step,
        "context": {
            "loss_median": _median(losses),
            "latency_median_ns": _median(latencies[latencies > 0]),
            "latency_ratio": (step["latency_ns"] / _median(latencies[latencies > 0]))
            if step["latency_ns"] and (latencies > 0).any()
            else None,
        },
        "detectors": _verdicts(losses, i),
        "anomalies": _anomalies(conn, step),
    }
    report["incident"] = _incident(conn, step, report["anomalies"])
    report["evidence"] = _evidence(conn, step, report["anomalies"])
    report["layers"] = _layers(conn, step)
    report["root_cause"] = _root_cause(conn, step)
    report["replay"] = _replay(conn, step)
    report["factors"] = _factors(conn, step)
    return report


FACTOR_MIN_REQUESTS = 20  # fewer: the matrix has too little to rank by; the section says so
FACTOR_RESAMPLES = 200  # explain needs the ranking, not tight intervals: kept cheap


def _factors(conn, step: dict) -> dict | None:
    """The request's levels of the factors the attribution matrix (loss only) ranks highest; None when
    the store has no labels or factors at all (an older store, or none were set)."""
    from llmobs.diagnostics import attribution

    try:
        labelled = conn.execute(
            "SELECT (SELECT count(*) FROM request_labels) + (SELECT count(*) FROM model_factors)"
        ).fetchall()[0][0]
        seq = conn.execute(
            "SELECT request_seq FROM token_steps WHERE pid = ? AND step_seq = ? AND trace_id = ?"
            " AND coalesce(batch_row, 0) = ? AND step = ? LIMIT 1",
            [step["pid"], step["step_seq"], step["trace_id"], step["batch_row"] or 0, step["step"]],
        ).fetchall()
    except duckdb.Error:  # a store from before migration 13
        return None
    if not labelled:
        return None
    request_seq = int(seq[0][0] or 0) if seq else 0
    key = (step["pid"], -request_seq if request_seq else step["step_seq"] - (step["step"] or 0))
    result = attribution.attribution(conn, "loss", resamples=FACTOR_RESAMPLES, keep_levels=True)
    mine = result.levels_of.get(key, {})
    if result.requests < FACTOR_MIN_REQUESTS:
        return {"skipped": f"{result.requests} requests with a loss (the matrix needs {FACTOR_MIN_REQUESTS})",
                "levels": mine}  # fmt: skip
    top = []
    for f in result.factors[:3]:
        names = f.factor.split(" = ")  # aliased factors: each one's level (quant=int4, variant=q4)
        level = ", ".join(f"{n}={mine[n]}" for n in names if n in mine) or None
        top.append({"rank": f.rank, "factor": f.factor, "level": level, "contrast_level": f.level,
                    "reference": f.reference, "effect": f.effect, "ci": f.ci, "significant": f.significant,
                    "note": f.note})  # fmt: skip
    return {"requests": result.requests, "resamples": FACTOR_RESAMPLES, "design": result.design,
            "blocks": result.blocks, "top": top, "levels": mine}  # fmt: skip


def _median(values: np.ndarray) -> float | None:
    values = values[np.isfinite(values)]
    return float(np.median(values)) if len(values) else None


def _verdicts(losses: np.ndarray, i: int) -> dict:
    """Both detectors at their defaults on the request's losses up to this token (what the live agent
    computes, recomputed here so a step that was not flagged still shows its numbers)."""
    config = DetectorConfig(detector="both")
    scores = score_sequence(losses[: i + 1], config)
    tested = bool(scores.n[i])
    out = {
        "window": config.window,
        "min_history": config.min_history,
        "tested": tested,
        "n": int(scores.n[i]),
    }
    if not tested:
        out["why_not"] = (
            "no target (NaN loss)"
            if not np.isfinite(losses[i])
            else f"fewer than {config.min_history} tokens before"
        )
        return out
    out["ttest"] = {
        "flagged": bool(scores.ttest[i]), "t": scores.t[i], "p_value": scores.p[i], "alpha": config.alpha,
        "window_mean": scores.mean[i], "window_sd": scores.sd[i],
    }  # fmt: skip
    out["mad"] = {
        "flagged": bool(scores.mad_flag[i]), "z": scores.z[i], "threshold": config.mad_threshold,
        "window_median": scores.median[i], "window_mad": scores.mad[i],
    }  # fmt: skip
    return out


def _anomalies(conn, step: dict) -> list[dict]:
    cursor = conn.execute(
        """SELECT * EXCLUDE (pid, step_seq, trace_id, first_step_seq, step, batch_row, evidence_ns)
           FROM anomalies
           WHERE pid = ? AND step_seq = ? AND (trace_id = ? OR trace_id IS NULL)
             AND coalesce(batch_row, 0) = ? ORDER BY kind""",
        [step["pid"], step["step_seq"], step["trace_id"], step["batch_row"] or 0],
    )
    names = [d[0] for d in cursor.description]
    rows = [dict(zip(names, r, strict=True)) for r in cursor.fetchall()]
    for row in rows:
        for key in ("detail", "evidence"):
            row[key] = _loads(row[key])
    return rows


_INCIDENT_COLUMNS = ("incident_id", "scope", "state", "first_step", "last_step", "first_seq", "last_seq",
                     "tokens", "rows", "peak_score", "peak_step", "peak_seq", "peak_kind", "detectors",
                     "artifact")  # fmt: skip


def _incident(conn, step: dict, anomalies: list[dict]) -> dict | None:
    """The incident this step is part of (llmobs.diagnostics.incidents): the one its anomaly rows name,
    else the pass incident (training, teacher forcing) of its forward pass; None: none, or a store from
    before incidents (migration 11)."""
    ids = sorted({a["incident_id"] for a in anomalies if a.get("incident_id")})
    try:
        rows = conn.execute(
            f"""SELECT {", ".join(_INCIDENT_COLUMNS)} FROM incidents
                WHERE incident_id IN (SELECT unnest($ids::VARCHAR[]))
                   OR (pid = $pid AND scope = 'pass' AND $seq BETWEEN first_seq AND last_seq)
                ORDER BY scope = 'pass', first_seq LIMIT 1""",
            {"ids": ids, "pid": step["pid"], "seq": step["step_seq"]},
        ).fetchall()
    except duckdb.Error:  # no incidents table (an older store)
        return None
    if not rows:
        return None
    incident = dict(zip(_INCIDENT_COLUMNS, rows[0], strict=True))
    peak = conn.execute(  # the evidence link: the peak row's evidence (filled once correlate ran)
        "SELECT evidence FROM anomalies WHERE incident_id = ? AND step_seq = ? AND kind = ? LIMIT 1",
        [incident["incident_id"], incident["peak_seq"], incident["peak_kind"]],
    ).fetchall()
    evidence = _loads(peak[0][0]) if peak else None
    incident["evidence_summary"] = evidence.get("summary") if isinstance(evidence, dict) else None
    return incident


def _loads(text: str | None):
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {"text": text}


def _evidence(conn, step: dict, anomalies: list[dict]) -> dict | None:
    stored = next((a["evidence"] for a in anomalies if a.get("evidence")), None)
    if stored is not None:
        return stored
    found = evidence_mod.gather(conn, step["pid"], step["step_seq"])  # not flagged live: compute it now
    if found is not None:
        found["summary"] = evidence_mod.summary(found)
    return found


def _layers(conn, step: dict) -> list[dict]:
    rows = conn.execute(
        """SELECT kind, layer, head, value FROM layer_streams
           WHERE pid = ? AND step_seq = ? AND batch_row = ? ORDER BY kind, layer, head""",
        [step["pid"], step["step_seq"], step["batch_row"] or 0],
    ).fetchall()
    return [
        {"kind": LAYER_KINDS.get(k, f"kind {k}"), "layer": la, "head": h, "value": v} for k, la, h, v in rows
    ]


_REPLAY_COLUMNS = ("replay_id", "verdict", "verdict_detail", "first_diverging_layer", "cause",
                   "op_graph_hash", "recorded_loss", "replay_loss", "loss_diff", "status", "reason",
                   "trigger")  # fmt: skip


def _replay(conn, step: dict) -> dict | None:
    """The newest replay of this token step (llmobs-agent replay, or --replay-on-anomaly); None: none,
    or a store from before replays (migration 12)."""
    try:
        rows = conn.execute(
            f"""SELECT {", ".join(_REPLAY_COLUMNS)} FROM replays
                WHERE pid = ? AND target_step_seq = ? AND target_batch_row = ? ORDER BY ts_ns DESC LIMIT 1""",
            [step["pid"], step["step_seq"], step["batch_row"] or 0],
        ).fetchall()
    except duckdb.Error:
        return None
    if not rows:
        return None
    replay = dict(zip(_REPLAY_COLUMNS, rows[0], strict=True))
    if replay["op_graph_hash"] is not None:
        replay["op_graph_hash"] = f"{replay['op_graph_hash']:016x}"
    return replay


def _root_cause(conn, step: dict) -> dict | None:
    try:
        from llmobs.diagnostics.rootcause import root_cause
    except ImportError:  # the root-cause module is optional
        return None
    try:
        found = root_cause(conn, step["pid"], step["step_seq"], step["trace_id"])
    except Exception as exc:  # a failing analysis must not hide the rest of the explanation
        return {"error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}
    if found is None:
        return None
    return {"module": found.module, "score": found.score, "evidence": list(found.evidence)}


# ---- printing --------------------------------------------------------------------------------------


def _ms(ns) -> str:
    return "-" if ns is None else f"{ns / 1e6:.2f} ms"


def _num(value, fmt: str = ".3f") -> str:
    return (
        "-" if value is None or (isinstance(value, float) and not np.isfinite(value)) else format(value, fmt)
    )


def print_report(report: dict, out=None) -> None:
    r, s, c, d = report["request"], report["step"], report["context"], report["detectors"]
    w = (out or sys.stdout).write
    w(f"trace {r['trace_id']}  pid {r['pid']}  request first_step_seq {r['first_step_seq']}"
      f"  row {r['batch_row']}  ({r['tokens']} tokens; tenant {r['tenant']}, session {r['session']},"
      f" model {r['model_id']})\n")  # fmt: skip
    _print_incident(report.get("incident"), w)  # first: what a user is paged about
    ratio = (
        f" ({c['latency_ratio']:.2f}x the request's median {_ms(c['latency_median_ns'])})"
        if c["latency_ratio"]
        else ""
    )
    w(f"step {s['step']} (step_seq {s['step_seq']}, position {s['position']}): ")
    w(f"token {s['token_id']} target {s['target_id']}\n")
    w(f"  loss {_num(s['loss'])} nats (request median {_num(c['loss_median'])}), ")
    w(f"entropy {_num(s['entropy'])}, target p {_num(s['target_prob'], '.4f')} rank {s['target_rank']}, ")
    w(f"top-1 p {_num(s['top1_prob'], '.4f')}\n")
    w(f"  latency {_ms(s['latency_ns'])}{ratio}\n")
    w("detectors (defaults: window 32, min 8 tokens):\n")
    if not d["tested"]:
        w(f"  not tested: {d['why_not']}\n")
    else:
        t, m = d["ttest"], d["mad"]
        w(f"  t-test {_verdict(t)}  t {_num(t['t'], '.2f')}, p {_num(t['p_value'], '.2g')}")
        w(f" (alpha {t['alpha']}),")
        w(f" window mean {_num(t['window_mean'])} sd {_num(t['window_sd'])} n {d['n']}\n")
        w(f"  mad    {_verdict(m)}  z {_num(m['z'], '.2f')} (threshold {m['threshold']}),")
        w(f" window median {_num(m['window_median'])} MAD {_num(m['window_mad'])}\n")
    if report["anomalies"]:
        kinds = ", ".join(f"{a['kind']} (score {_num(a['score'], '.2f')})" for a in report["anomalies"])
        w(f"  stored anomaly rows: {kinds}\n")
        for a in report["anomalies"]:
            if a.get("artifact"):
                w(f"  artifact: {a['artifact']}\n")
    else:
        w("  stored anomaly rows: none (the live agent did not flag this step)\n")
    _print_evidence(report["evidence"], w)
    layers = report["layers"]
    if layers:
        w("layer streams of this step:\n")
        for kind in sorted({la["kind"] for la in layers}):
            values = [la for la in layers if la["kind"] == kind and la["head"] == -1] or [
                la for la in layers if la["kind"] == kind
            ]
            shown = "  ".join(f"{_layer_name(la)} {la['value']:.3g}" for la in values[:24])
            w(f"  {kind}: {shown}{' ...' if len(values) > 24 else ''}\n")
    else:
        w("layer streams of this step: none (not sampled)\n")
    _print_replay(report.get("replay"), w)
    _print_factors(report.get("factors"), w)
    rc = report["root_cause"]
    if rc is None:
        w("root cause: no candidate\n")
    elif "error" in rc:
        w(f"root cause: failed ({rc['error']})\n")
    else:
        w(f"root cause candidate: {rc['module']} (score {rc['score']:.2f})\n")
        for line in rc["evidence"]:
            w(f"  {line}\n")


def _print_replay(replay: dict | None, w) -> None:
    if replay is None:
        w("replay: none (llmobs-agent replay --trace T --step S, or an agent with --replay-on-anomaly)\n")
        return
    r = replay
    layer = (
        "" if r["first_diverging_layer"] is None else f", first diverging layer {r['first_diverging_layer']}"
    )
    cause = "" if r["cause"] is None else f", cause {r['cause']}"
    w(f"replay {r['replay_id']} ({r['trigger']}): {r['verdict'].upper().replace('_', ' ')}{layer}{cause}; "
      f"op graph {r['op_graph_hash'] or '-'}\n")  # fmt: skip
    if r["verdict_detail"]:
        w(f"  {r['verdict_detail']}\n")


def _print_factors(factors: dict | None, w) -> None:
    if factors is None:
        return  # no labels or factors in the store: nothing to say
    if "skipped" in factors:
        levels = ", ".join(f"{k}={v}" for k, v in sorted(factors["levels"].items()))
        w(f"factors: {levels or '-'} (attribution matrix skipped: {factors['skipped']})\n")
        return
    blocked = f", blocked by prompt ({factors['blocks']} prompts)" if factors.get("blocks") else ""
    w(f"factors of this request, as the attribution matrix ranks them (loss, {factors['requests']} requests"
      f"{blocked}, {factors['resamples']} resamples; llmobs-agent query --attribution):\n")  # fmt: skip
    for f in factors["top"]:
        if f["effect"] is None:
            w(f"  {f['rank']}. {f['level'] or f['factor']}: {f['note']}\n")
            continue
        ci = "" if f["ci"] is None else f" [{f['ci'][0]:+.3f}, {f['ci'][1]:+.3f}]"
        w(f"  {f['rank']}. {f['level'] or f['factor']}: {f['contrast_level']} vs {f['reference']} "
          f"{f['effect']:+.3f} nats{ci}{'' if f['significant'] else ' (not significant)'}\n")  # fmt: skip


def _print_incident(incident: dict | None, w) -> None:
    """The incident first: what a user is paged about; the token's own numbers follow."""
    if incident is None:
        w("incident: none (no flagged token of this request within the gap, or an older store)\n")
        return
    i = incident
    where = (f"steps {i['first_step']}..{i['last_step']}" if i["scope"] == "request"
             else f"passes {i['first_seq']}..{i['last_seq']}")  # fmt: skip
    peak = f"step {i['peak_step']}" if i["peak_step"] is not None else f"pass {i['peak_seq']}"
    w(f"incident {i['incident_id']} ({i['scope']}, {i['state']}): {where}, {i['tokens']} token(s) flagged "
      f"({i['rows']} anomaly rows), peak {_num(i['peak_score'], '.2f')} ({i['peak_kind']}) at {peak}, "
      f"detectors {i['detectors']}\n")  # fmt: skip
    if i.get("evidence_summary"):
        w(f"  evidence at the peak: {i['evidence_summary']}\n")
    if i.get("artifact"):
        w(f"  artifact: {i['artifact']}\n")


def _verdict(result: dict) -> str:
    return "ANOMALY" if result["flagged"] else "ok     "


def _layer_name(row: dict) -> str:
    return f"L{row['layer']}" + ("" if row["head"] == -1 else f"h{row['head']}")


def _print_evidence(ev: dict | None, w) -> None:
    if ev is None:
        w("GPU/host evidence: none yet (the step is not rolled up: run correlate or wait for the agent)\n")
        return
    st = ev["step"]
    w(f"GPU/host evidence of the forward pass (vs the previous {ev['baseline_steps']} steps of the process,"
      f" counts {'exact' if ev['counts_exact'] else 'from sampled events'}):\n")  # fmt: skip
    w(f"  launches {st['launches']}, GPU {_ms(st['gpu_ns'])}, off-CPU {_ms(st['off_cpu_ns'])}, "
      f"page faults {st['page_faults']}, allocations {st['allocations']} ({st['alloc_bytes']} B), "
      f"compute calls {st['compute_calls']}, decode {_ms(st['decode_latency_ns'])}\n")  # fmt: skip
    if ev["unusual"]:
        for item in ev["unusual"]:
            w(f"  UNUSUAL {evidence_mod.describe(item)}\n")
    else:
        w(f"  {evidence_mod.summary(ev)}\n")


def _finite(value):
    """The report with NaN/inf as null: JSON has no NaN."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, float | np.floating) and not np.isfinite(value):
        return None
    return value


def _json_default(value):
    if isinstance(value, np.generic):
        return None if isinstance(value, np.floating) and not np.isfinite(value) else value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")
