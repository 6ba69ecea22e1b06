"""`llmobs-agent replay --trace T --step S [--window K]`: replay one token step in the live workload.

Finds the token step in the store (T: a trace id or a unique prefix, S: the token's index within its
request, as `explain`), asks the workload's flight recorder to replay the window of K steps either side
of it (CMD_REPLAY through the map's control block, llmobs.shm.replay_client), waits for the result file
(progress on stderr), stores it with its verdict in one transaction (llmobs.pipeline.replay_ingest),
deletes the file, and prints the verdict first, then the trajectory of replayed against recorded loss.

The store must be free to write: a running `attach --db` / `run` holds it (their --replay-on-anomaly
replays flagged tokens themselves, docs/replay.md).

Errors, one line each: no store or store held (11), unknown trace or no map (7), bad arguments (2),
no acknowledgement in time (13), the recorder keeps no such request (14), a replay already running
(15), no flight recorder in the workload (16), no result in time (17), the workload could not replay
the step (18, stored with its reason).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import numpy as np

from llmobs.diagnostics.replay import MIN_OTHER_PASSES, MIN_Z, BadResult
from llmobs.errors import ReplayFailed, StoreError, UsageError
from llmobs.shm import layout

HINT = "see `llmobs-agent replay --help`"
DEFAULT_TIMEOUT_S = 120.0
ACK_TIMEOUT_S = 10.0  # a workload answers at its next token step: a generating one within milliseconds


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace", required=True, metavar="T", help="trace id: 32 hex chars or a unique prefix"
    )
    parser.add_argument("--step", required=True, type=int, metavar="S", help="token index within the request")
    parser.add_argument(
        "--window",
        type=int,
        default=0,
        metavar="K",
        help=f"replay K token steps either side of S (default {layout.REPLAY_DEFAULT_WINDOW})",
    )
    parser.add_argument("--db", help="the store (default: $LLMOBS_DB or /var/lib/llmobs/llmobs.duckdb)")
    parser.add_argument("--pid", type=int, help="only requests of this process")
    parser.add_argument(
        "--first-step-seq", type=int, metavar="N", help="which request, when the trace id names several"
    )
    parser.add_argument(
        "--batch-row", type=int, help="which row of a batched request (default: the only one)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SEC",
        help=f"give up when the result is not there after SEC seconds (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument("--json", action="store_true", help="print the replay as one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--shm-dir", default=layout.SHM_DIR, help=argparse.SUPPRESS)


def _validate(args: argparse.Namespace) -> str:
    prefix = args.trace.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{1,32}", prefix):
        raise UsageError(
            f"--trace {args.trace!r} is not a hex trace id (or prefix)", hint="e.g. --trace 4bf92f35"
        )
    top = (1 << layout.REPLAY_WINDOW_BITS) - 1
    if not 0 <= args.window <= top:
        raise UsageError(f"--window must be in 1..{top} (0: the default), not {args.window}", hint=HINT)
    if not args.timeout > 0 or args.timeout != args.timeout or args.timeout == float("inf"):
        raise UsageError(f"--timeout must be a finite number of seconds > 0, not {args.timeout}", hint=HINT)
    if args.step < 0:
        raise UsageError(f"--step must be >= 0, not {args.step}", hint=HINT)
    return prefix


def run(args: argparse.Namespace) -> int:
    prefix = _validate(args)
    from llmobs.commands.explain import find_request
    from llmobs.pipeline import replay_ingest
    from llmobs.shm import replay_client
    from llmobs.shm.control import ControlClient
    from llmobs.store import default_db_path
    from llmobs.store.sink import DuckDBStore

    db = args.db or default_db_path()
    with _open_store(DuckDBStore, db) as store:
        request = find_request(store.connection, prefix, args.pid, args.first_step_seq, args.batch_row)
        target = _target(store.connection, request, args.step, replay_ingest.Target)
        say = (lambda _line: None) if args.quiet or args.json else (lambda line: print(line, file=sys.stderr))
        with ControlClient(target.pid, args.shm_dir) as client:
            say(
                f"replaying step {target.step} of trace {target.trace_id} in pid {target.pid} (step_seq"
                f" {target.step_seq}, row {target.batch_row},"
                f" window {args.window or layout.REPLAY_DEFAULT_WINDOW})"
            )
            accepted = replay_client.post(
                client, target.step_seq, target.batch_row, args.window, min(ACK_TIMEOUT_S, args.timeout)
            )
            say(f"accepted at step_seq {accepted.ack_step_seq}; waiting for {accepted.path}")
            path = replay_client.wait_file(
                accepted, args.timeout, target.pid, lambda s: say(f"  replaying... {s:.0f} s")
            )
        try:
            ingested = replay_ingest.ingest_file(
                store, path, ack_step_seq=accepted.ack_step_seq, target=target
            )
        except BadResult as exc:  # kept for a look: the workload and the agent disagree on the format
            raise ReplayFailed(
                f"the workload's result {path} is not a replay this agent reads: {exc}",
                hint="upgrade the workload's llmobs and the agent together",
            ) from None
        replay_ingest.remove(path)
        report = report_of(store.connection, ingested, str(db))
    if args.json:
        print(json.dumps(report, indent=1, default=_json_default))
    else:
        print_report(report)
    if report["verdict"] == "failed":
        raise ReplayFailed(f"the replay of step {target.step} failed: {report['detail']}")
    return 0


def _open_store(cls, db):
    """The store, opened to write (the replay is stored); a path with no store is an error, not a new
    empty store."""
    from pathlib import Path

    if not Path(db).exists():
        raise StoreError(f"no store at {db}", hint="give the agent's store with --db PATH")
    try:
        return cls(db)
    except StoreError as exc:
        if "lock" not in str(exc).lower():
            raise
        raise StoreError(
            f"{db} is held by a running agent (attach --db / run): {exc}",
            hint="stop that agent first, or let it replay flagged tokens itself (--replay-on-anomaly)",
        ) from None


def _target(conn, request: dict, step: int, target_cls):
    rows = conn.execute(
        """SELECT step_seq, min(step) OVER (), max(step) OVER () FROM token_steps
           WHERE pid = $pid AND trace_id = $trace AND coalesce(batch_row, 0) = $row
             AND step_seq - coalesce(step, 0) = $first""",
        {
            "pid": request["pid"],
            "trace": request["trace_id"],
            "row": request["batch_row"],
            "first": request["first_step_seq"],
        },
    ).fetchall()
    found = conn.execute(
        """SELECT step_seq FROM token_steps WHERE pid = $pid AND trace_id = $trace
             AND coalesce(batch_row, 0) = $row AND step_seq - coalesce(step, 0) = $first AND step = $step""",
        {
            "pid": request["pid"],
            "trace": request["trace_id"],
            "row": request["batch_row"],
            "first": request["first_step_seq"],
            "step": step,
        },
    ).fetchall()
    if not found:
        low, high = (rows[0][1], rows[0][2]) if rows else (0, -1)
        raise UsageError(
            f"request {request['trace_id']} has generated token steps {low}..{high}; there is no step {step}",
            hint=f"--step takes a token index within the request ({low}..{high}); a teacher-forced pass"
            " is not replayable",
        )
    seq = int(found[0][0])
    return target_cls(
        int(request["pid"]), seq, int(request["batch_row"]), request["trace_id"], step, seq - step
    )


# ---- the report --------------------------------------------------------------------------------------


def report_of(conn, ingested, db: str) -> dict:
    """The replay as printed and as --json: verdict, findings, root cause, then the trajectory."""
    v, result, target = ingested.verdict, ingested.result, ingested.target
    meta = result.meta
    out = {
        "replay_id": ingested.replay_id,
        "db": db,
        "pid": target.pid,
        "trace_id": target.trace_id,
        "first_step_seq": target.first_step_seq,
        "step": target.step,
        "step_seq": target.step_seq,
        "batch_row": target.batch_row,
        "verdict": v.verdict,
        "detail": v.detail,
        "findings": v.findings,
        "cause": v.cause,
        "first_diverging_layer": v.first_diverging_layer,
        "recorded_loss": v.recorded_loss,
        "replay_loss": v.replay_loss,
        "loss_diff": v.loss_diff,
        "op_graph_hash": None if v.graph_hash is None else f"{v.graph_hash:016x}",
        "linear_calls": v.linear_calls,
        "status": meta.get("status"),
        "reason": meta.get("reason"),
        "source": meta.get("source"),
        "snapshot_len": meta.get("snapshot_len"),
        "repeats": meta.get("repeats"),
        "window": meta.get("window"),
        "live_batch_size": meta.get("live_batch_size"),
        "wall_ms": meta.get("wall_ms"),
        "prefill_ms": meta.get("prefill_ms"),
        "model": meta.get("model"),
        "gpu": gpu_summary(meta.get("cupti")),
        "root_cause": None,
        "trajectory": [],
    }
    if v.root is not None:
        r = v.root
        out["root_cause"] = {
            "module": _module(conn, target.pid, r.kind, r.layer, r.head)
            or f"layer {r.layer}" + (f" head {r.head}" if r.head >= 0 else ""),
            "kind": r.kind,
            "layer": r.layer,
            "head": r.head,
            "z": r.z,
            "value": r.value,
            "median": r.median,
            "mad": r.mad,
            "passes": r.others,
        }
    if result.ok and result.passes:
        out["trajectory"] = _trajectory(conn, ingested.replay_id, v.target_pass)
    return out


def _module(conn, pid: int, kind: int, layer: int, head: int) -> str | None:
    rows = conn.execute(
        "SELECT module FROM layer_modules WHERE pid = ? AND kind = ? AND layer = ? LIMIT 1",
        [pid, kind, layer],
    ).fetchall()
    if not rows:
        return None
    return rows[0][0] + (f" head {head}" if head >= 0 else "")


def _trajectory(conn, rid: str, target_pass: int | None) -> list[dict]:
    rows = conn.execute(
        """SELECT pass, step, position, recorded_loss, loss, entropy, top5_ids[1], top5_probs[1]
           FROM replay_steps WHERE replay_id = ? AND repeat = 0 ORDER BY pass""",
        [rid],
    ).fetchall()
    names = ("pass", "step", "position", "recorded_loss", "replay_loss", "entropy", "top1_id", "top1_prob")
    out = []
    for row in rows:
        item = dict(zip(names, row, strict=True))
        item["target"] = item["pass"] == target_pass
        rec, rep = item["recorded_loss"], item["replay_loss"]
        item["diff"] = None if rec is None or rep is None or not np.isfinite(rec) else rep - rec
        out.append(item)
    return out


CPU_REASON = "the model is not on a CUDA device"  # publisher/recorder.py: nothing to say about a GPU


def gpu_summary(cupti: dict | None) -> dict | None:
    """The replay's CUPTI summary (meta `cupti`, llmobs.cupti.replay_activity) per replayed pass."""
    if not isinstance(cupti, dict):
        return None
    if cupti.get("status") != "collected":
        return {"status": "off", "reason": str(cupti.get("reason") or "")}
    kernels = [int(k) for k in cupti.get("kernels") or []]
    kernel_ns = [int(k) for k in cupti.get("kernel_ns") or []]
    passes = max(len(kernels), 1)
    return {
        "status": "collected", "reason": "", "kernels": kernels, "kernel_ns": kernel_ns,
        "kernels_per_pass": sum(kernels) / passes, "kernel_us_per_pass": sum(kernel_ns) / passes / 1e3,
        "top_kernels": list(cupti.get("top_kernels") or []), "other_records": cupti.get("other_records", 0),
        "dropped_records": cupti.get("dropped_records", 0),
    }  # fmt: skip


