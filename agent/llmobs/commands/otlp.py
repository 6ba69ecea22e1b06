"""`llmobs-agent otlp`: export the store's unexported rows over OTLP (gRPC or HTTP/protobuf).

One-shot by default: exports every unexported token step (and closes open requests), sends the metrics
and exits; `--follow` keeps exporting new rows until SIGINT/SIGTERM. Progress is the export cursor in
the store, so a second run continues where the first stopped. Settings: flags > OTEL_EXPORTER_OTLP_*
environment > the [otlp] table of --config FILE > defaults (docs/otlp.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from llmobs.errors import StoreError
from llmobs.otlp import config as otlp_config
from llmobs.otlp.delivery import OtlpExporter
from llmobs.store import default_db_path
from llmobs.store.sink import DuckDBStore

EXAMPLES = """examples:
  llmobs-agent otlp --db /var/lib/llmobs/llmobs.duckdb --endpoint http://tempo:4317
  llmobs-agent otlp --endpoint https://otlp.example.com:4318 --protocol http/protobuf \\
      --header "authorization=Bearer $TOKEN" --follow
  OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 llmobs-agent otlp --db ./llmobs.duckdb
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    parser.add_argument("--db", help=f"the store (default: $LLMOBS_DB or {default_db_path()})")
    parser.add_argument(
        "--endpoint",
        help="collector URL (default: $OTEL_EXPORTER_OTLP_ENDPOINT, "
        "else http://localhost:4317 for grpc, :4318 for http/protobuf)",
    )
    parser.add_argument("--protocol", choices=otlp_config.PROTOCOLS, help="default: grpc")
    parser.add_argument("--follow", action="store_true", help="keep exporting new rows until interrupted")
    parser.add_argument("--header", action="append", metavar="KEY=VALUE", help="request header (repeatable)")
    parser.add_argument("--timeout", type=float, metavar="S", help="per-request timeout (default 10 s)")
    parser.add_argument("--insecure", action="store_true", default=None, help="no TLS (gRPC) / skip verify")
    parser.add_argument("--certificate", metavar="PEM", help="CA bundle to verify the collector")
    parser.add_argument("--client-key", metavar="PEM", help="mTLS client key")
    parser.add_argument("--client-certificate", metavar="PEM", help="mTLS client certificate")
    parser.add_argument("--compression", choices=("none", "gzip"))
    parser.add_argument(
        "--service-name", help="resource service.name (default: $OTEL_SERVICE_NAME or llmobs)"
    )
    parser.add_argument(
        "--resource-attr", action="append", metavar="KEY=VALUE", help="extra resource attribute"
    )
    parser.add_argument(
        "--trace-id",
        choices=("prompt", "random"),
        dest="trace_id_mode",
        help="trace id per request: the prompt-hash id (default) or a salted random one",
    )
    parser.add_argument("--batch", type=int, dest="batch_spans", metavar="N", help="token steps per batch")
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        metavar="N",
        help="largest trace request sent; a larger batch goes as several (default 3670016: 3.5 MiB)",
    )
    parser.add_argument(
        "--sample",
        type=int,
        dest="sample_n",
        metavar="N",
        help="send the spans of 1 request in N (the kernel's trace-id hash); metrics count all",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file with an [otlp] table")
    parser.add_argument(
        "--give-up-after",
        type=float,
        default=60.0,
        metavar="S",
        help="one-shot: stop retrying an unreachable collector after S seconds (default 60)",
    )
    parser.add_argument("--show-config", action="store_true", help="print the resolved settings and exit")
    parser.add_argument("--json", action="store_true", help="print the final counters as JSON")
    parser.add_argument("-q", "--quiet", action="store_true", help="no retry warnings on stderr")


def _cli_values(args: argparse.Namespace) -> dict[str, object]:
    values: dict[str, object] = {
        "endpoint": args.endpoint,
        "protocol": args.protocol,
        "timeout_s": args.timeout,
        "insecure": args.insecure,
        "certificate": args.certificate,
        "client_key": args.client_key,
        "client_certificate": args.client_certificate,
        "compression": args.compression,
        "service_name": args.service_name,
        "trace_id_mode": args.trace_id_mode,
        "batch_spans": args.batch_spans,
        "max_request_bytes": args.max_request_bytes,
        "sample_n": args.sample_n,
    }
    if args.header:
        values["headers"] = otlp_config.parse_key_values(",".join(args.header), "--header")
    if args.resource_attr:
        values["resource_attributes"] = otlp_config.parse_key_values(
            ",".join(args.resource_attr), "--resource-attr"
        )
    return values


def run(args: argparse.Namespace) -> int:
    file_values = otlp_config.load_file(args.config) if args.config else {}
    config = otlp_config.resolve(_cli_values(args), file_values=file_values)
    if args.show_config:
        shown = {k: v for k, v in vars(config).items() if k != "sources"}
        shown["headers"] = {k: "<redacted>" for k in config.headers}  # tokens must not reach logs
        print(json.dumps({"config": shown, "sources": config.sources}, indent=2, default=str))
        return 0
    logging.basicConfig(level=logging.ERROR if args.quiet else logging.WARNING, format="%(message)s")
    stop = threading.Event()
    if args.follow:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    started = time.monotonic()
    db = Path(args.db or default_db_path())
    if not db.exists():  # exporting must not create an empty store where the user mistyped a path
        raise StoreError(f"no store at {db}", hint="give the agent's store with --db PATH")
    with DuckDBStore(db) as store:
        exporter = OtlpExporter(store.cursor(), config, stop=stop)
        try:
            counters = exporter.run(follow=args.follow, give_up_after_s=args.give_up_after)
            status = exporter.status()
        finally:
            exporter.shutdown(timeout=0)
    elapsed = time.monotonic() - started
    if args.json:
        print(json.dumps({**status, "seconds": round(elapsed, 3)}))
    else:
        print(
            f"exported {counters.spans_sent:,} spans to {config.resolved_endpoint()} ({config.protocol}) in"
            f" {elapsed:.1f} s: {status['steps_exported']:,} token steps, {status['requests_exported']:,}"
            f" requests in total; failed attempts {counters.attempts_failed},"
            f" dropped {counters.spans_dropped}, pending {status['pending_steps']:,};"
            f" metrics sent {counters.metrics_sent}",
            file=sys.stdout,
        )
    return 0
