"""Per-tenant compute as OTLP metrics: the store's apportioned pass totals (pass_shares), summed by tenant.

A continuously batching server runs many tenants' rows in one forward pass; correlate shares each pass's
exact totals out to its rows by the tokens each processed (llmobs.pipeline.apportion, docs/store-schema.md
"pass_shares"). These metrics are those shares summed per tenant, so a backend sees what each tenant
cost, with the same numbers `query --by-tenant` prints:

    llmobs.tenant.compute_time    s              CPU time of the passes (compute_ns)
    llmobs.tenant.off_cpu_time    s              time the passes' threads were off CPU (off_cpu_ns)
    llmobs.tenant.gpu_time        s              GPU kernel time, where CUPTI measured it (gpu_ns)
    llmobs.tenant.allocations     {allocation}   allocator calls (allocations)

Cumulative monotonic sums, one point per tenant (`llmobs.tenant`, capped like the GenAI histograms:
genai_metrics.TenantCap, later tenants read "other"). Their start time is the store's first shared pass,
because the totals are the store's, not only what this exporter saw: a one-shot export of a day's store
reports the day.

Cost: correlate re-shares a pass only while it is recent (pipeline LATE_NS, 6 s, and the final re-roll at
detach), so passes older than STABLE_NS before the newest are summed once and kept; each metrics request
sums only the recent tail. A store that never shared a pass (no served rows, or a store from before
migration 9) sends none of these metrics.
"""

from __future__ import annotations

import duckdb
from opentelemetry.proto.metrics.v1 import metrics_pb2

from llmobs.otlp.encoder import key_values
from llmobs.otlp.genai_metrics import TENANT_OTHER, TenantCap

# Passes this much older than the newest one are final: correlate no longer re-shares them.
STABLE_NS = 60_000_000_000

# (metric name, pass_shares column, scale to the unit, unit, description)
METRICS = (
    ("llmobs.tenant.compute_time", "compute_ns", 1e-9, "s", "CPU time of forward passes, apportioned"),
    ("llmobs.tenant.off_cpu_time", "off_cpu_ns", 1e-9, "s", "Off-CPU time of forward passes, apportioned"),
    ("llmobs.tenant.gpu_time", "gpu_ns", 1e-9, "s", "GPU kernel time of forward passes, apportioned"),
    ("llmobs.tenant.allocations", "allocations", 1.0, "{allocation}", "Allocator calls, apportioned"),
)
_SUMS = ", ".join(f"coalesce(sum({column}), 0)" for _, column, _, _, _ in METRICS)
_RANGE = f"""
SELECT coalesce(tenant, ''), {_SUMS} FROM pass_shares
WHERE t_start_ns >= $lo AND t_start_ns < $hi GROUP BY 1 ORDER BY 1
"""
_BOUNDS = "SELECT min(t_start_ns), max(t_start_ns) FROM pass_shares"


def _plus(into: dict[str, list[float]], label: str, values: list[float]) -> None:
    previous = into.get(label)
    into[label] = list(values) if previous is None else [a + b for a, b in zip(previous, values, strict=True)]


class TenantCompute:
    """Sums pass_shares by tenant for each metrics request; the final part is summed once and kept."""

    def __init__(self, conn: duckdb.DuckDBPyConnection, tenants: TenantCap, wall_offset_ns: int):
        self.conn = conn
        self.tenants = tenants
        self.offset = wall_offset_ns
        self._final: dict[str, list[float]] = {}
        self._final_until: int | None = None  # pass_shares t_start_ns below this is in _final
        self._first_ns: int | None = None
        self._present: bool | None = None

    def _table_present(self) -> bool:
        if self._present is None:
            self._present = bool(
                self.conn.execute(
                    "SELECT count(*) FROM information_schema.tables WHERE table_name = 'pass_shares'"
                ).fetchall()[0][0]
            )
        return self._present

    def _label(self, tenant: str) -> str:
        """The tenant's name on the metrics: the cap the served-request histograms use (a tenant first
        seen here takes a free place), without counting folds: those count requests, and these sums
        are read again at every metrics request."""
        cap = self.tenants
        if not tenant or tenant in cap.kept:
            return tenant
        return cap.label(tenant) if len(cap.kept) < cap.cap else TENANT_OTHER

    def _sums(self, lo: int, hi: int) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for tenant, *values in self.conn.execute(_RANGE, {"lo": lo, "hi": hi}).fetchall():
            _plus(out, self._label(tenant), [float(v) for v in values])
        return out

    def totals(self) -> dict[str, list[float]]:
        """Tenant label -> the store's apportioned totals (METRICS' columns, unscaled); {} without passes."""
        if not self._table_present():
            return {}
        first, newest = self.conn.execute(_BOUNDS).fetchall()[0]
        if newest is None:
            return {}
        if self._final_until is None:
            self._first_ns = self._final_until = int(first)
        stable = int(newest) - STABLE_NS
        if stable > self._final_until:
            for label, values in self._sums(self._final_until, stable).items():
                _plus(self._final, label, values)
            self._final_until = stable
        result = {label: list(values) for label, values in self._final.items()}
        for label, values in self._sums(self._final_until, int(newest) + 1).items():
            _plus(result, label, values)
        return result

    def encode_into(self, scope, now_wall_ns: int) -> int:
        """Adds the METRICS to an OTLP ScopeMetrics; returns the number of points added."""
        totals = self.totals()
        if not totals:
            return 0
        start = self._first_ns + self.offset
        points = 0
        for index, (name, _column, scale, unit, description) in enumerate(METRICS):
            metric = scope.metrics.add()
            metric.name, metric.unit, metric.description = name, unit, description
            metric.sum.aggregation_temporality = metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
            metric.sum.is_monotonic = True
            for label, values in sorted(totals.items()):
                dp = metric.sum.data_points.add()
                dp.attributes.extend(key_values({"llmobs.tenant": label}))
                dp.start_time_unix_nano = start
                dp.time_unix_nano = now_wall_ns
                dp.as_double = values[index] * scale
                points += 1
        return points
