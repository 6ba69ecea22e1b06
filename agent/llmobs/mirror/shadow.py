"""The shadow side: a bounded queue of request copies and the workers that send them to the shadow.

`offer()` never waits: a full queue (`queue_size` copies, or `queue_bytes` bytes of them: request bodies
may be large) drops the copy and counts it (dropped_full), so a slow or dead shadow costs the primary's
clients nothing but the offer itself. Each worker keeps one keep-alive connection to the shadow, sends a
copy, reads the whole answer and discards it (mirrored), within `timeout` seconds (else shadow_timeouts);
a refused or failed connection, a reset or a broken answer is shadow_errors and the next copy tries a new
connection. A shadow that could not be connected to is left alone for DOWN_RETRY_S: the copies offered
meanwhile are dropped at once (dropped_down) instead of each paying a connection attempt in the loop the
primary's traffic shares (bench/mirror.py: a dead shadow otherwise added ~2x the mirror's own p50).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from llmobs.mirror import http1
from llmobs.mirror.counters import Counters
from llmobs.mirror.upstream import Connection, Upstream, connect

DOWN_RETRY_S = 1.0


async def _discard(_piece: bytes) -> None:
    return None


class Shadow:
    def __init__(self, upstream: Upstream, counters: Counters, queue_size: int, queue_bytes: int,
                 workers: int, timeout: float, connect_timeout: float):  # fmt: skip
        self.upstream, self.counters = upstream, counters
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.queue: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue(maxsize=queue_size)
        self.n_workers = workers
        self.queue_bytes, self.queued_bytes = queue_bytes, 0
        self.in_flight = 0
        self.down_until = 0.0  # monotonic time before which the shadow is not tried again
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.n_workers)]

    def offer(self, data: bytes, method: bytes) -> None:
        """Queue a copy (the request as the shadow gets it), or drop and count it if the queue is full."""
        self.counters.copies += 1
        if self.down_until and time.monotonic() < self.down_until:
            self.counters.dropped_down += 1
            return
        if self.queued_bytes + len(data) > self.queue_bytes:
            self.counters.dropped_full += 1
            return
        try:
            self.queue.put_nowait((data, method))
        except asyncio.QueueFull:
            self.counters.dropped_full += 1
            return
        self.queued_bytes += len(data)

    async def _worker(self) -> None:
        conn: Connection | None = None
        try:
            while True:
                data, method = await self.queue.get()
                self.queued_bytes -= len(data)
                self.in_flight += 1
                try:
                    conn = await self._send(conn, data, method)
                    self.counters.mirrored += 1
                except TimeoutError:
                    self.counters.shadow_timeouts += 1
                    conn = _closed(conn)
                except (OSError, http1.UpstreamBroken):
                    self.counters.shadow_errors += 1
                    conn = _closed(conn)
                finally:
                    self.in_flight -= 1
        finally:
            _closed(conn)

    async def _send(self, conn: Connection | None, data: bytes, method: bytes) -> Connection | None:
        """One copy sent and its answer read whole; the connection to keep, or None."""
        async with asyncio.timeout(self.timeout):
            if conn is None or not conn.alive():
                _closed(conn)
                try:
                    conn = await connect(self.upstream, self.connect_timeout)
                except (OSError, TimeoutError):
                    self.down_until = time.monotonic() + DOWN_RETRY_S
                    raise
                self.down_until = 0.0
            conn.writer.write(data)
            response = await http1.read_response_head(conn.reader, method)
            while 100 <= response.status < 200:  # an interim answer (100 Continue, 103): the real one follows
                response = await http1.read_response_head(conn.reader, method)
            await http1.relay_body(conn.reader, response, _discard)
        if response.wants_close() or response.framing == http1.UNTIL_CLOSE:
            return _closed(conn)
        return conn

    async def stop(self) -> None:
        """Stop the workers; what is still queued or in flight is counted as shadow_abandoned."""
        abandoned = self.queue.qsize() + self.in_flight
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.counters.shadow_abandoned += abandoned


def _closed(conn: Connection | None) -> None:
    if conn is not None:
        conn.close()
    return None
