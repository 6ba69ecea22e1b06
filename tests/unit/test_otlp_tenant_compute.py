"""Per-tenant compute metrics (llmobs.otlp.tenant_compute): pass_shares summed by tenant in a real
DuckDB store, the final part kept and only the recent tail summed again, re-shared recent passes counted
once, tenants past the cap folded into "other", and the OTLP points carrying exactly the store's sums."""

from __future__ import annotations

import pytest
from llmobs.otlp.genai_metrics import TENANT_OTHER, TenantCap
from llmobs.otlp.tenant_compute import METRICS, STABLE_NS, TenantCompute
from llmobs.store.sink import DuckDBStore
from opentelemetry.proto.metrics.v1 import metrics_pb2

pytestmark = pytest.mark.unit
S = 1_000_000_000


def _share(
    conn, seq: int, t_ns: int, tenant: str | None, compute: int, off: int, gpu: int | None, allocs: int
):
    conn.execute(
        "INSERT INTO pass_shares (pid, step_seq, t_start_ns, row_kind, tokens, weight, compute_ns,"
        " off_cpu_ns, allocations, alloc_bytes, compute_calls, launches, gpu_ns, tenant)"
        " VALUES (7, ?, ?, 'step', 1, 1, ?, ?, ?, 0, 0, 0, ?, ?)",
        [seq, t_ns, compute, off, allocs, gpu, tenant],
    )


def _sql(conn) -> dict[str, list[float]]:
    rows = conn.execute(
        "SELECT coalesce(tenant, ''), sum(compute_ns), sum(off_cpu_ns), coalesce(sum(gpu_ns), 0),"
        " sum(allocations) FROM pass_shares GROUP BY 1"
    ).fetchall()
    return {t: [float(v) for v in values] for t, *values in rows}


def _points(compute: TenantCompute, now: int) -> dict[str, dict[str, float]]:
    scope = metrics_pb2.ScopeMetrics()
    added = compute.encode_into(scope, now)
    out = {}
    for metric in scope.metrics:
        assert metric.sum.is_monotonic
        assert metric.sum.aggregation_temporality == metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
        out[metric.name] = {
            dp.attributes[0].value.string_value: dp.as_double for dp in metric.sum.data_points
        }
    assert added == sum(len(v) for v in out.values())
    return out


def test_tenant_sums_equal_the_store_and_the_tail_is_summed_again(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb")
    conn = store.connection
    compute = TenantCompute(conn.cursor(), TenantCap(), wall_offset_ns=1000)
    assert compute.totals() == {} and _points(compute, 5) == {}  # no pass shared yet: no metric
    t0 = 100 * S
    # old passes (final once the newest is STABLE_NS later), then recent ones
    _share(conn, 1, t0, "acme", 1_000_001, 7, 300, 3)
    _share(conn, 1, t0, "globex", 999_999, 5, None, 2)
    _share(conn, 2, t0 + S, "acme", 2_000_003, 11, 500, 5)
    _share(conn, 3, t0 + STABLE_NS + 10 * S, "globex", 40, 1, 2, 1)
    _share(conn, 3, t0 + STABLE_NS + 10 * S, None, 60, 2, 3, 1)  # a row without a tenant: ""
    assert compute.totals() == _sql(conn)
    assert compute._final_until == t0 + 10 * S  # the two old passes are now kept, summed once
    # correlate re-shares a recent pass: its rows replaced; the old ones must not be counted again
    conn.execute("DELETE FROM pass_shares WHERE step_seq = 3")
    _share(conn, 3, t0 + STABLE_NS + 10 * S, "globex", 70, 2, 4, 2)
    _share(conn, 3, t0 + STABLE_NS + 10 * S, None, 30, 1, 1, 0)
    _share(conn, 4, t0 + STABLE_NS + 11 * S, "acme", 5, 0, 0, 1)
    assert compute.totals() == _sql(conn)
    points = _points(compute, now=9)
    expected = _sql(conn)
    for index, (name, _column, scale, _unit, _description) in enumerate(METRICS):
        assert points[name] == {t: v[index] * scale for t, v in expected.items()}
    scope = metrics_pb2.ScopeMetrics()
    compute.encode_into(scope, 9)
    assert {dp.start_time_unix_nano for m in scope.metrics for dp in m.sum.data_points} == {t0 + 1000}
    store.close()


def test_tenants_past_the_cap_read_other(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb")
    conn = store.connection
    cap = TenantCap(cap=2)
    compute = TenantCompute(conn.cursor(), cap, wall_offset_ns=0)
    for seq, tenant in enumerate(("a", "b", "c", "d"), start=1):
        _share(conn, seq, seq * S, tenant, 10 * seq, 0, 0, seq)
    totals = compute.totals()
    assert sorted(totals) == ["a", "b", TENANT_OTHER]
    assert totals[TENANT_OTHER] == [30.0 + 40.0, 0.0, 0.0, 3.0 + 4.0]
    assert compute.totals() == totals  # read again: the same labels
    assert cap.kept == {"a", "b"} and cap.folded == 0  # folds count served requests, not these reads
    store.close()
