"""`llmobs-agent doctor [--json]`: a table of what this host can do, one row per capability.

The checks live in llmobs.hostcheck; this module renders them, and adds the one row whose check needs
llmobs.otlp (whether the OTLP encoder's C parts are built), a layer hostcheck may not import. Exit
status: 0 when the agent can run at least its CPU probe profile here, ExitCode.HOST_UNSUPPORTED
otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

from llmobs.errors import ExitCode
from llmobs.hostcheck import GPU_CHECKS, Check, Row, Status, cpu_profile_ok, default_checks, run_checks
from llmobs.hostcheck.model import Context, Finding


def check_otlp_encoder(ctx: Context) -> Finding:
    """Whether the OTLP encoder's C parts (otlp/c/wire_gather.c: the gather and the span-id hash) are
    built: without them the export sends the same bytes at more CPU per span."""
    from llmobs.otlp import wire  # numpy and pyarrow: only when doctor runs, not whenever the CLI starts

    if wire.gather_backend() != "c":
        return Finding(
            Status.DEGRADED,
            "OTLP export gathers with numpy and hashes span ids with hashlib (llmobs.otlp._wire_gather not "
            "built): the same spans at more CPU each",
            "install gcc, libc6-dev and python3-dev, then reinstall llmobs-agent (in a checkout: "
            "scripts/setup.sh)",
        )
    if wire.span_ids_backend() != "c":
        return Finding(
            Status.DEGRADED,
            "OTLP export gathers in C but hashes span ids with hashlib (llmobs.otlp._wire_gather built "
            "before step_span_ids)",
            "reinstall llmobs-agent (in a checkout: scripts/setup.sh) to rebuild it",
        )
    return Finding(Status.OK, "C gather and span-id hash (llmobs.otlp._wire_gather)")


OTLP_ENCODER = Check("otlp_encoder", "OTLP encoder", check_otlp_encoder, 5.0, False)


def check_ingest_decoder(ctx: Context) -> Finding:
    """Whether the store's C ingest decoder (store/c/event_split.c) is built: without it the ring's
    records are decoded with numpy, to the same rows at more CPU per event."""
    from llmobs.store import ingest  # numpy and pyarrow: only when doctor runs

    if ingest.decoder_backend() != "c":
        return Finding(
            Status.DEGRADED,
            "ring records are decoded with numpy (llmobs.store._event_split not built): the same rows at "
            "more CPU each",
            "install gcc, libc6-dev and python3-dev, then reinstall llmobs-agent (in a checkout: "
            "scripts/setup.sh)",
        )
    return Finding(Status.OK, "C decoder (llmobs.store._event_split)")


INGEST_DECODER = Check("ingest_decoder", "Ingest decoder", check_ingest_decoder, 5.0, False)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print the rows as a JSON list instead of a table"
    )
    parser.add_argument(
        "--pid",
        type=int,
        default=None,
        help="also read this process's OpenTelemetry process context (OTEL_CTX)",
    )


def render_table(rows: list[Row]) -> str:
    """The rows as a fixed-width table; rows that are not OK get an indented `-> what to do` line."""
    title_width = max([len(row.title) + 2 for row in rows] + [len("CHECK")])
    status_width = max(len(s) for s in Status)
    lines = [
        f"llmobs-agent doctor: kernel {platform.release()}, python {platform.python_version()}, "
        f"{'root' if os.geteuid() == 0 else f'uid {os.geteuid()}'}",
        "",
        f"{'CHECK':<{title_width}}  {'STATUS':<{status_width}}  DETAIL",
    ]
    for row in rows:
        marker = "*" if row.required else " "
        lines.append(f"{row.title + ' ' + marker:<{title_width}}  {row.status:<{status_width}}  {row.detail}")
        if row.status is not Status.OK and row.hint:
            lines.append(f"{'':<{title_width}}  {'':<{status_width}}  -> {row.hint}")
    lines.append("")
    required = ", ".join(row.title for row in rows if row.required)
    lines.append(f"* needed by the CPU probe profile ({required})")
    lines.append(verdict(rows))
    return "\n".join(lines)


def verdict(rows: list[Row]) -> str:
    if cpu_profile_ok(rows):
        gpu_missing = [row.title for row in rows if row.check in GPU_CHECKS and row.status is Status.MISSING]
        gpu = f"; GPU features off here ({', '.join(gpu_missing)} missing)" if gpu_missing else ""
        return f"verdict: the CPU probe profile can run on this host{gpu}"
    missing = [row.title for row in rows if row.required and row.status is Status.MISSING]
    return f"verdict: this host cannot run the agent's CPU probe profile (missing: {', '.join(missing)})"


def run(args: argparse.Namespace) -> int:
    rows = run_checks(checks=[*default_checks(), OTLP_ENCODER, INGEST_DECODER])
    if getattr(args, "pid", None) is not None:
        from llmobs.hostcheck.otelctx import process_row

        rows.append(process_row(args.pid))
    if args.json:
        print(json.dumps([row.to_dict() for row in rows], indent=2))
    else:
        print(render_table(rows))
    sys.stdout.flush()
    return ExitCode.OK if cpu_profile_ok(rows) else ExitCode.HOST_UNSUPPORTED
