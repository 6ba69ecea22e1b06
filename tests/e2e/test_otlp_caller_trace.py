"""A caller's W3C traceparent, end to end into a real collector (rotel-agent on 127.0.0.1).

Real parts: the serving publisher writes a real map (its token steps from real torch logits), the real
reader decodes it, a real DuckDB store holds it, the exporter sends it over OTLP/gRPC to rotel, whose
debug log is parsed. A request with a traceparent must arrive as a request span in the caller's trace,
parented by the caller's span; its token-step spans parented by that request span; a request without one
keeps its prompt-hash trace and has no parent. The GenAI server histograms arrive too.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from llmobs.otlp import config as otlp_config
from llmobs.otlp.delivery import OtlpExporter
from llmobs.publisher import request as publisher
from llmobs.publisher.serving import Row, ServingPublisher
from llmobs.shm.hashing import trace_id
from llmobs.shm.reader import ShmReader
from llmobs.shm.writer import ShmWriter
from llmobs.store.sink import DuckDBStore

from bench.rotel_harness import Rotel, parse_metrics, wait_until

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TOKENS = 4


@pytest.fixture
def collector(tmp_path):
    with Rotel(tmp_path / "rotel") as rotel:
        yield rotel


def serve(tmp_path) -> dict[str, list[int]]:
    """Two requests batched together for TOKENS passes: "caller" under a traceparent, "plain" without."""
    prompts = {"caller": [11, 12, 13, 14, 15], "plain": [21, 22, 23]}
    writer = ShmWriter(shm_dir=str(tmp_path), names_capacity=64, steps_capacity=64, requests_capacity=16)
    try:
        pub = ServingPublisher("tiny-llama", writer=writer)
        with publisher.context(tenant="acme", traceparent=f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"):
            pub.request_arrived("caller", prompts["caller"])
        with publisher.context(tenant="globex"):
            pub.request_arrived("plain", prompts["plain"])
        for step in range(TOKENS):
            rows = [Row(r, len(p) if step == 0 else 1, 0 if step == 0 else len(p) + step - 1, True)
                    for r, p in prompts.items()]  # fmt: skip
            p = pub.pass_begin(rows)
            pub.pass_logits(torch.randn(len(rows), 32))
            pub.pass_end(p, [3] * len(rows))
        for r in prompts:
            pub.request_finished(r, "length")
        with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as reader:
            steps, events = reader.read_steps().columns, reader.read_request_events().columns
    finally:
        writer.close()
    store = DuckDBStore(tmp_path / "s.duckdb")
    try:
        store.append({"token_steps": steps, "request_events": events})
    finally:
        store.close()
    return prompts


def test_the_callers_trace_and_parent_arrive_in_the_collector(tmp_path, collector):
    prompts = serve(tmp_path)
    store = DuckDBStore(tmp_path / "s.duckdb")
    config = otlp_config.resolve(
        {"endpoint": collector.grpc_endpoint, "protocol": "grpc", "timeout_s": 2.0, "settle_s": 0.0,
         "metrics_interval_s": 0.3},
        env={},
    )  # fmt: skip
    exporter = OtlpExporter(store.connection.cursor(), config)
    try:
        counters = exporter.run(follow=False, give_up_after_s=20)
    finally:
        exporter.shutdown()
        store.close()
    expected = 2 * TOKENS + 2  # token-step spans + one request span per request
    assert counters.spans_sent == expected and counters.spans_dropped == 0
    wait_until(lambda: collector.span_count() >= expected, 20, what="all spans in rotel's log")
    spans = collector.spans()
    assert len(spans) == expected
    requests = {s.attributes["llmobs.request.id"]: s for s in spans if "llmobs.request.id" in s.attributes}
    caller, plain = requests["caller"], requests["plain"]

    assert caller.trace_id == CALLER_TRACE and caller.parent_id == CALLER_SPAN  # a child of the caller
    assert caller.attributes["llmobs.prompt_hash"] == trace_id(np.asarray(prompts["caller"], np.int64)).hex()
    assert caller.attributes["llmobs.trace_from_caller"] is True
    assert caller.attributes["gen_ai.usage.output_tokens"] == TOKENS
    assert caller.attributes["gen_ai.usage.input_tokens"] == len(prompts["caller"])
    own = trace_id(np.asarray(prompts["plain"], np.int64)).hex()
    assert plain.trace_id == own and plain.parent_id == "" and plain.attributes["llmobs.prompt_hash"] == own

    steps = [s for s in spans if s.name == "gen_ai.token_step"]
    assert len(steps) == 2 * TOKENS
    for request in (caller, plain):
        mine = [s for s in steps if s.parent_id == request.span_id]
        assert len(mine) == TOKENS and all(s.trace_id == request.trace_id for s in mine)
        assert sorted(s.attributes["llmobs.token.step"] for s in mine) == list(range(TOKENS))

    wait_until(lambda: "gen_ai.server.time_to_first_token" in parse_metrics(collector.text()), 20,
               what="GenAI metrics")  # fmt: skip
    metrics = parse_metrics(collector.text())
    for name in ("gen_ai.server.request.duration", "gen_ai.server.time_to_first_token"):
        assert metrics[name]["unit"] == "s"
        tenants = {p.get("llmobs.tenant") for p in metrics[name]["points"]}
        assert tenants == {"acme", "globex"}
        assert all(p.get("gen_ai.provider.name") == "transformers" for p in metrics[name]["points"])
    assert (CALLER_TRACE, caller.span_id) in metrics["gen_ai.server.time_to_first_token"]["exemplars"]
