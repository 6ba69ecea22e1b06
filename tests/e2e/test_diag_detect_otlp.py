"""Loss anomalies over OTLP to a real collector (rotel on loopback): each anomaly row of a step is a span
event `llmobs.anomaly` on that token step's span, with its kind, score, detector, detail and evidence.

The anomalies come from the real detectors run over the store's token steps (two losses raised), their
evidence from the real evidence pass after correlate (the spiking step also did 50x the page faults).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
from llmobs import clock
from llmobs.diagnostics.detectors import DetectorConfig, StreamingDetector
from llmobs.diagnostics.evidence import refresh_evidence
from llmobs.diagnostics.incidents import IncidentBuilder
from llmobs.otlp.delivery import OtlpExporter
from llmobs.otlp.encoder import SpanIds
from llmobs.pipeline import correlate
from llmobs.store import synthetic
from llmobs.store.sink import DuckDBStore
from test_otlp_rotel import fast_config

from bench.rotel_harness import POINT_VALUE, Rotel, parse_metrics, wait_until

PID, REQUESTS, TOKENS = 5151, 3, 40
SPIKES = {(0, 25), (2, 30)}  # (request, token index)


def _fill(store: DuckDBStore) -> tuple[pa.Table, set[tuple[str, int]]]:
    steps = synthetic.token_steps(
        PID, REQUESTS, TOKENS, start_ns=clock.monotonic_ns() - 30_000_000_000, seed=3
    )
    rng = np.random.default_rng(3)
    # clean tokens wobble below the detectors' spread floor (0.05 nats): no false alarms to account for
    loss = rng.normal(2.0, 0.005, steps.num_rows).astype(np.float32)
    traces = steps["trace_id"].to_pylist()
    order = list(dict.fromkeys(traces))  # requests in the order they appear
    step_index = steps["step"].to_numpy()
    spiked = set()
    for i in range(steps.num_rows):
        if (order.index(traces[i]), int(step_index[i])) in SPIKES:
            loss[i] = 7.0
            spiked.add((traces[i], int(steps["step_seq"][i].as_py())))
    steps = steps.set_column(steps.schema.get_field_index("loss"), "loss", pa.array(loss))
    events = synthetic.events_for_steps(steps, seed=3)
    faults = [(seq, 50) for _, seq in spiked]
    store.append({"token_steps": steps, "events": events})
    for seq, n in faults:
        t0 = int(steps["t_start_ns"][0].as_py())
        store.append({"host_events": {
            "pid": [PID] * n, "ts_ns": [t0] * n, "probe": ["page_fault_user"] * n, "step_seq": [seq] * n,
            "kind": ["host"] * n,
        }})  # fmt: skip
    correlate.correlate(store.connection)
    rows = StreamingDetector(DetectorConfig(detector="both")).add(steps.to_pydict(), clock.monotonic_ns())
    incidents = IncidentBuilder()  # as the agent's anomaly lane builds them: one per spike
    rows["incident_id"] = incidents.add(rows, clock.monotonic_ns())
    incidents.close_all(clock.monotonic_ns())
    new, _updated = incidents.take_changed()
    store.append({"anomalies": rows, "incidents": pa.Table.from_pylist(new)})
    refresh_evidence(store.connection, PID, 0)
    return steps, spiked


def test_anomalies_arrive_as_span_events_on_their_token_step(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb")
    steps, spiked = _fill(store)
    flagged = store.query("SELECT trace_id, step_seq, kind, score FROM anomalies").to_pylist()
    assert {(r["trace_id"], r["step_seq"]) for r in flagged} == spiked  # the detectors found exactly them
    ids = SpanIds("prompt")
    with Rotel(tmp_path / "rotel") as collector:
        exporter = OtlpExporter(store.connection.cursor(), fast_config(collector.grpc_endpoint, "grpc"))
        counters = exporter.run(follow=False, give_up_after_s=20)
        exporter.shutdown()
        assert counters.spans_dropped == 0
        total = steps.num_rows + REQUESTS
        wait_until(lambda: collector.span_count() >= total, 20, what="all spans in rotel's log")
        spans = {s.span_id: s for s in collector.spans()}
        wait_until(lambda: "llmobs.anomaly.incidents" in parse_metrics(collector.text()), 20,
                   what="the incidents counter")  # fmt: skip
        counted = parse_metrics(collector.text())["llmobs.anomaly.incidents"]
    with_anomalies = {}
    for span in spans.values():
        events = [e for e in span.events if e.get("name") == "llmobs.anomaly"]
        if events:
            with_anomalies[span.span_id] = events
    want = {ids.step_span_id(PID, trace, seq, 0).hex(): (trace, seq) for trace, seq in spiked}
    assert set(with_anomalies) == set(want)
    scores = {(r["trace_id"], r["step_seq"], r["kind"]): r["score"] for r in flagged}
    for span_id, events in with_anomalies.items():
        trace, seq = want[span_id]
        assert spans[span_id].attributes["llmobs.step_seq"] == seq
        by_kind = {e["attributes"]["llmobs.anomaly.kind"]: e["attributes"] for e in events}
        assert set(by_kind) == {"loss_ttest", "loss_mad"}
        for kind, attrs in by_kind.items():
            assert attrs["llmobs.anomaly.score"] == scores[(trace, seq, kind)]
            assert attrs["llmobs.anomaly.detector"] == kind.removeprefix("loss_")
            assert json.loads(attrs["llmobs.anomaly.detail"])["loss"] == 7.0
            assert "page faults" in attrs["llmobs.anomaly.evidence"]
    # each spike is one incident: one llmobs.anomaly.incident event on its request's span, counted once
    step_of = {(r["trace_id"], r["step_seq"]): r["step"] for r in steps.to_pylist()}
    incident_events = {
        span.span_id: [e["attributes"] for e in span.events if e.get("name") == "llmobs.anomaly.incident"]
        for span in spans.values()
    }
    want = {ids.request_span_id(PID, trace).hex(): (trace, seq) for trace, seq in spiked}
    assert {k for k, v in incident_events.items() if v} == set(want)
    for span_id, (trace, seq) in want.items():
        [attrs] = incident_events[span_id]
        step = step_of[(trace, seq)]
        assert attrs["llmobs.incident.id"] == f"{PID}-{seq}-0" and attrs["llmobs.incident.state"] == "closed"
        assert (attrs["llmobs.incident.first_step"], attrs["llmobs.incident.last_step"]) == (step, step)
        assert (attrs["llmobs.incident.tokens"], attrs["llmobs.incident.rows"]) == (1, 2)
        assert attrs["llmobs.incident.detectors"] == "mad,ttest"
        assert "page faults" in attrs["llmobs.incident.evidence"]
    assert sum(p[POINT_VALUE] for p in counted["points"]) == len(spiked)
    assert {p["llmobs.incident.scope"] for p in counted["points"]} == {"request"}
    store.close()
