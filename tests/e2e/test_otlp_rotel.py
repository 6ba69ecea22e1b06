"""OTLP export against a real collector: rotel-agent on free 127.0.0.1 ports, its debug log parsed.

The store is filled through its own API (DuckDBStore.append + correlate) with synthetic batches in the
records.md columns; the expected span ids are computed from the same rows, so a missing, extra or
re-parented span fails the test.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tracemalloc

import psutil
import pyarrow as pa
import pytest
from llmobs import clock
from llmobs.otlp import config as otlp_config
from llmobs.otlp.delivery import OtlpExporter
from llmobs.otlp.encoder import SpanIds
from llmobs.otlp.metrics import kernel_class
from llmobs.pipeline import correlate
from llmobs.store import synthetic
from llmobs.store.sink import DuckDBStore

from bench.rotel_harness import Rotel, parse_metrics, parse_spans, wait_until

PID = 4242
KERNELS = (
    "ampere_sgemm_128x64_tn",
    "void flash_fwd_kernel<Flash_fwd_kernel_traits<128>>",
    "vectorized_elementwise",
)


def fill(
    store: DuckDBStore, pid: int, requests: int, tokens: int, start_ns: int, seq_start: int = 1
) -> pa.Table:
    """Token steps, tagged eBPF events, CUPTI kernel records and a process row, then correlate()."""
    steps = synthetic.token_steps(
        pid, requests, tokens, batch_rows=2, start_ns=start_ns, step_seq_start=seq_start, seed=pid
    )
    events = synthetic.events_for_steps(steps, seed=pid)
    cupti = synthetic.cupti_kernels(steps, KERNELS, (300_000, 200_000, 50_000))
    store.append({"token_steps": steps, "events": events, "gpu_ops": cupti})
    store.upsert_process(pid, 1, exe="/usr/bin/python3", cmdline=f"python3 serve.py --worker {pid}")
    correlate.correlate(store.connection)
    return steps


def expected_ids(steps: pa.Table) -> tuple[set[str], dict[str, str], dict[str, dict]]:
    """(all span ids, step span id -> parent id, step span id -> its row) as hex, from the rows."""
    ids = SpanIds("prompt")
    all_ids, parent, rows = set(), {}, {}
    for row in steps.to_pylist():
        span = ids.step_span_id(row["pid"], row["trace_id"], row["step_seq"], row["batch_row"]).hex()
        request = ids.request_span_id(row["pid"], row["trace_id"]).hex()
        all_ids.update((span, request))
        parent[span] = request
        rows[span] = row
    return all_ids, parent, rows


def fast_config(endpoint: str, protocol: str, **overrides) -> otlp_config.OtlpConfig:
    values = {
        "endpoint": endpoint,
        "protocol": protocol,
        "timeout_s": 2.0,
        "backoff_initial_s": 0.05,
        "backoff_max_s": 0.4,
        "poll_interval_s": 0.05,
        "metrics_interval_s": 0.3,
        "settle_s": 0.0,
        "request_idle_s": 0.2,
        **overrides,
    }
    return otlp_config.resolve(values, env={})


@pytest.fixture
def collector(tmp_path):
    with Rotel(tmp_path / "rotel") as rotel:
        yield rotel


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_structure_and_attributes_arrive(tmp_path, collector, protocol):
    store = DuckDBStore(tmp_path / "s.duckdb")
    steps = fill(store, PID, requests=6, tokens=12, start_ns=clock.monotonic_ns() - 30_000_000_000)
    ids, parent, rows = expected_ids(steps)
    endpoint = collector.grpc_endpoint if protocol == "grpc" else collector.http_endpoint
    exporter = OtlpExporter(store.connection.cursor(), fast_config(endpoint, protocol, batch_spans=20))
    counters = exporter.run(follow=False, give_up_after_s=20)
    exporter.shutdown()
    assert counters.spans_sent == len(ids) == 6 * 12 + 6
    assert counters.spans_dropped == 0 and counters.attempts_failed == 0

    wait_until(lambda: collector.span_count() >= len(ids), 20, what="all spans in rotel's log")
    spans = {s.span_id: s for s in collector.spans()}
    assert set(spans) == ids
    rollups = {(r["pid"], r["step_seq"]): r for r in store.query("SELECT * FROM step_rollups").to_pylist()}
    for span_id, request_id in parent.items():
        span, row = spans[span_id], rows[span_id]
        assert span.parent_id == request_id and spans[request_id].parent_id == ""
        assert span.trace_id == row["trace_id"] == spans[request_id].trace_id  # prompt-hash trace ids
        assert span.name == "gen_ai.token_step"
        attrs = span.attributes
        assert attrs["gen_ai.request.model"] == row["model_id"]
        assert attrs["gen_ai.conversation.id"] == row["session"]
        assert attrs["llmobs.tenant"] == row["tenant"]
        assert attrs["llmobs.token.position"] == row["position"]
        assert math.isclose(attrs["llmobs.token.loss"], row["loss"], rel_tol=1e-6)
        assert attrs["llmobs.step.allocations"] == rollups[(PID, row["step_seq"])]["allocations"] == 6
        assert span.resource["process.pid"] == PID
        assert span.resource["process.command_line"] == f"python3 serve.py --worker {PID}"
    # Each forward pass's sampled events sit on exactly one of its step spans, with their ratio.
    with_events = [s for s in spans.values() if s.events]
    assert len(with_events) == steps.group_by(["pid", "step_seq"]).aggregate([]).num_rows
    names = {e["name"] for s in with_events for e in s.events}
    assert {"alloc_cpu", "free_cpu", "sgemm_", "sched_switch", "page_fault_user"} <= names
    assert all(e["attributes"]["llmobs.sample_ratio"] == 1 for s in with_events for e in s.events)
    requests = [s for s in spans.values() if not s.parent_id]
    assert {s.name for s in requests} == {"text_completion smollm2-135m"}
    assert all(s.attributes["gen_ai.usage.output_tokens"] == 12 for s in requests)

    wait_until(lambda: "llmobs.gpu.time" in parse_metrics(collector.text()), 20, what="metrics")
    metrics = parse_metrics(collector.text())
    assert {
        "gen_ai.server.time_per_output_token",
        "llmobs.token.loss",
        "llmobs.step.launches",
        "llmobs.step.allocations",
        "llmobs.tokens",
        "llmobs.gpu.time",
    } <= set(metrics)
    classes = {p["llmobs.kernel.class"] for p in metrics["llmobs.gpu.time"]["points"]}
    assert classes == {kernel_class(k) for k in KERNELS} == {"gemm", "attention", "elementwise"}
    for metric in metrics.values():  # kernel names: on spans only, never a metric label
        assert all(not any(k in str(v) for k in KERNELS) for p in metric["points"] for v in p.values())
    tenants = {p["llmobs.tenant"] for p in metrics["llmobs.tokens"]["points"]}
    assert tenants == {"acme", "globex"}
    exemplar_spans = {s for m in metrics.values() for _, s in m["exemplars"]}
    assert exemplar_spans and exemplar_spans <= ids
    store.close()


def test_collector_killed_and_restarted_nothing_lost(tmp_path, collector):
    """Kill the collector mid-export, keep ingesting while it is down, restart it: every span of the
    window arrives, the exporter holds one batch whatever the backlog, and the counters tell the story."""
    store = DuckDBStore(tmp_path / "s.duckdb")
    now = clock.monotonic_ns()
    first = fill(store, PID, requests=40, tokens=40, start_ns=now - 60_000_000_000)
    batch = 50
    config = fast_config(collector.grpc_endpoint, "grpc", batch_spans=batch)
    exporter = OtlpExporter(store.connection.cursor(), config)
    exporter.start()
    try:
        wait_until(lambda: collector.span_count() >= 300, 30, what="export under way")
        collector.stop()  # SIGTERM mid-export: rotel drains what it accepted, then the port is closed
        wait_until(lambda: exporter.counters.attempts_failed >= 3, 30, what="failed attempts while down")
        sent_while_down = exporter.counters.spans_sent  # (a batch may still be acked while rotel drains)
        # The pipeline keeps writing while the collector is down: a backlog far larger than a batch.
        tracemalloc.start()
        before, _ = tracemalloc.get_traced_memory()
        second = fill(store, 4343, requests=40, tokens=40, start_ns=now - 30_000_000_000, seq_start=10_000)
        failed = exporter.counters.attempts_failed
        wait_until(lambda: exporter.counters.attempts_failed >= failed + 5, 30, what="retries on the backlog")
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert exporter.counters.spans_sent == sent_while_down  # nothing acked while down
        collector.start()  # same ports, new log
        ids_first, parent_first, _ = expected_ids(first)
        ids_second, parent_second, _ = expected_ids(second)
        ids = ids_first | ids_second
        collector.wait_for_spans(ids, 60, what="every span after restart")
    finally:
        counters = exporter.shutdown(timeout=10)
    logged = collector.spans()
    unique = {s.span_id: s for s in logged}
    assert set(unique) == ids
    assert all(unique[span].parent_id == parent for span, parent in {**parent_first, **parent_second}.items())
    duplicates = len(logged) - len(unique)
    print(f"\nkill/restart: {len(ids)} spans expected, {len(logged)} logged ({duplicates} duplicates),"
          f" traced heap growth {(peak - before) / 1e6:.2f} MB, counters {counters.as_dict()}")  # fmt: skip
    assert duplicates <= batch + batch  # at most the batch (and its closed requests) in flight at the kill
    assert counters.spans_sent == len(ids) and counters.spans_dropped == 0
    assert counters.attempts_failed >= 8 and counters.retries >= 8
    assert counters.spans_failed >= counters.attempts_failed  # every failed attempt carried spans
    # Bounded memory: one batch in flight whatever the backlog (3,200 steps were waiting), and the
    # exporter's Python heap did not grow with the backlog while the collector was down.
    assert counters.max_batch_spans <= 2 * batch
    assert counters.max_batch_bytes < 4 * 1024 * 1024
    assert peak - before < 8 * 1024 * 1024, f"traced Python memory grew by {(peak - before) / 1e6:.1f} MB"
    store.close()


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "llmobs.cli", "otlp", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={"PATH": "/usr/bin"})


def test_cli_one_shot_resumes_from_the_cursor(tmp_path, collector):
    db = tmp_path / "s.duckdb"
    with DuckDBStore(db) as store:
        steps = fill(store, PID, requests=4, tokens=10, start_ns=clock.monotonic_ns() - 30_000_000_000)
    ids, _, _ = expected_ids(steps)
    endpoint = collector.http_endpoint
    first = run_cli("--db", str(db), "--endpoint", endpoint, "--protocol", "http/protobuf", "--json")
    assert first.returncode == 0, first.stderr
    status = json.loads(first.stdout)
    assert status["spans_sent"] == len(ids) and status["pending_steps"] == 0
    again = run_cli("--db", str(db), "--endpoint", endpoint, "--protocol", "http/protobuf", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["spans_sent"] == 0  # the cursor held
    wait_until(lambda: collector.span_count() >= len(ids), 20, what="spans")
    assert {s.span_id for s in parse_spans(collector.text())} == ids


def test_cli_unreachable_collector_is_one_line_and_keeps_rows(tmp_path):
    db = tmp_path / "s.duckdb"
    with DuckDBStore(db) as store:
        fill(store, PID, requests=2, tokens=5, start_ns=clock.monotonic_ns() - 30_000_000_000)
    from bench.rotel_harness import free_port

    result = run_cli("--db", str(db), "--endpoint", f"http://127.0.0.1:{free_port()}", "--give-up-after", "1")
    assert result.returncode == 12
    assert result.stderr.splitlines()[-2].startswith("error: 10 token steps not exported")
    assert "Traceback" not in result.stderr
    with DuckDBStore(db) as store:  # nothing was marked exported
        assert store.query("SELECT count(*) AS n FROM otlp_cursor")["n"][0].as_py() == 0


def test_collector_listens_on_loopback_only(collector):
    listening = [
        c.laddr for c in psutil.Process(collector.process.pid).net_connections("tcp") if c.status == "LISTEN"
    ]
    assert {port for _, port in listening} == {collector.grpc_port, collector.http_port}
    assert {ip for ip, _ in listening} == {"127.0.0.1"}


def test_cli_follow_exports_and_stops_cleanly_on_sigterm(tmp_path, collector):
    db = tmp_path / "s.duckdb"
    with DuckDBStore(db) as store:
        steps = fill(store, PID, requests=3, tokens=6, start_ns=clock.monotonic_ns() - 30_000_000_000)
    ids, _, _ = expected_ids(steps)
    conf = tmp_path / "llmobs.toml"
    conf.write_text(
        f'[otlp]\nendpoint = "{collector.grpc_endpoint}"\nsettle_s = 0.0\nrequest_idle_s = 0.2\n'
        "poll_interval_s = 0.05\nmetrics_interval_s = 0.2\n"
    )
    command = [sys.executable, "-m", "llmobs.cli", "otlp", "--db", str(db), "--config", str(conf), "--follow"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        collector.wait_for_spans(ids, 30, what="spans from --follow")
        wait_until(
            lambda: "llmobs.tokens" in parse_metrics(collector.text()), 30, what="metrics from --follow"
        )
        process.send_signal(15)
        out, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert out.startswith(f"exported {len(ids)} spans to {collector.grpc_endpoint} (grpc)")


def test_start_exporter_follows_a_store_being_written(tmp_path, collector):
    """The in-process wiring `attach --otlp` uses: ingest keeps appending while the exporter follows."""
    from llmobs.otlp import start_exporter

    store = DuckDBStore(tmp_path / "s.duckdb")
    exporter = start_exporter(store, fast_config(collector.http_endpoint, "http/protobuf", batch_spans=64))
    try:
        expected: set[str] = set()
        now = clock.monotonic_ns()
        for index in range(3):  # three ingest rounds, each seen at the collector before the next
            steps = fill(
                store, 5000 + index, requests=2, tokens=8, start_ns=now - (30 - index) * 1_000_000_000
            )
            expected |= expected_ids(steps)[0]
            want = frozenset(expected)
            wait_until(lambda w=want: {s.span_id for s in collector.spans()} >= w, 30, what=f"round {index}")
    finally:
        counters = exporter.shutdown(timeout=10)
    assert counters.spans_sent == len(expected) == 3 * (16 + 2) and counters.attempts_failed == 0
    assert {s.resource["process.pid"] for s in collector.spans()} == {5000, 5001, 5002}
    store.close()
