"""The traffic mirror's proxy (llmobs.mirror) against tiny asyncio servers in the test: byte-for-byte relay
of fixed-length and chunked (streamed) responses, keep-alive on both sides, the request a server receives
(Host and traceparent set, the shadow's extra header on the shadow's copy only), refused requests (400),
a failing primary (502), a dead or stuck shadow (every copy counted), and the command's bad-input exits.
The real servers and the `openai` client: tests/e2e/test_mirror.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
from llmobs import cli
from llmobs.mirror import http1
from llmobs.mirror.proxy import Mirror
from llmobs.mirror.upstream import parse_upstream

TP = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
# header names, spacing and order a client must get exactly as the server sent them
FIXED = b"HTTP/1.1 200 OK\r\nX-Odd-Case: a  b\r\ncontent-length: 11\r\nserver: t\r\n\r\nhello world"


class Backend:
    """A scripted HTTP/1.1 server: `answer(request, writer, index)` writes each response; every request
    (head and raw body) and every connection is recorded."""

    def __init__(self, answer=None):
        self.answer = answer or self.fixed
        self.requests: list[http1.Request] = []
        self.connections = 0
        self.server = None

    @staticmethod
    async def fixed(request, writer, index):
        writer.write(FIXED)

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                try:
                    request = await http1.read_request(reader)
                except (http1.ClientClosed, ConnectionError):
                    return
                self.requests.append(request)
                await self.answer(request, writer, len(self.requests) - 1)
                await writer.drain()
        finally:
            writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def mirrored(primary_url: str, shadow_url: str | None, **options):
    options.setdefault("shadow_headers", {b"x-llmobs-variant": b"b"})
    mirror = Mirror(
        parse_upstream(primary_url, "p"), shadow_url and parse_upstream(shadow_url, "s"), **options
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    await mirror.start(sock)
    mirror.port = sock.getsockname()[1]
    try:
        yield mirror
    finally:
        mirror.stop()
        await mirror.wait_stopped()


async def _connect(mirror):
    return await asyncio.open_connection("127.0.0.1", mirror.port)


async def _until(predicate, timeout=5.0):
    """Wait for `predicate()` (the shadow's side runs behind the primary's), polling the event loop."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


def _post(body: bytes, *headers: bytes) -> bytes:
    head = [b"POST /v1/chat/completions HTTP/1.1", b"Host: client-side", b"content-type: application/json",
            b"Content-Length: %d" % len(body), *headers]  # fmt: skip
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def run(coro):
    async def bounded():
        async with asyncio.timeout(20):
            return await coro

    return asyncio.run(bounded())


def test_fixed_length_responses_are_relayed_unchanged_on_kept_connections():
    async def go():
        async with Backend() as primary, Backend() as shadow, mirrored(primary.url, shadow.url) as mirror:
            reader, writer = await _connect(mirror)
            for body in (b'{"a":1}', b'{"b":2}'):
                writer.write(_post(body))
                assert await reader.readexactly(len(FIXED)) == FIXED
            writer.close()
            await _until(lambda: len(shadow.requests) == 2)
            assert primary.connections == 1  # both requests on one kept connection to the primary
            assert [r.body for r in primary.requests] == [b'{"a":1}', b'{"b":2}']
            assert [r.body for r in shadow.requests] == [b'{"a":1}', b'{"b":2}']
            for p, s in zip(primary.requests, shadow.requests, strict=True):
                assert p.get(b"host") == [primary.url[7:].encode()] and s.get(b"host") == [
                    shadow.url[7:].encode()
                ]
                (tp,) = p.get(b"traceparent")
                assert s.get(b"traceparent") == [tp]  # the pair shares one trace
                assert p.get(b"x-llmobs-variant") == [] and s.get(b"x-llmobs-variant") == [b"b"]
                assert p.get(b"content-type") == [b"application/json"]
            assert primary.requests[0].get(b"traceparent") != primary.requests[1].get(b"traceparent")
            c = mirror.counters
            assert (c.requests, c.forwarded, c.copies, c.mirrored, c.traceparent_added) == (2, 2, 2, 2, 2)

    run(go())


