"""Metrics from exported batches: cumulative histograms and sums with exemplars pointing at spans.

Fed only with batches the collector acknowledged (so a retried batch is counted once) and sent every
`metrics_interval_s`. Cumulative temporality, starting when the exporter started: a failed metrics send
loses nothing, the next one carries the totals; an agent restart shows as a counter reset (new start
time), which Prometheus-compatible stores handle.

Cardinality: attributes are model, tenant and kernel *class*; kernel names (unbounded: templated C++
names) appear only on spans. Each histogram bucket keeps its latest exemplar (trace id, span id, value)
so a dashboard can jump from a slow bucket to a span. The GPU gauges (NVML's gpu_samples: the newest
sample of each process and GPU) are keyed by pid, GPU index and uuid, as OpenTelemetry's hw.gpu.*
conventions key a GPU by its id.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

import numpy as np
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1 import metrics_pb2

from llmobs.otlp import genai_metrics
from llmobs.otlp.columns import key_ids, string_codes
from llmobs.otlp.encoder import (
    DEFAULT_OPERATION,
    SCOPE_NAME,
    SCOPE_VERSION,
    SpanIds,
    key_values,
)
from llmobs.otlp.served import served_span_id
from llmobs.otlp.source import StepBatch

# Bucket boundaries: the GenAI conventions' advice for time per output token; powers of 4 for counts.
TIME_PER_TOKEN_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LOSS_BOUNDS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
COUNT_BOUNDS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)

# Kernel name -> class, first match wins. Names come from CUPTI (demangled or not).
KERNEL_CLASSES = (
    ("attention", re.compile(r"attn|attention|fmha|flash|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|matmul|cutlass|cublas|xmma|\bmm\b|ampere_.*_tn|sm\d+_xmma", re.I)),
    ("collective", re.compile(r"nccl", re.I)),
    ("softmax", re.compile(r"softmax", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("reduction", re.compile(r"reduce|reduction", re.I)),
    ("copy", re.compile(r"memcpy|copy", re.I)),
    ("memset", re.compile(r"memset|fill", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise", re.I)),
)


def kernel_class(name: str) -> str:
    for label, pattern in KERNEL_CLASSES:
        if pattern.search(name or ""):
            return label
    return "other"


@dataclass
class Exemplar:
    value: float
    time_ns: int
    trace_id: bytes
    span_id: bytes


@dataclass
class HistogramPoint:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0
    low: float = float("inf")
    high: float = float("-inf")
    exemplars: dict[int, Exemplar] = field(default_factory=dict)  # bucket index -> latest

    def __post_init__(self):
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def record(self, value: float, exemplar: Exemplar | None) -> None:
        index = bisect.bisect_left(self.bounds, value)  # OTLP buckets are (lower, upper]
        self.counts[index] += 1
        self.total += value
        self.count += 1
        self.low = min(self.low, value)
        self.high = max(self.high, value)
        if exemplar is not None:
            self.exemplars[index] = exemplar


@dataclass
class SumPoint:
    value: float = 0.0
    exemplar: Exemplar | None = None


@dataclass
class GaugePoint:
    value: float
    time_ns: int  # wall time of the sample


Attrs = tuple[tuple[str, object], ...]

# gpu_samples column -> (gauge, scale): SM utilisation as a ratio (hw.gpu.utilization's unit "1")
GPU_GAUGES = (("sm_util", "llmobs.gpu.utilization", 0.01), ("mem_used", "llmobs.gpu.memory.used", 1.0))


class MetricsAggregator:
    """Holds cumulative state per (instrument, attribute set); `observe` a batch, `encode` a request."""

    def __init__(self, ids: SpanIds, wall_offset_ns: int, start_wall_ns: int, resource: dict[str, object]):
        self.ids = ids
        self.offset = wall_offset_ns
        self.start_wall_ns = start_wall_ns
        self.resource = resource
        self.histograms: dict[str, dict[Attrs, HistogramPoint]] = {}
        self.sums: dict[str, dict[Attrs, SumPoint]] = {}
        self.gauges: dict[str, dict[Attrs, GaugePoint]] = {}
        self.observed_batches = 0
        # the agent's own telemetry (llmobs.governor.telemetry.agent_metrics), replaced whole each time
        self.agent_points: list = []
        self.agent_dirty = False
        self.tenants = genai_metrics.TenantCap()  # llmobs.tenant values of the served-request histograms
        self.tenant_compute = None  # a tenant_compute.TenantCompute over the exporter's store, if set

    def set_agent_metrics(self, points: list) -> None:
        """llmobs.agent.* points (gauges, cumulative sums) sent with the next metrics request."""
        self.agent_points = list(points)  # one assignment: the exporter thread sees old or new, whole
        self.agent_dirty = True

    def _hist(self, name: str, attrs: Attrs, bounds) -> HistogramPoint:
        series = self.histograms.setdefault(name, {})
        point = series.get(attrs)
        if point is None:
            point = series[attrs] = HistogramPoint(tuple(float(b) for b in bounds))
        return point

    def _sum(self, name: str, attrs: Attrs) -> SumPoint:
        return self.sums.setdefault(name, {}).setdefault(attrs, SumPoint())

    def observe(self, batch: StepBatch, exported=None) -> None:
        """Count every step of `batch`; exemplars only point at spans `exported(trace_id_hex)` accepts
        (all when None): with 1/N trace sampling the metrics stay exact and the links resolve.

        Per series, the values are bucketed in bulk (numpy) and added in row order; each bucket's
        exemplar is its last linked step, the one a row-by-row loop would have left there."""
        steps = batch.step_table
        n = steps.num_rows
        if n:
            pid = steps.column("pid").to_numpy().astype(np.int64)
            seq = steps.column("step_seq").to_numpy().astype(np.int64)
            batch_row = steps.column("batch_row").to_numpy().astype(np.int64)
            trace_column = steps.column("trace_id")
            model_codes, models = string_codes(steps.column("model_id"))
            tenant_codes, tenants = string_codes(steps.column("tenant"))
            if exported is None:
                linked = np.ones(n, dtype=bool)
            else:
                trace_codes, traces = string_codes(trace_column)
                linked = np.array([bool(exported(t)) for t in traces], dtype=bool)[trace_codes]
            t_start = steps.column("t_start_ns").to_numpy().astype(np.int64)
            t_end = steps.column("t_end_ns").to_numpy().astype(np.int64)
            time_ns = t_end + self.offset
            latency = steps.column("latency_ns").fill_null(0).to_numpy().astype(np.int64)
            latency_s = np.where(latency != 0, latency, t_end - t_start) / 1e9
            loss = np.asarray(steps.column("loss").fill_null(np.nan), dtype=np.float64)

            def exemplar(index: int, value: float) -> Exemplar:
                trace_hex, step_pid = trace_column[index].as_py(), int(pid[index])
                return Exemplar(
                    value,
                    int(time_ns[index]),
                    self.ids.trace_id(step_pid, trace_hex),
                    self.ids.step_span_id(step_pid, trace_hex, int(seq[index]), int(batch_row[index])),
                )

            # a served request's (request_seq) time per output token is its request's, from request_events
            served = (
                steps.column("request_seq").fill_null(0).to_numpy() != 0
                if "request_seq" in steps.column_names
                else np.zeros(n, dtype=bool)
            )
            for code, where in _groups(model_codes).items():
                model = models[code]
                by_model: Attrs = (("gen_ai.request.model", model),)
                own = where[~served[where]]
                if len(own):
                    point = self._hist("gen_ai.server.time_per_output_token", by_model, TIME_PER_TOKEN_BOUNDS)
                    _record_many(point, latency_s[own], own, linked, exemplar)
                has_loss = where[~np.isnan(loss[where])]
                if len(has_loss):
                    point = self._hist("llmobs.token.loss", by_model, LOSS_BOUNDS)
                    _record_many(point, loss[has_loss], has_loss, linked, exemplar)
            pairs = model_codes * len(tenants) + tenant_codes
            for pair, where in _groups(pairs).items():
                model, tenant = models[pair // len(tenants)], tenants[pair % len(tenants)]
                tokens = self._sum(
                    "llmobs.tokens", (("gen_ai.request.model", model), ("llmobs.tenant", tenant))
                )
                tokens.value += len(where)
                last = where[linked[where]]
                if len(last):
                    tokens.exemplar = exemplar(int(last[-1]), 1.0)
            # the pass's first linked row
            passes = key_ids(pid, seq)
            first = np.full(int(passes.max()) + 1, n, np.int64)
            np.minimum.at(first, passes[linked], np.flatnonzero(linked))
            has = np.flatnonzero(first < n)
            first_of_pass = np.zeros(len(first), np.int64)
            first_of_pass[passes] = np.arange(n)  # any row of the pass: its key
            first_span = dict(
                zip(
                    zip(pid[first_of_pass[has]].tolist(), seq[first_of_pass[has]].tolist(), strict=True),
                    first[has].tolist(),
                    strict=True,
                )
            )
            # A forward pass's rows may straddle two batches; its per-pass values are counted by the batch
            # holding its first row (batch_row 0), so a pass is counted once.
            zero = batch_row == 0
            owned = set(zip(pid[zero].tolist(), seq[zero].tolist(), strict=True))
        else:
            first_span, owned = {}, set()
            exemplar = None
        rollups = batch.rollups
        counted: list[tuple[tuple[int, int], int]] = []  # (pass key, its row of the rollups table)
        if rollups is not None and rollups.num_rows and owned:
            keys = zip(rollups.column("pid").to_pylist(), rollups.column("step_seq").to_pylist(), strict=True)
            counted = [(key, row) for row, key in enumerate(keys) if key in owned]
        if counted:
            rows = [row for _, row in counted]
            index_of = np.array([first_span.get(key, -1) for key, _ in counted], dtype=np.int64)
            has_span = index_of >= 0
            positions = np.arange(len(counted))

            def pass_exemplar(position: int, value: float) -> Exemplar:
                return exemplar(int(index_of[position]), value)

            for column, name in (
                ("launches", "llmobs.step.launches"),
                ("allocations", "llmobs.step.allocations"),
            ):
                values = np.nan_to_num(
                    rollups.column(column).take(rows).to_numpy(zero_copy_only=False).astype(np.float64)
                )  # NULL (no events of the kind) counts as 0, as before
                point = self._hist(name, (), COUNT_BOUNDS)
                _record_many(point, values, positions, has_span, pass_exemplar)
        for row in batch.gpu_time:
            key = (row["pid"], row["step_seq"])
            if key not in owned:
                continue
            index = first_span.get(key)
            seconds = (row["gpu_ns"] or 0) / 1e9
            point = self._sum("llmobs.gpu.time", (("llmobs.kernel.class", kernel_class(row["name"])),))
            point.value += seconds
            if index is not None:
                point.exemplar = exemplar(index, seconds)
        self._observe_gpu(batch.gpu_samples)
        self._observe_served(batch.served, exported)
        self._observe_incidents(batch.requests, exported)
        self.observed_batches += 1

    def _observe_incidents(self, requests: list[dict], exported) -> None:
        """llmobs.anomaly.incidents: the incidents of the request spans sent (each request once), by model
        and scope; the exemplar points at the request span that carries the incident's event."""
        for req in requests:
            for incident in req.get("incidents", ()):
                attrs = (("gen_ai.request.model", req["model_id"] or "unknown"),
                         ("llmobs.incident.scope", incident["scope"]))  # fmt: skip
                point = self._sum("llmobs.anomaly.incidents", attrs)
                point.value += 1
                if exported is None or exported(req["trace_id"]):
                    pid, trace = req["pid"], req["trace_id"]
                    point.exemplar = Exemplar(
                        1.0, int(incident["t_ns"]) + self.offset, self.ids.trace_id(pid, trace),
                        self.ids.request_span_id(pid, trace),
                    )  # fmt: skip

    def _observe_served(self, rows: list[dict], exported) -> None:
        """The GenAI server histograms of served requests (llmobs.otlp.genai_metrics), each bucket's
        exemplar pointing at a request span."""
        for name, attrs, bounds, value, row in genai_metrics.served_points(
            rows, DEFAULT_OPERATION, self.tenants
        ):
            pid, trace_hex = int(row["pid"]), str(row["trace_id"] or "")
            link = None
            if exported is None or exported(trace_hex):
                link = Exemplar(
                    value,
                    int(row["t_end_ns"]) + self.offset,
                    self.ids.trace_id(pid, trace_hex),
                    served_span_id(pid, trace_hex, int(row["request_seq"])),
                )
            self._hist(name, attrs, bounds).record(value, link)

    def _observe_gpu(self, samples: list[dict]) -> None:
        """The newest NVML sample of each (process, GPU) becomes that series' gauge value; samples NVML
        had no figure for (NULL: no kernel ran since its last look) leave the gauge as it was."""
        for row in samples:
            attrs: Attrs = (
                ("process.pid", int(row["pid"])),
                ("llmobs.gpu.index", int(row["gpu_index"])),
                ("llmobs.gpu.uuid", row["gpu_uuid"] or ""),
            )
            time_ns = int(row["ts_ns"]) + self.offset
            for column, name, scale in GPU_GAUGES:
                if row[column] is None:
                    continue
                series = self.gauges.setdefault(name, {})
                point = series.get(attrs)
                if point is None or time_ns >= point.time_ns:
                    series[attrs] = GaugePoint(row[column] * scale, time_ns)

    def encode(self, now_wall_ns: int) -> ExportMetricsServiceRequest | None:
        agent_points = self.agent_points
        if not self.histograms and not self.sums and not self.gauges and not agent_points:
            return None
        request = ExportMetricsServiceRequest()
        resource_metrics = request.resource_metrics.add()
        resource_metrics.resource.attributes.extend(key_values(self.resource))
        scope = resource_metrics.scope_metrics.add()
        scope.scope.name = SCOPE_NAME
        scope.scope.version = SCOPE_VERSION
        for name, series in self.histograms.items():
            metric = scope.metrics.add()
            metric.name = name
            metric.unit, metric.description = _DESCRIPTIONS[name]
            metric.histogram.aggregation_temporality = metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
            for attrs, point in series.items():
                dp = metric.histogram.data_points.add()
                dp.attributes.extend(key_values(dict(attrs)))
                dp.start_time_unix_nano = self.start_wall_ns
                dp.time_unix_nano = now_wall_ns
                dp.count = point.count
                dp.sum = point.total
                dp.min = point.low
                dp.max = point.high
                dp.explicit_bounds.extend(point.bounds)
                dp.bucket_counts.extend(point.counts)
                for ex in point.exemplars.values():
                    _add_exemplar(dp.exemplars.add(), ex)
        for name, series in self.sums.items():
            metric = scope.metrics.add()
            metric.name = name
            metric.unit, metric.description = _DESCRIPTIONS[name]
            metric.sum.aggregation_temporality = metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
            metric.sum.is_monotonic = True
            for attrs, point in series.items():
                dp = metric.sum.data_points.add()
                dp.attributes.extend(key_values(dict(attrs)))
                dp.start_time_unix_nano = self.start_wall_ns
                dp.time_unix_nano = now_wall_ns
                if name in ("llmobs.tokens", "llmobs.anomaly.incidents"):
                    dp.as_int = int(point.value)
                else:
                    dp.as_double = point.value
                if point.exemplar is not None:
                    _add_exemplar(dp.exemplars.add(), point.exemplar)
        for name, series in self.gauges.items():
            metric = scope.metrics.add()
            metric.name = name
            metric.unit, metric.description = _DESCRIPTIONS[name]
            for attrs, point in series.items():
                dp = metric.gauge.data_points.add()
                dp.attributes.extend(key_values(dict(attrs)))
                dp.time_unix_nano = point.time_ns  # when NVML was read, not when this was sent
                dp.as_double = point.value
        _encode_agent_points(scope, agent_points, self.start_wall_ns, now_wall_ns)
        if self.tenant_compute is not None:
            self.tenant_compute.encode_into(scope, now_wall_ns)
        return request


