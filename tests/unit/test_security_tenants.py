"""Issue 8, security: a query scoped to one tenant never returns another tenant's rows.

A real DuckDB store holds three tenants whose names are built to trip naive filters: one is a prefix of
another ("acme" / "acme-labs", which LIKE 'acme%' or a startswith would mix) and one carries SQL
metacharacters ("o'neil%_"). Every canned view that takes a tenant (found by signature, so a view added
later is covered without editing this test) must return rows of that tenant only, with the same numbers
as a direct SQL query on that tenant's rows; views that cannot filter by tenant must refuse --tenant
instead of silently returning everyone's rows.
"""

from __future__ import annotations

import inspect
import json

import duckdb
import pyarrow as pa
import pytest
from llmobs.cli import main
from llmobs.errors import ExitCode
from llmobs.pipeline.correlate import correlate
from llmobs.store import DuckDBStore, synthetic, views

TENANTS = ("acme", "acme-labs", "o'neil%_")


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.duckdb"
    with DuckDBStore(path) as store:
        one = synthetic.token_steps(pid=11, requests=6, tokens_per_request=5, tenants=TENANTS, seed=4)
        two = synthetic.token_steps(
            pid=12, requests=6, tokens_per_request=4, batch_rows=2, tenants=TENANTS[::-1], seed=5,
            start_ns=5_000_000_000_000,
        )  # fmt: skip
        steps = pa.concat_tables([one, two])
        assert store.export({"token_steps": steps, "events": synthetic.events_for_steps(steps, seed=6)}).ok
        correlate(store.connection)
    return path


def _tenant_views():
    """Every canned view function that accepts a tenant filter."""
    found = [
        (name, fn)
        for name, fn in inspect.getmembers(views, inspect.isfunction)
        if not name.startswith("_")
        and fn.__module__ == views.__name__
        and "tenant" in inspect.signature(fn).parameters
    ]
    assert {name for name, _ in found} >= {"slowest_steps", "by_tenant", "by_session"}
    return found


def _rows(db, sql, params) -> list[dict]:
    with duckdb.connect(str(db), read_only=True) as con:
        result = con.execute(sql, params)
        columns = [d[0] for d in result.description]
        return [dict(zip(columns, row, strict=True)) for row in result.fetchall()]


def test_the_store_really_holds_every_tenant(db):
    rows = _rows(db, "SELECT tenant, count(*) AS n FROM token_steps GROUP BY tenant", {})
    assert {row["tenant"] for row in rows} == set(TENANTS) and all(row["n"] for row in rows)


@pytest.mark.parametrize("tenant", TENANTS)
def test_every_tenant_view_returns_only_that_tenant(db, tenant):
    for name, view in _tenant_views():
        sql, params = view(tenant=tenant)
        rows = _rows(db, sql, params)
        assert rows, f"{name}: no rows for {tenant!r}"
        assert all("tenant" in row for row in rows), f"{name}: rows without a tenant column cannot be checked"
        assert {row["tenant"] for row in rows} == {tenant}, f"{name} leaked {[r['tenant'] for r in rows]}"


@pytest.mark.parametrize("tenant", TENANTS)
def test_tenant_usage_numbers_come_from_that_tenants_rows_only(db, tenant):
    sql, params = views.by_tenant(tenant=tenant)
    (row,) = _rows(db, sql, params)
    truth = _rows(
        db,
        "SELECT count(*) AS tokens, round(quantile_cont(latency_ns, 0.99) / 1e6, 3) AS p99_ms "
        "FROM token_steps WHERE tenant = $tenant",
        {"tenant": tenant},
    )[0]
    assert (row["tokens"], row["p99_ms"]) == (truth["tokens"], truth["p99_ms"])


@pytest.mark.parametrize("tenant", TENANTS)
def test_query_cli_with_tenant_returns_only_that_tenant(db, tenant, capsys):
    for view in ("--slowest-steps", "--by-tenant", "--by-session"):
        code = main(["query", view, "--tenant", tenant, "-n", "1000", "--db", str(db), "--format", "json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        rows = json.loads(out)
        assert rows and {row["tenant"] for row in rows} == {tenant}, (view, rows)


@pytest.mark.parametrize(
    "argv",
    [
        ["--top-probes", "--tenant", "acme"],
        ["--anomaly-correlation", "--tenant", "acme"],
        ["SELECT tenant FROM token_steps", "--tenant", "acme"],
        ["--by-tenant", "--session", "s"],
        ["SELECT 1", "--session", "s"],
    ],
)
def test_a_filter_the_view_cannot_apply_is_refused_not_ignored(db, argv, capsys):
    code = main(["query", *argv, "--db", str(db)])
    out, err = capsys.readouterr()
    assert code == ExitCode.USAGE and out == ""  # an argument mistake, not the store's (exit 11)
    lines = err.strip().splitlines()
    assert lines[0].startswith("error: --") and "filters only" in lines[0], err
    assert "Traceback" not in err