def test_a_streamed_chunked_response_arrives_chunk_by_chunk_unchanged():
    first = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    first += b'f\r\ndata: {"a":1}\n\n\r\n'  # one server-sent event per chunk, as a server streams them
    rest = b"e;ext=1\r\ndata: [DONE]\n\n\r\n0\r\nx-trailer: t\r\n\r\n"
    released = asyncio.Event()

    async def answer(request, writer, index):
        writer.write(first)
        await writer.drain()
        await released.wait()  # the rest only once the client has the first event: it is not buffered
        writer.write(rest)

    async def go():
        async with (
            Backend(answer) as primary,
            Backend() as shadow,
            mirrored(primary.url, shadow.url) as mirror,
        ):
            reader, writer = await _connect(mirror)
            writer.write(_post(b'{"stream":true}', b"traceparent: " + TP))
            assert await reader.readexactly(len(first)) == first
            released.set()
            assert await reader.readexactly(len(rest)) == rest
            writer.write(_post(b"{}"))  # the connection stays open after a chunked response
            assert await reader.readexactly(len(first)) == first
            assert await reader.readexactly(len(rest)) == rest
            writer.close()
            assert primary.requests[0].get(b"traceparent") == [TP]  # the client's own is kept
            assert mirror.counters.traceparent_kept == 1 and mirror.counters.forwarded == 2

    run(go())


def test_a_chunked_request_body_goes_to_both_with_its_framing():
    chunked = b'7\r\n{"a":1}\r\n2\r\n  \r\n0\r\n\r\n'
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def go():
        async with Backend() as primary, Backend() as shadow, mirrored(primary.url, shadow.url) as mirror:
            reader, writer = await _connect(mirror)
            writer.write(head + chunked)
            assert await reader.readexactly(len(FIXED)) == FIXED
            await _until(lambda: shadow.requests)
            assert primary.requests[0].body == chunked and shadow.requests[0].body == chunked
            writer.close()

    run(go())


