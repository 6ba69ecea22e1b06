"""Benchmark the OTLP exporter against a real rotel collector on loopback: spans/s, agent CPU per 1k spans.

The store is filled once (synthetic token steps with eBPF events and rollups, records.md columns); each
round resets the export cursor and exports everything again, interleaving the modes so that the noise
of this shared 2-core machine hits them alike:

  grpc        OTLP/gRPC to rotel
  http        OTLP/HTTP (protobuf) to rotel
  encode-only the same loop with a transport that acknowledges without sending: the store read +
              encoding share of the cost, to see what the wire adds
  grpc 1/10   gRPC with --sample 10: spans of 1 request in 10 (every step still read, metrics exact)

CPU is this process's CPU time (user + system, every thread, DuckDB's included) per 1,000 spans; rotel's
own CPU is shown for reference. Run: .venv/bin/python scripts/bench_otlp.py [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
from llmobs import clock, correlate  # noqa: E402
from llmobs.otlp.config import resolve  # noqa: E402
from llmobs.otlp.delivery import OtlpExporter  # noqa: E402
from llmobs.otlp.source import DDL  # noqa: E402
from llmobs.otlp.transport import SendResult, Transport  # noqa: E402
from llmobs.store import synthetic  # noqa: E402
from llmobs.store.sink import DuckDBStore  # noqa: E402
from rotel_harness import Rotel  # noqa: E402


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


def export_once(store: DuckDBStore, mode: str, rotel: Rotel, batch: int) -> tuple[int, float, float, float]:
    conn = store.connection
    for statement in DDL:
        conn.execute(statement)
    conn.execute("DELETE FROM otlp_cursor")
    conn.execute("DELETE FROM otlp_requests")
    if mode in ("grpc", "grpc 1/10"):
        sample_n = 10 if mode == "grpc 1/10" else 1
        config = resolve(
            {"endpoint": rotel.grpc_endpoint, "protocol": "grpc", "batch_spans": batch, "sample_n": sample_n},
            env={},
        )
        transport = None
    elif mode == "http":
        config = resolve(
            {"endpoint": rotel.http_endpoint, "protocol": "http/protobuf", "batch_spans": batch}, env={}
        )
        transport = None
    else:
        config = resolve({"batch_spans": batch}, env={})
        transport = AckTransport()
    rotel_process = psutil.Process(rotel.process.pid)
    rotel_cpu0 = sum(rotel_process.cpu_times()[:2])
    exporter = OtlpExporter(conn.cursor(), config, transport)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    counters = exporter.run(give_up_after_s=30)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    exporter.shutdown()
    rotel_cpu = sum(rotel_process.cpu_times()[:2]) - rotel_cpu0
    return counters.spans_sent, wall, cpu, rotel_cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000, help="token steps in the store")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per request")
    parser.add_argument("--batch-rows", type=int, default=4, help="requests decoded per forward pass")
    parser.add_argument("--batch", type=int, default=512, help="token-step spans per OTLP request")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-otlp-") as tmp:
        db = Path(tmp) / "bench.duckdb"
        steps = build_store(db, args.steps, args.tokens, args.batch_rows)
        modes = ("grpc", "http", "encode-only", "grpc 1/10")
        results: dict[str, list[tuple[int, float, float, float]]] = {m: [] for m in modes}
        with Rotel(Path(tmp) / "rotel") as rotel, DuckDBStore(db) as store:
            print(
                f"store: {steps:,} token steps, {args.steps // args.tokens:,} requests, "
                f"{sum(p.count for p in synthetic.DEFAULT_PROBES)} sampled events per forward pass; "
                f"batch {args.batch}; rotel on 127.0.0.1:{rotel.grpc_port}/{rotel.http_port}"
            )
            export_once(store, "encode-only", rotel, args.batch)  # warm-up: caches, imports
            for round_index in range(args.rounds):
                order = modes if round_index % 2 == 0 else tuple(reversed(modes))
                for mode in order:
                    results[mode].append(export_once(store, mode, rotel, args.batch))
                    rotel.logs[-1].write_bytes(b"")  # the debug log grows by ~1 KB per span
        base = statistics.median(r[2] / r[0] * 1000 for r in results["encode-only"])
        print(
            f"{'mode':<12} {'spans':>7} {'spans/s':>9} {'agent CPU ms/1k spans':>22} {'x encode-only':>14}"
            f" {'rotel CPU ms/1k':>16} {'agent CPU ms/1k steps':>22}"
        )
        for mode in modes:
            rows = results[mode]
            spans = rows[0][0]
            rate = statistics.median(r[0] / r[1] for r in rows)
            cpu_per_k = statistics.median(r[2] / r[0] * 1000 for r in rows)
            rotel_per_k = (
                statistics.median(r[3] / r[0] * 1000 for r in rows) if mode != "encode-only" else 0.0
            )
            print(
                f"{mode:<12} {spans:>7,} {rate:>9,.0f} {cpu_per_k * 1000:>19,.1f} ms"
                f" {cpu_per_k / base:>13.2f}x {rotel_per_k * 1000:>13,.1f} ms"
                f" {statistics.median(r[2] / steps * 1000 for r in rows) * 1000:>19,.1f} ms"
            )
        print(f"(medians of {args.rounds} interleaved rounds; CPU = this process, all threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
