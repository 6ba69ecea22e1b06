"""Batches whose encoding exceeds a collector's request size limit, against a real collector (rotel-agent
on 127.0.0.1, which refuses gRPC requests over 4 MiB with OUT_OF_RANGE, as the OpenTelemetry Collector's
gRPC receiver does by default with RESOURCE_EXHAUSTED).

The batch is event-dense on purpose: every token step's forward pass has more CUPTI kernels (with long
templated names, as real ones have) than max_events_per_span, so each span carries the full 64 events
and one batch of all steps encodes to over twice the 4 MiB limit.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from llmobs import clock
from llmobs.otlp.config import DEFAULT_MAX_REQUEST_BYTES
from llmobs.otlp.delivery import OtlpExporter
from llmobs.pipeline import correlate
from llmobs.store import synthetic
from llmobs.store.sink import DuckDBStore

from bench.rotel_harness import Rotel
from tests.e2e.test_otlp_rotel import expected_ids, fast_config

PID = 5151
COLLECTOR_LIMIT = 4 * 1024 * 1024  # rotel's default gRPC receive limit (4,194,304 bytes)
KERNELS_PER_PASS = 60
REQUESTS, TOKENS = 10, 13  # 130 token steps, one per forward pass


def kernel_name(index: int) -> str:
    """A templated CUDA kernel name of about 1.2 KB, as CUTLASS / flash-attention instantiations are."""
    params = ", ".join(f"cutlass::gemm::GemmShape<128, {64 + index}, 32>" for _ in range(25))
    return f"void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_{index}<{params}>>(Params)"


def fill_dense(store: DuckDBStore) -> pa.Table:
    steps = synthetic.token_steps(
        PID, REQUESTS, TOKENS, batch_rows=1, start_ns=clock.monotonic_ns() - 30_000_000_000, seed=PID
    )
    events = synthetic.events_for_steps(steps, seed=PID)
    passes = synthetic.forward_passes(steps)
    k = KERNELS_PER_PASS
    n = passes.num_rows * k
    t0 = np.repeat(passes["t_start_ns"].to_numpy(), k)
    offset = np.tile(np.arange(k, dtype=np.int64) * 10_000, passes.num_rows)
    cupti = pa.table(
        {
            "pid": np.full(n, PID, dtype=np.int32),
            "ts_ns": t0 + 1000 + offset,
            "probe": pa.array(["cupti_kernel"] * n),
            "step_seq": np.repeat(passes["step_seq"].to_numpy(), k),  # tagged: span events
            "source": pa.array(["cupti"] * n),
            "name": pa.array([kernel_name(i) for i in range(k)] * passes.num_rows),
            "external_id": np.repeat(passes["step_seq"].to_numpy(), k),
            "gpu_start_ns": t0 + 2000 + offset,
            "gpu_end_ns": t0 + 7000 + offset,
        }
    )
    store.append({"token_steps": steps, "events": events, "gpu_ops": cupti})
    store.upsert_process(PID, 1, exe="/usr/bin/python3", cmdline="python3 serve.py")
    correlate.correlate(store.connection)
    return steps


@pytest.fixture
def collector(tmp_path):
    with Rotel(tmp_path / "rotel") as rotel:
        yield rotel


def export(tmp_path, collector, **overrides):
    store = DuckDBStore(tmp_path / "s.duckdb")
    steps = fill_dense(store)
    config = fast_config(collector.grpc_endpoint, "grpc", batch_spans=REQUESTS * TOKENS, **overrides)
    exporter = OtlpExporter(store.connection.cursor(), config)
    try:
        counters = exporter.run(follow=False, give_up_after_s=60)
    finally:
        exporter.shutdown()
        store.close()
    ids, parent, _ = expected_ids(steps)
    spans = {s.span_id: s for s in collector.wait_for_spans(ids, 60, what="every span in rotel's log")}
    assert set(spans) == ids  # every span, none extra
    assert all(spans[span].parent_id == request for span, request in parent.items())
    step_spans = [spans[span] for span in parent]
    # Whole spans: each arrived with all its 64 events (the per-span cap), none cut to fit a request.
    assert [len(s.events) for s in step_spans] == [64] * len(step_spans)
    assert sum(1 for s in step_spans for e in s.events if e["name"] == "cupti_kernel") > 40 * len(step_spans)
    assert counters.spans_sent == len(ids) and counters.spans_dropped == 0
    assert counters.span_events_truncated == 0
    assert counters.max_batch_bytes > 2 * COLLECTOR_LIMIT  # one request of it would have been refused
    return counters


def test_a_batch_over_the_collectors_limit_is_sent_as_requests_under_it(tmp_path, collector):
    counters = export(tmp_path, collector)
    print(f"\nsplit: {counters.as_dict()}")
    assert counters.attempts_failed == 0 and counters.requests_too_large == 0
    # the step batch in at least ceil(batch / limit) requests, then the request spans' batch in one
    assert counters.requests_sent >= -(-counters.max_batch_bytes // DEFAULT_MAX_REQUEST_BYTES) + 1
    assert counters.max_request_bytes <= DEFAULT_MAX_REQUEST_BYTES < COLLECTOR_LIMIT


def test_the_collectors_too_large_answer_is_halved_until_it_passes(tmp_path, collector):
    """The exporter's own limit set above the collector's: rotel answers OUT_OF_RANGE, and the refused
    requests are halved until they pass; nothing is dropped, nothing retried forever."""
    counters = export(tmp_path, collector, max_request_bytes=64 * 1024 * 1024)
    print(f"\nhalved: {counters.as_dict()}")
    assert counters.requests_too_large >= 2  # the batch, and at least one of its halves (> 4 MiB each)
    assert counters.attempts_failed == counters.requests_too_large and counters.retries == 0
    assert "OUT_OF_RANGE" in counters.last_error and "too large" in counters.last_error
    assert counters.max_request_bytes <= COLLECTOR_LIMIT