@pytest.mark.parametrize(
    "raw, status",
    [
        (b"GARBAGE\r\n\r\n", 400),
        (
            b"POST / HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n",
            400,
        ),
        (b"POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
        (b"GET / HTTP/1.1\r\nX-A: 1\r\n folded\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 99999\r\n\r\n", 413),
        (b"GET / HTTP/1.1\r\nExpect: magic\r\n\r\n", 417),
        (b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n", 431),
    ],
    ids=["request-line", "cl-and-te", "two-lengths", "chunk-size", "folded", "too-large", "expect", "head"],
)
def test_a_request_it_cannot_frame_is_refused_and_forwarded_nowhere(raw, status):
    async def go():
        async with (
            Backend() as primary,
            Backend() as shadow,
            mirrored(primary.url, shadow.url, max_body=1000) as m,
        ):
            reader, writer = await _connect(m)
            writer.write(raw)
            answer = await reader.read()  # then the mirror closes the connection
            writer.close()
            assert answer.startswith(b"HTTP/1.1 %d " % status) and b"connection: close" in answer
            assert primary.connections == 0 and shadow.connections == 0
            assert m.counters.bad_requests == 1 and m.counters.requests == 0

    run(go())


def test_expect_100_continue_is_answered_by_the_mirror():
    async def go():
        async with Backend() as primary, Backend() as shadow, mirrored(primary.url, shadow.url) as mirror:
            reader, writer = await _connect(mirror)
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
            assert await reader.readexactly(25) == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"{}")
            assert await reader.readexactly(len(FIXED)) == FIXED
            writer.close()
            assert primary.requests[0].get(b"expect") == [] and primary.requests[0].body == b"{}"

    run(go())


def test_a_failing_primary_gets_the_client_a_502_and_is_counted():
    async def answer(request, writer, index):
        if index == 0:
            writer.transport.abort()  # closed before any response
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
            await writer.drain()
            writer.transport.abort()  # broke off inside its body

    async def go():
        async with Backend(answer) as primary, mirrored(primary.url, None) as mirror:
            reader, writer = await _connect(mirror)
            writer.write(_post(b"{}"))
            assert (await reader.read()).startswith(b"HTTP/1.1 502 Bad Gateway\r\n")
            writer.close()
            reader, writer = await _connect(mirror)
            writer.write(_post(b"{}"))
            got = await reader.read()  # what came, then the connection ends: never a made-up response
            writer.close()
            assert got == b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this"
            assert mirror.counters.primary_errors == 2 and mirror.counters.forwarded == 0

    run(go())


def test_a_dead_shadow_costs_the_primary_nothing_and_every_copy_is_counted():
    async def go():
        dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens: each copy is refused
        async with Backend() as primary, mirrored(primary.url, dead) as mirror:
            reader, writer = await _connect(mirror)
            for _ in range(20):
                writer.write(_post(b"{}"))
                assert await reader.readexactly(len(FIXED)) == FIXED
            writer.close()
            c = mirror.counters
            await _until(lambda: c.shadow_errors + c.dropped_down == 20)
            assert (c.forwarded, c.copies, c.mirrored, c.dropped_full) == (20, 20, 0, 0)
            # a copy found it down; while it stays down (1 s) the others are dropped without a try
            assert c.shadow_errors >= 1 and c.dropped_down >= 1

    run(go())


def test_a_stuck_shadow_fills_the_queue_and_the_drops_are_counted():
    async def never(request, writer, index):
        await asyncio.Event().wait()

    async def go():
        async with Backend() as primary, Backend(never) as stuck:
            options = {"queue_size": 2, "shadow_workers": 1, "shadow_timeout": 0.2}
            async with mirrored(primary.url, stuck.url, **options) as mirror:
                reader, writer = await _connect(mirror)
                for _ in range(10):
                    writer.write(_post(b"{}"))
                    assert await reader.readexactly(len(FIXED)) == FIXED
                writer.close()
                c = mirror.counters
                # one copy is with the stuck shadow, two wait in the queue, the other seven were dropped
                assert (c.forwarded, c.copies, c.dropped_full) == (10, 10, 7)
                await _until(lambda: c.shadow_timeouts >= 1)
            lost = c.dropped_full + c.dropped_down + c.shadow_errors + c.shadow_timeouts + c.shadow_abandoned
            assert c.copies == c.mirrored + lost

    run(go())


def test_a_malformed_traceparent_is_replaced_for_both_and_the_stats_path_is_answered():
    async def go():
        async with Backend() as primary, Backend() as shadow, mirrored(primary.url, shadow.url) as mirror:
            reader, writer = await _connect(mirror)
            writer.write(_post(b"{}", b"traceparent: 00-zz-01"))
            assert await reader.readexactly(len(FIXED)) == FIXED
            await _until(lambda: shadow.requests)
            (tp,) = primary.requests[0].get(b"traceparent")
            assert tp != b"00-zz-01" and shadow.requests[0].get(b"traceparent") == [tp]
            writer.write(b"GET /llmobs/mirror/stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = await reader.read()
            writer.close()
            assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
            assert b'"traceparent_replaced": 1' in answer and b'"forwarded": 1' in answer
            assert len(primary.requests) == 1  # the stats path is not forwarded

    run(go())


def test_a_stop_closes_idle_connections_at_once_and_lets_a_stream_in_flight_finish():
    first = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
    rest = b"0\r\n\r\n"
    released = asyncio.Event()

    async def answer(request, writer, index):
        writer.write(first)
        await writer.drain()
        await released.wait()
        writer.write(rest)

    async def go():
        async with Backend(answer) as primary, Backend() as shadow:
            mirror = Mirror(parse_upstream(primary.url, "p"), parse_upstream(shadow.url, "s"), graceful_s=10)
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(4)
            sock.setblocking(False)
            await mirror.start(sock)
            mirror.port = sock.getsockname()[1]
            idle_r, idle_w = await _connect(mirror)
            busy_r, busy_w = await _connect(mirror)
            busy_w.write(_post(b"{}"))
            assert await busy_r.readexactly(len(first)) == first
            await _until(lambda: len(mirror._clients) == 2)
            mirror.stop()
            stopped = asyncio.create_task(mirror.wait_stopped())
            assert await idle_r.read() == b""  # the idle keep-alive connection: closed at once
            assert not stopped.done()  # the stream in flight holds the stop within its grace period
            released.set()
            assert await busy_r.readexactly(len(rest)) == rest
            assert await busy_r.read() == b""  # then its connection ends too
            await stopped
            assert mirror.counters.forwarded == 1
            idle_w.close()
            busy_w.close()

    run(go())


def _cli(capsys, *argv) -> tuple[int, list[str]]:
    code = cli.main(["mirror", *argv])
    return code, capsys.readouterr().err.splitlines()


def test_bad_input_is_one_error_and_one_hint_with_its_exit_code(capsys):
    with socket.socket() as taken, socket.socket() as primary:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        primary.bind(("127.0.0.1", 0))
        primary.listen(1)
        p_url = f"http://127.0.0.1:{primary.getsockname()[1]}"
        dead = f"http://127.0.0.1:{_free_port()}"
        cases = [
            (("--listen", "127.0.0.1:0", "--primary", p_url + "/v1", "--shadow", p_url), 2, "has a path"),
            (("--listen", "nope", "--primary", p_url, "--shadow", p_url), 2, "is not HOST:PORT"),
            (("--listen", "127.0.0.1:0", "--primary", "https://h:1", "--shadow", p_url), 2, "plain http"),
            (("--listen", f"127.0.0.1:{taken.getsockname()[1]}", "--primary", p_url, "--shadow", p_url), 22,
             "the port is in use"),
            (("--listen", "127.0.0.1:0", "--primary", dead, "--shadow", p_url), 23,
             "accepts no connection"),
        ]  # fmt: skip
        for argv, code, says in cases:
            got, lines = _cli(capsys, *argv)
            assert got == code, (argv, lines)
            assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: ")
            assert says in lines[0]
