"""The mirror's server: reads each client request, forwards it to the primary, relays the primary's
response back unchanged as it arrives, and offers a copy to the shadow.

What an upstream receives is the client's request with two headers set: `Host` (the upstream's own, as a
direct client would send) and `traceparent` (traceparent.choose); the shadow's copy has the
--shadow-header fields as well, and `Expect: 100-continue` is answered by the mirror itself (the body is
read before anything is forwarded) and so left out. The response - status line, headers, body, chunk
framing - is the primary's, byte for byte.

Failures: a primary that cannot be reached, or that closes before its response head, gets the client a
502 (primary_errors) - once retried on a new connection when a kept connection turned out closed; one
that breaks off inside a body closes the client's connection (the response cannot be completed, nor
replaced). A request the mirror cannot frame is answered 400/413/417/431 and the connection closed.

GET /llmobs/mirror/stats is answered by the mirror (the counters as JSON), never forwarded.

Stopping: `stop()` closes the listener and the idle keep-alive connections at once; requests in flight get
`graceful_s` seconds to finish, then their connections are closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

from llmobs.mirror import http1, traceparent
from llmobs.mirror.counters import STATS_PATH, Counters
from llmobs.mirror.shadow import Shadow
from llmobs.mirror.upstream import Pool, Upstream

_DROP = frozenset({b"expect"})


class _ClientConn:
    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.busy = False
        self.task: asyncio.Task | None = None


class Mirror:
    def __init__(self, primary: Upstream, shadow: Upstream | None, *, queue_size: int = 256,
                 queue_bytes: int = 64 << 20, shadow_workers: int = 4, shadow_timeout: float = 120.0,
                 connect_timeout: float = 5.0,
                 shadow_headers: dict[bytes, bytes] | None = None, max_body: int = http1.MAX_BODY,
                 graceful_s: float = 10.0):  # fmt: skip
        self.counters = Counters()
        self.primary = primary
        self.pool = Pool(primary, connect_timeout)
        self.shadow = None
        if shadow is not None:
            self.shadow = Shadow(shadow, self.counters, queue_size, queue_bytes, shadow_workers,
                                 shadow_timeout, connect_timeout)  # fmt: skip
        self.shadow_host = shadow.host_header if shadow is not None else b""
        self.shadow_headers = {k.lower(): v for k, v in (shadow_headers or {}).items()}
        self.max_body, self.graceful_s = max_body, graceful_s
        self._clients: set[_ClientConn] = set()
        self._server: asyncio.Server | None = None
        self._stopping = False
        self._stopped = asyncio.Event()

    def stats(self) -> dict[str, int]:
        queued = self.shadow.queue.qsize() if self.shadow else 0
        in_flight = self.shadow.in_flight if self.shadow else 0
        return self.counters.as_dict(shadow_queued=queued, shadow_in_flight=in_flight,
                                     primary_connections_opened=self.pool.opened)  # fmt: skip

    async def start(self, sock) -> None:
        """Serve on the listening socket `sock` (already bound: the command reports bind errors)."""
        if self.shadow is not None:
            self.shadow.start()
        self._server = await asyncio.start_server(self._serve_client, sock=sock, limit=http1.MAX_HEAD)

    def stop(self) -> None:
        """Begin a clean stop (from a signal handler): no new connections, idle ones closed now."""
        if self._stopping:
            return
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for client in list(self._clients):
            if not client.busy and client.task is not None:
                client.task.cancel()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        """Wait for stop(), then for the requests in flight (at most graceful_s) and the shadow."""
        await self._stopped.wait()
        if self._server is not None:  # a stop that came while it was starting found no listener to close
            self._server.close()
        busy = [c.task for c in self._clients if c.task is not None]
        if busy:
            _done, pending = await asyncio.wait(busy, timeout=self.graceful_s)
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.shadow is not None:
            await self.shadow.stop()
        self.pool.close()

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _no_delay(writer)
        client = _ClientConn(writer)
        client.task = asyncio.current_task()
        self._clients.add(client)
        try:
            while not self._stopping:
                keep = await self._one_request(client, reader, writer)
                if not keep:
                    break
        except asyncio.CancelledError:
            pass  # stop(): an idle connection, or one past the grace period
        finally:
            self._clients.discard(client)
            writer.close()

    async def _one_request(self, client: _ClientConn, reader, writer) -> bool:
        """Serve one request of the connection; whether the connection stays open for the next."""

        async def send_continue() -> None:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()

        try:
            request = await http1.read_request(reader, self.max_body, on_continue=send_continue)
        except http1.ClientClosed:
            return False
        except http1.BadRequest as exc:
            self.counters.bad_requests += 1
            reason = http1.REASONS.get(exc.status, "Bad Request")
            writer.write(http1.simple_response(exc.status, reason, f"mirror: {exc}\n".encode(), close=True))
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            return False
        except ConnectionError:
            return False
        client.busy = True
        try:
            if request.target.split(b"?")[0] == STATS_PATH and request.method == b"GET":
                return await self._answer_stats(request, writer)
            return await self._forward(request, writer)
        finally:
            client.busy = False

    async def _answer_stats(self, request: http1.Request, writer) -> bool:
        body = json.dumps(self.stats()).encode() + b"\n"
        close = request.wants_close()
        writer.write(http1.simple_response(200, "OK", body, close, content_type=b"application/json"))
        await writer.drain()
        return not close

    def _traceparent(self, request: http1.Request) -> bytes:
        value, what = traceparent.choose(request.get(traceparent.HEADER))
        if what == traceparent.KEPT:
            self.counters.traceparent_kept += 1
        elif what == traceparent.ADDED:
            self.counters.traceparent_added += 1
        else:
            self.counters.traceparent_replaced += 1
        return value

    async def _forward(self, request: http1.Request, writer: asyncio.StreamWriter) -> bool:
        self.counters.requests += 1
        tp = self._traceparent(request)
        drop = _DROP if request.expect_continue else frozenset()
        data = request.encode({b"host": self.primary.host_header, traceparent.HEADER: tp}, drop)

        async def to_client(piece: bytes) -> None:
            try:
                writer.write(piece)
                await writer.drain()
            except ConnectionError:
                raise http1.ClientGone() from None

        # The shadow's copy is offered once the primary's response head is in (or the primary failed):
        # its sending then never competes with the primary's time to first byte for this loop or the CPU.
        offer = self._offer_copy(request, tp)
        try:
            conn, response = await self._send_to_primary(data, request.method)
        except (OSError, http1.UpstreamBroken) as exc:  # nothing of a response went out yet: a 502 can
            offer()
            self.counters.primary_errors += 1
            body = f"mirror: the primary {self.primary.url} failed: {exc}\n".encode()
            with contextlib.suppress(http1.ClientGone):
                await to_client(http1.simple_response(502, "Bad Gateway", body, close=True))
            return False
        offer()
        try:
            while 100 <= response.status < 200 and response.status != 101:
                await to_client(response.raw_head)  # an interim response (103 Early Hints): relayed as is
                response = await http1.read_response_head(conn.reader, request.method)
            await http1.relay_body(conn.reader, response, to_client, first=response.raw_head)
        except http1.UpstreamBroken:
            conn.close()
            self.counters.primary_errors += 1
            return False  # part of the response went out: the client must see the connection end
        except http1.ClientGone:
            conn.close()
            self.counters.client_gone += 1
            return False
        self.counters.forwarded += 1
        reusable = not response.wants_close() and response.framing != http1.UNTIL_CLOSE
        if reusable and response.status != 101:
            self.pool.release(conn)
        else:
            conn.close()
        return reusable and not request.wants_close() and response.status != 101

    def _offer_copy(self, request: http1.Request, tp: bytes):
        """What offers the shadow its copy (a no-op without a shadow)."""
        if self.shadow is None:
            return _nothing

        def offer() -> None:
            headers = {b"host": self.shadow_host, traceparent.HEADER: tp, **self.shadow_headers}
            drop = _DROP if request.expect_continue else frozenset()
            self.shadow.offer(request.encode(headers, drop), request.method)

        return offer

    async def _send_to_primary(self, data: bytes, method: bytes):
        """(connection, response head) from the primary; a kept connection that turns out closed before
        any answer is retried once on a new one."""
        for attempt in (0, 1):
            conn = await self.pool.acquire()
            try:
                conn.writer.write(data)
                return conn, await http1.read_response_head(conn.reader, method)
            except (OSError, http1.UpstreamBroken):
                conn.close()
                if not conn.reused or attempt == 1:
                    raise
        raise AssertionError("unreachable")


def _nothing() -> None:
    return None


def _no_delay(writer: asyncio.StreamWriter) -> None:
    """TCP_NODELAY on a client connection. asyncio sets it only on sockets whose proto is IPPROTO_TCP, and
    a listener made as socket(AF_INET, SOCK_STREAM) has proto 0, as have the connections it accepts:
    without it a response head and body written apart wait out the client's delayed ACK (40 ms)."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
