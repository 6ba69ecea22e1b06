"""`llmobs-agent export`: the store as Parquet files (one per table) or as a Perfetto (Chrome JSON) trace."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import duckdb

from llmobs.errors import StoreError, UsageError
from llmobs.store import default_db_path, schema
from llmobs.store.perfetto import write_perfetto
from llmobs.store.sink import DuckDBStore

EXAMPLES = """examples:
  llmobs-agent export --db /var/lib/llmobs/llmobs.duckdb --parquet /tmp/llmobs-parquet
  llmobs-agent export --perfetto /tmp/trace.json --since 1200000000000 --until 1260000000000
  (open the trace at https://ui.perfetto.dev; times are CLOCK_MONOTONIC ns, as stored)
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    parser.add_argument("--db", help=f"the store (default: $LLMOBS_DB or {default_db_path()})")
    parser.add_argument("--parquet", metavar="DIR", help="write one Parquet file per table into DIR")
    parser.add_argument("--perfetto", metavar="FILE", help="write a Chrome trace-event JSON for Perfetto")
    parser.add_argument(
        "--since", type=int, metavar="NS", help="--perfetto only: from this CLOCK_MONOTONIC ns"
    )
    parser.add_argument(
        "--until", type=int, metavar="NS", help="--perfetto only: up to this CLOCK_MONOTONIC ns"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def _progress(quiet: bool):
    started = time.monotonic()

    def report(what: str, count: int) -> None:
        if not quiet:
            print(f"  {what}: {count:,} ({time.monotonic() - started:.1f} s)", file=sys.stderr)

    return report


# An output that cannot be written is not a store problem: the hint names the output, not --db.
OUTPUT_HINT = "give %s a path this user can create and write"


def export_parquet(conn: duckdb.DuckDBPyConnection, directory: Path, report) -> dict[str, int]:
    """COPY every table of the schema to DIR/<table>.parquet; returns rows per table."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(
            f"cannot create {directory}: {exc.strerror}", hint=OUTPUT_HINT % "--parquet DIR"
        ) from None
    tables = ["schema_migrations", *schema.TIME_COLUMN]
    present = {r[0] for r in conn.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    rows = {}
    for index, table in enumerate(t for t in tables if t in present):
        target = directory / f"{table}.parquet"
        rows[table] = conn.execute(f"SELECT count(*) FROM {table}").fetchall()[0][0]
        try:
            conn.execute(f"COPY {table} TO '{target}' (FORMAT parquet, COMPRESSION zstd)")
        except duckdb.IOException as exc:  # the output, not the store: the store was read already
            first = str(exc).strip().splitlines()[0]
            raise StoreError(f"cannot write {target}: {first}", hint=OUTPUT_HINT % "--parquet DIR") from None
        report(f"[{index + 1}/{len(present & set(tables))}] {table} -> {target}", rows[table])
    return rows


def run(args: argparse.Namespace) -> int:
    # Argument mistakes are usage errors (exit 2), checked before the store is opened. The window is
    # Perfetto's alone: Parquet is the whole of every table (cutting rows by time would split requests
    # and forward passes that straddle the bounds), so --since/--until without --perfetto is refused.
    if not args.parquet and not args.perfetto:
        raise UsageError("nothing to export", hint="give --parquet DIR and/or --perfetto FILE")
    if (args.since is not None or args.until is not None) and not args.perfetto:
        raise UsageError(
            "--since/--until apply to --perfetto only", hint="add --perfetto FILE, or drop --since/--until"
        )
    if args.since is not None and args.until is not None and args.until < args.since:
        raise UsageError(f"--until {args.until} is before --since {args.since}", hint="swap the two times")
    report = _progress(args.quiet)
    with DuckDBStore(args.db or default_db_path(), read_only=True) as store:
        try:
            if args.parquet:
                rows = export_parquet(store.connection, Path(args.parquet), report)
                print(f"wrote {len(rows)} Parquet files ({sum(rows.values()):,} rows) to {args.parquet}")
            if args.perfetto:
                stats = write_perfetto(store.connection, args.perfetto, args.since, args.until, report)
                print(
                    f"wrote {args.perfetto}: {stats.token_steps:,} token steps on {stats.tracks['requests']}"
                    f" request tracks, {stats.probe_events:,} probe events on {stats.tracks['probes']} probe"
                    f" tracks, {stats.off_cpu_intervals:,} off-CPU intervals; open it at https://ui.perfetto.dev"
                )
        except duckdb.Error as exc:
            raise StoreError(f"export failed: {str(exc).strip().splitlines()[0]}") from None
        except OSError as exc:  # writing the trace file (the Parquet side says so itself)
            raise StoreError(
                f"export failed: {exc.strerror}: {exc.filename}", hint=OUTPUT_HINT % "--perfetto FILE"
            ) from None
    return 0
