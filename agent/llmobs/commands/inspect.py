"""`llmobs-agent inspect --pid N`: the header, counters, context cell and last steps of a live map."""

from __future__ import annotations

import json
import math

from llmobs.shm import layout

_STATES = {layout.STATE_LIVE: "live", layout.STATE_CLOSED: "closed"}
_ACKS = {
    layout.ACK_OK: "ok",
    layout.ACK_UNSUPPORTED: "unsupported",
    layout.ACK_UNKNOWN_COMMAND: "unknown command",
    layout.ACK_NO_GPU: "no gpu",
    layout.ACK_BUSY: "busy",
}


def configure(parser) -> None:
    parser.add_argument("--pid", type=int, required=True, help="process id of the instrumented workload")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument(
        "--last", type=int, default=10, metavar="K", help="how many recent token steps to show"
    )
    parser.add_argument("--shm-dir", default=layout.SHM_DIR, help="where maps live (default %(default)s)")


def _clean(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def collect(pid: int, last: int, shm_dir: str = layout.SHM_DIR) -> dict:
    from llmobs.shm.reader import ShmReader

    with ShmReader(pid, shm_dir=shm_dir) as reader:
        h = reader.header
        cursor = max(0, h["steps_head"] - max(0, last))
        batch = reader.read_steps(cursor)
        rows = [{k: _clean(v) for k, v in row.items()} for row in batch.rows()][-last:] if last > 0 else []
        ctx = reader.context()
        if ctx is not None:
            ctx["tenant"] = reader.name(ctx["tenant_hash"])
            ctx["session"] = reader.name(ctx["session_hash"])
        return {
            "path": reader.path,
            "header": h,
            "state": _STATES.get(h["state"], "?"),
            "model_id": reader.name(h["model_hash"]),
            "context": ctx,
            "control": reader.control(),
            "names": len(reader.names),
            "steps": rows,
            "unreadable_in_window": {"lost": batch.lost, "corrupt": batch.corrupt},
            "otel_process_context": _otel_context(pid),
        }


def _otel_context(pid: int) -> dict | None:
    """The process's OTEL_CTX (OTEP 4719) as read: its format (as merged, or the pre-merge draft),
    status, resource and extra attributes; None when it publishes none or cannot be read."""
    from llmobs.shm.otel_ctx_reader import read_process_context

    try:
        context = read_process_context(pid)
    except (OSError, ValueError, IndexError):
        return None
    return context.to_dict() if context is not None else None


def otel_context_line(otel: dict) -> str:
    """One `otel_ctx` line: which layout, then the identity it carries (or why it did not decode)."""
    layout_name = {
        "otep-4719": "OTEP 4719",
        "pre-merge-draft": "pre-merge draft (epoch timestamp, bare Resource payload)",
        "development-v1": "development version 1",
    }.get(otel["format"], otel["format"])
    if otel["status"] != "ok":
        return f"otel_ctx   {layout_name} v{otel['version']}  {otel['status']}: {otel['detail']}"
    resource = otel["resource"]
    thread = "  thread ctx " + str(otel["attributes"]["threadlocal.schema_version"]) if (
        "threadlocal.schema_version" in otel["attributes"]) else ""  # fmt: skip
    return (f"otel_ctx   {layout_name} v{otel['version']}  service.name {resource.get('service.name', '-')}  "
            f"service.instance.id {resource.get('service.instance.id', '-')}{thread}")  # fmt: skip


def run(args) -> int:
    info = collect(args.pid, args.last, args.shm_dir)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    h = info["header"]
    print(f"map        {info['path']}  ABI v{h['abi_version']}  {h['layout_size']} bytes  {info['state']}")
    print(f"writer     pid {h['writer_pid']}  uid {h['writer_uid']}  model {info['model_id'] or '-'}")
    for ring in ("steps", "names", "cupti"):
        print(
            f"{ring + ' ring':<11}head {h[ring + '_head']:<10} capacity {h[ring + '_capacity']:<8} "
            f"writer-dropped {h[ring + '_dropped']}"
        )
    otel = info["otel_process_context"]
    if otel:
        print(otel_context_line(otel))
    ctx = info["context"]
    if ctx is None:
        print("context    (being updated; try again)")
    elif ctx["step_seq"] == 0:
        print("context    untracked (no token step in progress)")
    else:
        who = f"tenant {ctx['tenant'] or '-'}  session {ctx['session'] or '-'}"
        print(f"context    step_seq {ctx['step_seq']}  trace {ctx['trace_id']}  {who}")
    c = info["control"]
    status = _ACKS.get(c["ack_status"], str(c["ack_status"])) if c["ack_seq"] else "-"
    acks = f"ack_seq {c['ack_seq']}  ack {status}"
    print(f"control    cmd_seq {c['cmd_seq']}  {acks}  reader_tail {c['reader_tail']}")
    steps = info["steps"]
    if not steps:
        print("steps      none yet")
        return 0
    print(f"last {len(steps)} steps:")
    print(f"  {'step_seq':>8} {'trace':<9} {'step':>4} {'pos':>5} {'token':>6} {'target':>6} {'loss':>8} "
          f"{'entropy':>8} {'p(tgt)':>7} {'rank':>5} {'top1':>6} {'lat_ms':>7}  tenant/session")  # fmt: skip
    for r in steps:
        loss = "nan" if r["loss"] is None else f"{r['loss']:.4f}"
        ptgt = "nan" if r["target_prob"] is None else f"{r['target_prob']:.4f}"
        who = f"{r['tenant'] or '-'}/{r['session'] or '-'}"
        print(
            f"  {r['step_seq']:>8} {r['trace_id'][:8]:<9} {r['step']:>4} {r['position']:>5} "
            f"{r['token_id']:>6} {r['target_id']:>6} {loss:>8} {r['entropy']:>8.4f} {ptgt:>7} "
            f"{r['target_rank']:>5} {r['top1_prob']:>6.3f} {r['latency_ns'] / 1e6:>7.2f}  {who}"
        )
    return 0