def _num(value, fmt: str = ".6f") -> str:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return "-"
    return format(value, fmt)


def print_report(report: dict, out=None) -> None:
    w = (out or sys.stdout).write
    r = report
    w(f"verdict: {r['verdict'].upper().replace('_', ' ')}: {r['detail']}\n")
    w(
        f"replay {r['replay_id']} of step {r['step']} (step_seq {r['step_seq']}, row {r['batch_row']})"
        f" of trace {r['trace_id']}, pid {r['pid']}\n"
    )
    if r["status"] == "ok":
        source = (
            f"from a snapshot of {r['snapshot_len']} positions"
            if r["source"] == "snapshot"
            else "from the prompt"
        )
        w(
            f"  {source}, {r['repeats']} repeats, {_num(r['wall_ms'], '.0f')} ms (prefill "
            f"{_num(r['prefill_ms'], '.0f')} ms); live batch size {r['live_batch_size']};"
            f" model {r['model']}\n"
        )
        w(f"  op graph {r['op_graph_hash']}, {r['linear_calls']} F.linear calls per pass\n")
        gpu = r.get("gpu")
        if gpu and gpu["status"] == "collected":
            top = ", ".join(f"{k['name'][:40]} {k['ns'] / 1e3:,.0f} us" for k in gpu["top_kernels"][:3])
            w(f"  GPU (CUPTI): {gpu['kernels_per_pass']:.0f} kernels and {gpu['kernel_us_per_pass']:,.1f} us "
              f"of kernel time per replayed pass; top: {top or '-'}\n")  # fmt: skip
        elif gpu and gpu.get("reason") and gpu["reason"] != CPU_REASON:
            w(f"  GPU (CUPTI): not collected: {gpu['reason']}\n")
    if r["first_diverging_layer"] is not None:
        w(f"  first diverging layer: {r['first_diverging_layer']} (cause: {r['cause']})\n")
    rc = r["root_cause"]
    if rc is not None:
        w(
            f"root cause (replay streams): {rc['module']}: {_kind(rc['kind'])} {rc['value']:.4g} vs the"
            f" window's median {rc['median']:.4g} (MAD {rc['mad']:.3g}, {rc['passes']} passes):"
            f" robust z {rc['z']:+.1f}\n"
        )
    elif r["status"] == "ok" and len(r["trajectory"]) - 1 < MIN_OTHER_PASSES:
        others, least = len(r["trajectory"]) - 1, (MIN_OTHER_PASSES + 1) // 2
        w(f"root cause (replay streams): none: the window has {others} passes beside the target,"
          f" {MIN_OTHER_PASSES} are needed (--window {least} or more)\n")  # fmt: skip
    elif r["status"] == "ok":
        w(
            f"root cause (replay streams): none: no stream of the target pass is {MIN_Z} robust z from the"
            " window's other passes\n"
        )
    if r["trajectory"]:
        w("trajectory (repeat 0; * the target):\n")
        head = ("step", 5), ("position", 8), ("recorded", 10), ("replayed", 10), ("diff", 9), ("entropy", 8)
        w("  " + " ".join(f"{name:>{width}}" for name, width in head) + "  top-1\n")
        for t in r["trajectory"]:
            mark = "*" if t["target"] else " "
            w(
                f"{mark} {t['step']:>5} {t['position']:>8} {_num(t['recorded_loss']):>10} "
                f"{_num(t['replay_loss']):>10} {_num(t['diff'], '+.1e'):>9} {_num(t['entropy'], '.3f'):>8}  "
                f"{t['top1_id']} ({_num(t['top1_prob'], '.3f')})\n"
            )
    w(f"stored in {r['db']} (tables replays, replay_steps, replay_layers, replay_ops)\n")


def _kind(kind: int) -> str:
    return {1: "attention entropy", 2: "MLP output variance"}.get(kind, f"kind {kind}")


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")
