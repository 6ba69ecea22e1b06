"""Benchmark the OTLP exporter against a real rotel collector on loopback: spans/s, agent CPU per 1k spans.

The store is filled once (synthetic token steps with eBPF events and rollups, records.md columns); each
round resets the export cursor and exports everything again, the modes interleaved by bench/harness.py
so that the noise of this shared 2-core machine hits them alike:

  grpc        OTLP/gRPC to rotel
  http        OTLP/HTTP (protobuf) to rotel
  encode-only the same loop with a transport that acknowledges without sending: the store read +
              encoding share of the cost, to see what the wire adds
  grpc 1/10   gRPC with --sample 10: spans of 1 request in 10 (every step still read, metrics exact)

CPU is this process's CPU time (user + system, every thread, DuckDB's included) per 1,000 spans; rotel's
own CPU is shown for reference. Ratios are to encode-only.

Then, side by side, the previous release against this tree (skip with --no-baseline): each arm a
subprocess of bench/runtime_arm.py `otlp` with PYTHONPATH=<tree>/agent (a fresh store of --steps
synthetic, correlated steps exported over gRPC to the same rotel), interleaved ABBA, with the ratio
this tree / main and its 95% interval; the figure is the arm's CPU (time.process_time) per 1,000 spans.
Each arm reads the store as a running agent opens it (--store agent, the default: one DuckDB thread and
its memory cap, as `attach --otlp` and `run` export) or with DuckDB's defaults (--store default, as
`llmobs-agent otlp --db` does).

    .venv/bin/python -m bench.otlp [--steps N] [--rounds R] [--baseline DIR | --no-baseline]
        [--store agent|default] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import psutil
from llmobs import clock
from llmobs.otlp.config import OtlpConfig, resolve
from llmobs.otlp.delivery import OtlpExporter
from llmobs.otlp.source import DDL
from llmobs.otlp.transport import SendResult, Transport
from llmobs.pipeline import correlate
from llmobs.store import synthetic
from llmobs.store.sink import DuckDBStore

from bench.harness import Arm, Report, add_json_option
from bench.rotel_harness import Rotel


class AckTransport(Transport):
    """Acknowledges without sending, after serialising (the wire format is part of the encode cost)."""

    def send_traces(self, request):
        request.SerializeToString()
        return SendResult(ok=True)

    def send_metrics(self, request):
        request.SerializeToString()
        return SendResult(ok=True)


def build_store(path: Path, steps: int, tokens: int, batch_rows: int) -> int:
    requests = max(steps // tokens, 1)
    store = DuckDBStore(path)
    table = synthetic.token_steps(
        4242,
        requests,
        tokens,
        batch_rows=batch_rows,
        start_ns=max(clock.monotonic_ns() - 300_000_000_000, 1_000_000_000),
    )
    store.append({"token_steps": table, "events": synthetic.events_for_steps(table)})
    correlate.correlate(store.connection)
    store.close()
    return table.num_rows


def exporter_for(conn, mode: str, rotel: Rotel, batch: int) -> OtlpExporter:
    """A fresh exporter of the whole store (cursor reset) for one mode."""
    for statement in DDL:
        conn.execute(statement)
    conn.execute("DELETE FROM otlp_cursor")
    conn.execute("DELETE FROM otlp_requests")
    transport = None
    if mode in ("grpc", "grpc 1/10"):
        sample_n = 10 if mode == "grpc 1/10" else 1
        config = resolve(
            {"endpoint": rotel.grpc_endpoint, "protocol": "grpc", "batch_spans": batch, "sample_n": sample_n},
            env={},
        )
    elif mode == "http":
        config = resolve(
            {"endpoint": rotel.http_endpoint, "protocol": "http/protobuf", "batch_spans": batch}, env={}
        )
    else:
        config = resolve({"batch_spans": batch}, env={})
        transport = AckTransport()
    return OtlpExporter(conn.cursor(), config, transport)


def export_arm(store: DuckDBStore, mode: str, rotel: Rotel, batch: int, steps: int) -> Arm:
    rotel_process = psutil.Process(rotel.process.pid)

    def once(ctx) -> dict[str, float]:
        exporter = exporter_for(store.connection, mode, rotel, batch)
        rotel_cpu0 = sum(rotel_process.cpu_times()[:2])
        with ctx.timed() as watch:  # CPU: this process, every thread (DuckDB's included)
            counters = exporter.run(give_up_after_s=30)
        exporter.shutdown()
        rotel_cpu = sum(rotel_process.cpu_times()[:2]) - rotel_cpu0
        rotel.logs[-1].write_bytes(b"")  # the debug log grows by ~1 KB per span
        spans = counters.spans_sent
        figures = {"spans": spans, "spans/s": spans / watch.wall,
                   "agent CPU ms/1k spans": watch.cpu / spans * 1e6,
                   "agent CPU ms/1k steps": watch.cpu / steps * 1e6}  # fmt: skip
        if mode != "encode-only":
            figures["rotel CPU ms/1k spans"] = rotel_cpu / spans * 1e6
        return figures

    return Arm(mode, once)


BASELINE = Path("/tmp/llmobs-main")  # `git worktree add --detach /tmp/llmobs-main <main>`
TARGET_MS_PER_1K = 30.0


def side_by_side(report: Report, rotel: Rotel, args) -> None:
    """main's tree and this one, each exporting a fresh store over gRPC: CPU ms per 1,000 spans."""
    from bench.runtime import REPO, arm

    if not (args.baseline / "agent" / "llmobs" / "__init__.py").exists():
        report.note(f"no baseline tree at {args.baseline}: git worktree add --detach {args.baseline} main")
        return
    opts = {"steps": args.steps, "endpoint": rotel.grpc_endpoint, "store": args.store}
    imported: dict[str, str] = {}
    trees = {"main": args.baseline, "this tree": REPO}
    arms = [arm(name, tree, "otlp", opts, imported) for name, tree in trees.items()]

    def clear_log(comparison, index, name) -> None:
        rotel.logs[-1].write_bytes(b"")

    made = report.compare(f"OTLP over gRPC, main vs this tree ({args.store} store)", arms, args.rounds,
                          baseline="main",
                          better={"CPU ms/1k spans": "lower", "spans/s": "higher"},
                          metrics=["CPU ms/1k spans", "spans/s", "spans"], progress=clear_log)  # fmt: skip
    ours = made.median("this tree", "CPU ms/1k spans")
    if ours == ours:  # NaN when no round measured it
        report.note(f"this tree: {ours:.1f} CPU ms per 1,000 spans ({ours / TARGET_MS_PER_1K:.2f}x the "
                    f"{TARGET_MS_PER_1K:.0f} ms target)")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20_000, help="token steps in the store")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per request")
    parser.add_argument("--batch-rows", type=int, default=4, help="requests decoded per forward pass")
    parser.add_argument("--batch", type=int, default=OtlpConfig().batch_spans,
                        help="token-step spans per batch (default: the exporter's default)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, default=BASELINE, help=f"main's tree (default {BASELINE})")
    parser.add_argument("--no-baseline", action="store_true", help="skip the side-by-side with main")
    parser.add_argument("--store", choices=("agent", "default"), default="agent",
                        help="side by side: read the store as a running agent does (one DuckDB thread, "
                             "its memory cap) or with DuckDB's defaults (otlp --db)")  # fmt: skip
    add_json_option(parser)
    args = parser.parse_args()
    report = Report("otlp", args)
    with tempfile.TemporaryDirectory(prefix="bench-otlp-") as tmp:
        db = Path(tmp) / "bench.duckdb"
        steps = build_store(db, args.steps, args.tokens, args.batch_rows)
        modes = ("encode-only", "grpc", "http", "grpc 1/10")
        with Rotel(Path(tmp) / "rotel") as rotel, DuckDBStore(db) as store:
            report.note(
                f"store: {steps:,} token steps, {args.steps // args.tokens:,} requests, "
                f"{sum(p.count for p in synthetic.DEFAULT_PROBES)} sampled events per forward pass; "
                f"batch {args.batch}; rotel on 127.0.0.1:{rotel.grpc_port}/{rotel.http_port}"
            )
            export_arm(store, "encode-only", rotel, args.batch, steps).once(-1)  # warm-up: caches, imports
            arms = [export_arm(store, mode, rotel, args.batch, steps) for mode in modes]
            report.compare("OTLP export of the whole store", arms, args.rounds,
                           metrics=["spans", "spans/s", "agent CPU ms/1k spans", "rotel CPU ms/1k spans",
                                    "agent CPU ms/1k steps"])  # fmt: skip
            if not args.no_baseline:
                side_by_side(report, rotel, args)
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
