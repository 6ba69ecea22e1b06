"""An upstream server (the primary or the shadow) from its URL, and keep-alive connections to it.

An upstream is an origin, `http://HOST:PORT`: the client's request target is forwarded as it is, so a URL
with a path (`.../v1`) is refused rather than silently ignored or doubled. Plain HTTP only: the mirror
sits beside the servers, inside the TLS boundary (docs/mirror.md).

The pool keeps the primary's idle connections (most recently used first) for at most `idle_s` seconds,
under the keep-alive timeout servers commonly use (uvicorn: 5 s), so a kept connection is rarely one the
server has just closed; one that was closed anyway is detected at reuse (EOF already seen) or by its
first read, and the caller retries such a request once on a new connection (Connection.reused).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from llmobs.mirror.http1 import MAX_HEAD


class BadUrl(ValueError):
    pass


@dataclass(frozen=True)
class Upstream:
    url: str
    host: str
    port: int

    @property
    def host_header(self) -> bytes:
        """The Host a direct client of this upstream sends (what the mirror puts in its copies)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}".encode()


def parse_upstream(url: str, what: str) -> Upstream:
    """The Upstream of `http://HOST[:PORT][/]`; BadUrl saying what is wrong otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise BadUrl(f"{what} {url!r} is not a URL ({exc})") from None
    if parts.scheme != "http":
        scheme = parts.scheme or "none"
        raise BadUrl(f"{what} {url!r}: scheme {scheme!r}; the mirror speaks plain http:// to its upstreams")
    if not parts.hostname:
        raise BadUrl(f"{what} {url!r} has no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise BadUrl(f"{what} {url!r} has a path: give the server's origin (the client's paths go through)")
    return Upstream(url=f"http://{parts.netloc}", host=parts.hostname, port=port or 80)


def parse_listen(value: str) -> tuple[str, int]:
    """(host, port) of `HOST:PORT` or `[V6]:PORT`; BadUrl otherwise. Port 0: a free one."""
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise BadUrl(f"--listen {value!r} is not HOST:PORT")
    return host, int(port)


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reused: bool = False):
        self.reader, self.writer, self.reused = reader, writer, reused
        self.idle_since = 0.0

    def alive(self) -> bool:
        return not (self.reader.at_eof() or self.writer.is_closing())

    def close(self) -> None:
        self.writer.close()


async def connect(upstream: Upstream, timeout: float) -> Connection:
    """A new connection (OSError or TimeoutError if it cannot be made in `timeout` seconds)."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(upstream.host, upstream.port, limit=MAX_HEAD)
    return Connection(reader, writer)


class Pool:
    def __init__(self, upstream: Upstream, connect_timeout: float, max_idle: int = 64, idle_s: float = 4.0):
        self.upstream, self.connect_timeout = upstream, connect_timeout
        self.max_idle, self.idle_s = max_idle, idle_s
        self._idle: list[Connection] = []
        self.opened = 0

    async def acquire(self) -> Connection:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.alive() and now - conn.idle_since < self.idle_s:
                conn.reused = True
                return conn
            conn.close()
        self.opened += 1
        return await connect(self.upstream, self.connect_timeout)

    def release(self, conn: Connection) -> None:
        """Keep `conn` for the next request (the caller knows its response left it reusable)."""
        if len(self._idle) >= self.max_idle or not conn.alive():
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