def _encode_agent_points(scope, points: list, start_wall_ns: int, now_wall_ns: int) -> None:
    """One metric per name; gauges as gauges, counters as cumulative monotonic sums."""
    by_name: dict[str, list] = {}
    for point in points:
        by_name.setdefault(point.name, []).append(point)
    for name, series in by_name.items():
        metric = scope.metrics.add()
        metric.name = name
        metric.unit, metric.description = series[0].unit, series[0].description
        if series[0].kind == "gauge":
            data_points = metric.gauge.data_points
        else:
            metric.sum.aggregation_temporality = metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
            metric.sum.is_monotonic = True
            data_points = metric.sum.data_points
        for point in series:
            dp = data_points.add()
            dp.attributes.extend(key_values(dict(point.attributes)))
            dp.start_time_unix_nano = start_wall_ns
            dp.time_unix_nano = now_wall_ns
            dp.as_double = point.value


def _groups(codes: np.ndarray) -> dict[int, np.ndarray]:
    """code -> the row indices holding it (numpy, in row order), codes in order of first appearance."""
    distinct, first = np.unique(codes, return_index=True)
    order = np.argsort(codes, kind="stable")  # rows grouped by code, each group in row order
    bounds = np.searchsorted(codes[order], distinct)
    groups = np.split(order, bounds[1:])
    return {int(distinct[i]): groups[i].astype(np.int64) for i in np.argsort(first, kind="stable").tolist()}


