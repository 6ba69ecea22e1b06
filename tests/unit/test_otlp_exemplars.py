"""The per-pass metrics (llmobs.step.*) and their exemplars do not depend on the order the store happens to
return step_rollups rows in: two stores with the same contents, one holding its rollups in reverse order
(as a rewrite by a later correlate can leave them), give byte-identical metrics requests, and each bucket's
exemplar is the step span of the bucket's latest pass.

Real parts: synthetic token steps and events -> DuckDB store -> correlate -> the exporter's one-shot
delivery loop, whose metrics requests (the encoded protobufs) are checked; no collector."""

from __future__ import annotations

from llmobs.otlp.config import resolve
from llmobs.otlp.delivery import OtlpExporter
from llmobs.otlp.metrics import COUNT_BOUNDS
from llmobs.otlp.transport import SendResult, Transport
from llmobs.pipeline import correlate
from llmobs.store import synthetic
from llmobs.store.sink import DuckDBStore

PID = 4242
OFFSET_NS = 1_700_000_000_000_000_000  # realtime - monotonic, fixed so exemplar times match across runs


class MetricsRecording(Transport):
    """Acknowledges every request and keeps the last metrics request."""

    def __init__(self):
        self.metrics = None

    def send_traces(self, request):
        return SendResult(ok=True)

    def send_metrics(self, request):
        self.metrics = request
        return SendResult(ok=True)


def fill(path, reverse_rollups: bool) -> DuckDBStore:
    """4 forward passes of 3 rows; pass k allocates 3k times (3 | 6, 9, 12: two buckets of COUNT_BOUNDS)."""
    store = DuckDBStore(path)
    steps = synthetic.token_steps(PID, 3, 4, batch_rows=3, seed=5)
    store.append({"token_steps": steps, "events": synthetic.events_for_steps(steps)})
    correlate.correlate(store.connection)
    conn = store.connection
    conn.execute("UPDATE step_rollups SET allocations = 3 * step_seq")
    if reverse_rollups:  # same rows, stored last pass first
        conn.execute("CREATE TEMP TABLE kept AS SELECT * FROM step_rollups ORDER BY step_seq DESC")
        conn.execute("DELETE FROM step_rollups")
        conn.execute("INSERT INTO step_rollups SELECT * FROM kept ORDER BY step_seq DESC")
        stored = [r[0] for r in conn.execute("SELECT step_seq FROM step_rollups").fetchall()]
        assert stored == [4, 3, 2, 1]  # the scan order really is reversed
    conn.execute(
        "INSERT INTO clock_fits (ts_ns, pid, clock, ref_mono_ns, offset_ns, drift_ppm, error_ns, residual_ns,"
        " samples) VALUES (1, ?, 'realtime', 0, ?, 0, 0, 0, 1)",
        [PID, OFFSET_NS],
    )
    return store


def export(store: DuckDBStore):
    """One one-shot export; its last metrics request with the clock-stamped point times cleared, and the
    exporter (for its span ids)."""
    transport = MetricsRecording()
    config = resolve({"batch_spans": 4, "settle_s": 0.0}, env={})  # several batches per run
    exporter = OtlpExporter(store.connection.cursor(), config, transport)
    exporter.run(give_up_after_s=5)
    request = transport.metrics
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                kind = metric.WhichOneof("data")
                for point in getattr(metric, kind).data_points:
                    point.start_time_unix_nano = point.time_unix_nano = 0  # the exporter's wall clock
    return request, exporter


def test_step_metrics_and_exemplars_do_not_depend_on_rollup_storage_order(tmp_path):
    with fill(tmp_path / "a.duckdb", reverse_rollups=False) as a, fill(tmp_path / "b.duckdb", True) as b:
        first, exporter = export(a)
        second, _ = export(b)
        rows = a.query("SELECT step_seq, trace_id, batch_row FROM token_steps ORDER BY step_seq, batch_row")
        row0 = {r["step_seq"]: r for r in rows.to_pylist() if r["batch_row"] == 0}
    assert first.SerializeToString(deterministic=True) == second.SerializeToString(deterministic=True)
    metrics = {m.name: m for m in first.resource_metrics[0].scope_metrics[0].metrics}
    point = metrics["llmobs.step.allocations"].histogram.data_points[0]
    assert point.count == 4 and point.sum == 3 + 6 + 9 + 12
    one, two = (next(i for i, b in enumerate(COUNT_BOUNDS) if v <= b) for v in (3, 12))
    assert list(point.bucket_counts)[one] == 1 and list(point.bucket_counts)[two] == 3

    def span_of(step_seq: int) -> bytes:  # the pass's first row's step span
        row = row0[step_seq]
        return exporter.ids.step_span_id(PID, row["trace_id"], step_seq, 0)

    # in bucket order of first appearance, each the latest pass of its bucket (pass 1; passes 2-4: 4)
    assert [(e.as_double, e.span_id) for e in point.exemplars] == [(3.0, span_of(1)), (12.0, span_of(4))]
