"""`llmobs-agent query`: SQL, or a canned view, over the agent's DuckDB store; table, CSV or JSON."""

from __future__ import annotations

import argparse
import json
import sys

import duckdb

from llmobs.errors import StoreError, UsageError
from llmobs.store import default_db_path, schema, views
from llmobs.store.render import RENDERERS
from llmobs.store.sink import DuckDBStore

EXAMPLES = """examples:
  llmobs-agent query --slowest-steps -n 10 --tenant acme
  llmobs-agent query --by-tenant --format csv
  llmobs-agent query --anomaly-correlation
  llmobs-agent query --by-intent --format json
  llmobs-agent query --attribution --metric loss
  llmobs-agent query "SELECT tenant, count(*) FROM token_steps GROUP BY tenant"
"""
USAGE_HINT = "llmobs-agent query --help lists the canned views; SQL goes in one quoted argument"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    parser.add_argument("sql", nargs="?", help="a SQL query over the store's tables (docs/store-schema.md)")
    parser.add_argument("--db", help=f"the store (default: $LLMOBS_DB or {default_db_path()})")
    parser.add_argument("--format", choices=sorted(RENDERERS), default="table", help="output format")
    views_group = parser.add_mutually_exclusive_group()
    views_group.add_argument("--slowest-steps", action="store_true", help="token steps by decode latency")
    views_group.add_argument("--top-probes", action="store_true", help="probes by count (exact where kept)")
    views_group.add_argument(
        "--by-tenant",
        action="store_true",
        help="tokens, latency p50/p99, concurrency; compute-, off-CPU, GPU-s, allocations, their shares",
    )
    views_group.add_argument("--by-session", action="store_true", help="the same per (tenant, session)")
    views_group.add_argument(
        "--anomaly-correlation", action="store_true", help="layer streams vs loss anomalies"
    )
    views_group.add_argument(
        "--by-intent",
        action="store_true",
        help="requests clustered by prompt intent (action, format, constraints, shingles; docs/compare.md)",
    )
    views_group.add_argument(
        "--attribution",
        action="store_true",
        help="rank factors (labels, variant, model factors, tenant, intent) by effect, with intervals",
    )
    parser.add_argument(
        "--metric",
        choices=("loss", "anomaly", "latency"),
        default=None,
        help="--attribution: per-token loss (default), anomaly rate or latency per token",
    )
    parser.add_argument("-n", "--limit", type=int, default=20, help="rows for --slowest-steps/--top-probes")
    parser.add_argument("--tenant", help="only this tenant (canned views)")
    parser.add_argument("--session", help="only this session (canned views)")


def _statement(args: argparse.Namespace, version: int) -> tuple[str, dict | None]:
    """The SQL to run (the arguments checked already); `version`: the store's schema version (a canned
    view adapts to an older store)."""
    if args.slowest_steps:
        return views.slowest_steps(args.limit, args.tenant, args.session)
    if args.top_probes:
        return views.top_probes(args.limit)
    if args.by_tenant:
        return views.by_tenant(args.tenant, version=version)
    if args.by_session:
        return views.by_session(args.tenant, args.session, version=version)
    if args.anomaly_correlation:
        from llmobs.diagnostics.correlation import matrix_sql

        return matrix_sql()
    return args.sql, None


def _check_arguments(args: argparse.Namespace) -> None:
    """Argument mistakes are usage errors (exit 2), said before the store is opened: a store error (11)
    would send the caller to look at --db for what is a mistake on the command line."""
    canned = (args.slowest_steps, args.top_probes, args.by_tenant, args.by_session, args.anomaly_correlation,
              args.by_intent, args.attribution)  # fmt: skip
    if args.metric is not None and not args.attribution:
        raise UsageError("--metric goes with --attribution", hint=USAGE_HINT)
    if args.sql and any(canned):
        raise UsageError("give either SQL or a canned view, not both", hint=USAGE_HINT)
    if not (args.sql or any(canned)):
        raise UsageError("nothing to run: give SQL or a canned view", hint=USAGE_HINT)
    if args.limit <= 0:
        raise UsageError(f"-n must be at least 1, not {args.limit}", hint=USAGE_HINT)
    # A --tenant/--session the statement cannot apply is an error, never silently ignored: a caller
    # scoping a query to one tenant must not get every tenant's rows back (issue 8, security).
    if args.tenant is not None and not (args.slowest_steps or args.by_tenant or args.by_session):
        raise UsageError(
            "--tenant filters only --slowest-steps, --by-tenant and --by-session",
            hint="in SQL, filter with WHERE tenant = '...'",
        )
    if args.session is not None and not (args.slowest_steps or args.by_session):
        raise UsageError(
            "--session filters only --slowest-steps and --by-session",
            hint="in SQL, filter with WHERE session = '...'",
        )


def _by_intent(store: DuckDBStore, args: argparse.Namespace) -> int:
    """Intent clusters (llmobs.diagnostics.intent_cluster), one row each."""
    from llmobs.diagnostics import intent_cluster

    if schema.current_version(store.connection) < 13:
        raise StoreError("this store predates request intents (schema 13)", hint="run the agent on it once")
    before = intent_cluster.malformed
    clusters = intent_cluster.cluster(intent_cluster.load(store.connection))
    if intent_cluster.malformed > before:
        left_out = intent_cluster.malformed - before
        sys.stderr.write(f"note: {left_out} stored intent(s) with a malformed MinHash signature left out\n")
    if not clusters:
        sys.stderr.write(
            "note: no request intents stored: opt in with llmobs.instrument(model, tokenizer, intent=True)"
            " or llmobs.context(intent_text=...)\n"
        )
    full = args.format == "json"
    rows = intent_cluster.rows(clusters, full=full)
    if full:  # lists stay lists in JSON
        records = [dict(zip(intent_cluster.CLUSTER_COLUMNS, r, strict=True)) for r in rows]
        sys.stdout.write(json.dumps(records, indent=1) + "\n")
    else:
        sys.stdout.write(RENDERERS[args.format](intent_cluster.CLUSTER_COLUMNS, rows))
    return 0


def _attribution(store: DuckDBStore, args: argparse.Namespace) -> int:
    """The attribution matrix (llmobs.diagnostics.attribution): factors ranked, then interactions."""
    from llmobs.diagnostics import attribution

    result = attribution.attribution(store.connection, args.metric or "loss")
    if args.format == "table":  # the design (blocked by prompt, or requests) is in the header line
        sys.stdout.write(attribution.summary(result) + "\n")
        sys.stdout.write(RENDERERS["table"](attribution.COLUMNS, attribution.rows(result)))
        return 0
    columns = attribution.COLUMNS + attribution.DESIGN_COLUMNS
    sys.stdout.write(RENDERERS[args.format](columns, attribution.rows(result, design=True)))
    return 0


def run(args: argparse.Namespace) -> int:
    _check_arguments(args)
    with DuckDBStore(args.db or default_db_path(), read_only=True) as store:
        if args.by_intent:
            return _by_intent(store, args)
        if args.attribution:
            return _attribution(store, args)
        sql, params = _statement(args, schema.current_version(store.connection))
        try:
            result = (
                store.connection.execute(sql, params) if params is not None else store.connection.execute(sql)
            )
            columns = [d[0] for d in result.description or []]
            rows = result.fetchall() if columns else []
        except duckdb.Error as exc:
            raise StoreError(
                f"query failed: {str(exc).strip().splitlines()[0]}", hint="see docs/store-schema.md"
            ) from None
    sys.stdout.write(RENDERERS[args.format](columns, rows))
    return 0