def _record_many(point: HistogramPoint, values: np.ndarray, where: np.ndarray, linked, exemplar) -> None:
    """HistogramPoint.record for many values at once: the same counts, sum (added in row order), min,
    max and latest exemplar per bucket."""
    if not len(values):
        return
    buckets = np.searchsorted(np.asarray(point.bounds), values, side="left")  # bisect_left: (lower, upper]
    counts = np.bincount(buckets, minlength=len(point.counts))
    for index, count in enumerate(counts.tolist()):
        point.counts[index] += count
    point.total = sum(values.tolist(), point.total)
    point.count += len(values)
    point.low = min(point.low, float(values.min()))
    point.high = max(point.high, float(values.max()))
    chosen = np.flatnonzero(linked[where])
    if not len(chosen):
        return
    linked_buckets = buckets[chosen]
    present, first = np.unique(linked_buckets, return_index=True)
    last = len(linked_buckets) - 1 - np.unique(linked_buckets[::-1], return_index=True)[1]
    # buckets in the order a row-by-row loop first gave them an exemplar (the dict's order), each with
    # its last linked value
    for bucket, row in sorted(
        zip(present.tolist(), last.tolist(), strict=True),
        key=lambda bl: first[np.searchsorted(present, bl[0])],
    ):
        index = int(chosen[row])
        point.exemplars[bucket] = exemplar(int(where[index]), float(values[index]))


def _add_exemplar(target, ex: Exemplar) -> None:
    target.time_unix_nano = ex.time_ns
    target.as_double = ex.value
    target.trace_id = ex.trace_id
    target.span_id = ex.span_id


_DESCRIPTIONS = {
    **genai_metrics.DESCRIPTIONS,
    "gen_ai.server.time_per_output_token": ("s", "Time per generated token (decode latency of its step)"),
    "llmobs.token.loss": ("1", "Per-token cross-entropy loss (nats) where the target is known"),
    "llmobs.step.launches": ("{launch}", "GPU kernel launches per forward pass"),
    "llmobs.step.allocations": ("{allocation}", "Memory allocations per forward pass"),
    "llmobs.tokens": ("{token}", "Tokens generated, by tenant and model"),
    "llmobs.anomaly.incidents": (
        "{incident}",
        "Loss-anomaly incidents (flagged tokens merged), by model and scope",
    ),
    "llmobs.gpu.time": ("s", "GPU device time by kernel class (CUPTI)"),
    "llmobs.gpu.utilization": ("1", "Share of NVML's last sample period a kernel of the process ran (0-1)"),
    "llmobs.gpu.memory.used": ("By", "GPU device memory the process holds (NVML)"),
}
