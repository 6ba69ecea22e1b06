"""HTTP/1.1 message framing (RFC 9112) for the mirror: just enough to find where messages end.

A request is read whole (its head parsed, its body kept as the bytes that came, chunk framing included): it
is sent twice, to the primary and to the shadow, and OpenAI-style requests are small JSON documents. A
response is never buffered: its head is read, then its body is relayed piece by piece as it arrives (a
`stream=true` completion is a chunked body of server-sent events), so the client sees each event when the
primary sends it and the bytes it gets are the primary's bytes.

Anything the framing cannot trust is refused with a status (BadRequest): both Content-Length and
Transfer-Encoding (a request-smuggling shape), differing Content-Lengths, a bad chunk size, folded header
lines. An upstream that breaks its framing raises UpstreamBroken; a client that goes away, ClientGone.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

MAX_HEAD = 64 << 10  # bytes of a request or response head (the StreamReader limit is set to this)
MAX_HEADERS = 128
MAX_BODY = 32 << 20  # default bytes of a request body the mirror holds (two copies of it, briefly)
CRLF = b"\r\n"
READ_PIECE = 64 << 10

TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_REQUEST_LINE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+) (\S+) HTTP/(1\.[01])")
_STATUS_LINE = re.compile(rb"HTTP/(1\.[01]) ([0-9]{3})(?: .*)?")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;.*)?")

NO_BODY, FIXED, CHUNKED, UNTIL_CLOSE = "none", "fixed", "chunked", "until-close"


class BadRequest(Exception):
    """A request the mirror refuses: `status` is what the client is answered."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


class UpstreamBroken(Exception):
    """The upstream closed, reset or broke its framing before its response was complete."""


class ClientGone(Exception):
    """The client closed its connection while its response was being relayed."""


class ClientClosed(Exception):
    """The client closed its connection between requests (the normal end of a keep-alive connection)."""


@dataclass
class Message:
    """A parsed head: the start line's parts and the header fields as they came (name case kept)."""

    version: bytes
    headers: list[tuple[bytes, bytes]]
    raw_head: bytes = b""

    def get(self, name: bytes) -> list[bytes]:
        """Every value of header `name` (case-insensitive), in order."""
        return [value for key, value in self.headers if key.lower() == name]

    def tokens(self, name: bytes) -> list[bytes]:
        """The comma-separated, lowercased tokens of every `name` header (Connection, Transfer-Encoding)."""
        return [t.strip().lower() for value in self.get(name) for t in value.split(b",") if t.strip()]

    def wants_close(self) -> bool:
        """Whether this message ends its connection (HTTP/1.0 unless keep-alive; Connection: close)."""
        tokens = self.tokens(b"connection")
        if self.version == b"1.0":
            return b"keep-alive" not in tokens
        return b"close" in tokens


@dataclass
class Request(Message):
    method: bytes = b""
    target: bytes = b""
    body: bytes = b""  # as received: with its chunk framing when chunked
    expect_continue: bool = False

    def encode(self, set_headers: dict[bytes, bytes], drop: frozenset[bytes] = frozenset()) -> bytes:
        """The request to send upstream: the client's head with each `set_headers` name (lowercase) given
        that one value (replaced where present, else added at the end) and `drop` names removed."""
        lines = [b"%s %s HTTP/%s\r\n" % (self.method, self.target, self.version)]
        pending = dict(set_headers)
        for key, value in self.headers:
            low = key.lower()
            if low in drop:
                continue
            if low in set_headers:
                if low in pending:
                    lines.append(b"%s: %s\r\n" % (key, pending.pop(low)))
                continue  # a repeated header being set: once is enough
            lines.append(b"%s: %s\r\n" % (key, value))
        lines.extend(b"%s: %s\r\n" % (key, value) for key, value in pending.items())
        lines.append(CRLF)
        lines.append(self.body)
        return b"".join(lines)


@dataclass
class Response(Message):
    status: int = 0
    framing: str = NO_BODY
    length: int = 0  # FIXED: the body's bytes


def _header_lines(lines: list[bytes]) -> list[tuple[bytes, bytes]]:
    if len(lines) > MAX_HEADERS:
        raise BadRequest(431, f"more than {MAX_HEADERS} header fields")
    headers = []
    for line in lines:
        name, sep, value = line.partition(b":")
        if not sep or not TOKEN.fullmatch(name):
            # a line starting with whitespace is an obsolete folded continuation: RFC 9112 5.2 lets a
            # server refuse it, and a proxy that re-joined it could disagree with the next hop
            raise BadRequest(400, f"malformed header line {line[:60]!r}")
        headers.append((name, value.strip(b" \t")))
    return headers


def _content_length(message: Message) -> int | None:
    values = {v.strip() for value in message.get(b"content-length") for v in value.split(b",")}
    if not values:
        return None
    if len(values) != 1 or not next(iter(values)).isdigit():
        raise BadRequest(400, f"bad Content-Length {sorted(values)!r}")
    return int(next(iter(values)))


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    """The head up to and including its empty line. ClientClosed on a clean EOF before any byte."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            raise ClientClosed() from None
        raise BadRequest(400, "the connection closed inside a request head") from None
    except asyncio.LimitOverrunError:
        raise BadRequest(431, f"a request head over {MAX_HEAD} bytes") from None
    return head


async def read_request(reader: asyncio.StreamReader, max_body: int = MAX_BODY,
                       on_continue: Callable[[], Awaitable[None]] | None = None) -> Request:  # fmt: skip
    """The next request on a client connection. Leading empty lines are skipped (RFC 9112 2.2)."""
    head = await _read_head(reader)
    raw = head.lstrip(b"\r\n")
    lines = raw[:-4].split(CRLF)
    match = _REQUEST_LINE.fullmatch(lines[0])
    if match is None:
        raise BadRequest(400, f"malformed request line {lines[0][:80]!r}")
    request = Request(version=match.group(3), headers=_header_lines(lines[1:]), raw_head=raw,
                      method=match.group(1), target=match.group(2))  # fmt: skip
    codings = request.tokens(b"transfer-encoding")
    length = _content_length(request)
    if codings and length is not None:
        raise BadRequest(400, "both Transfer-Encoding and Content-Length")
    if codings and codings[-1] != b"chunked":
        raise BadRequest(400, f"a Transfer-Encoding that does not end in chunked: {b', '.join(codings)!r}")
    expect = [v.strip().lower() for v in request.get(b"expect")]
    if expect and expect != [b"100-continue"]:
        raise BadRequest(417, f"unsupported Expect {expect!r}")
    if length is not None and length > max_body:
        raise BadRequest(413, f"a body of {length} bytes (the mirror holds at most {max_body})")
    if expect and on_continue is not None and (codings or length):
        request.expect_continue = True
        await on_continue()  # the client waits for this before it sends the body
    try:
        if codings:
            request.body = await _read_chunked_request(reader, max_body)
        elif length:
            request.body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise BadRequest(400, "the connection closed inside a request body") from None
    except asyncio.LimitOverrunError:
        raise BadRequest(400, "a chunk-size or trailer line over the head limit") from None
    return request


async def _read_chunked_request(reader: asyncio.StreamReader, max_body: int) -> bytes:
    parts, total = [], 0
    while True:
        line = await reader.readuntil(CRLF)
        size = _chunk_size(line)
        if size is None:
            raise BadRequest(400, f"bad chunk size line {line[:40]!r}")
        parts.append(line)
        if size == 0:
            parts.append(await _read_trailers(reader))
            return b"".join(parts)
        total += size
        if total > max_body:
            raise BadRequest(413, f"a chunked body over {max_body} bytes")
        data = await reader.readexactly(size + 2)
        if not data.endswith(CRLF):
            raise BadRequest(400, "a chunk not followed by CRLF")
        parts.append(data)


def _chunk_size(line: bytes) -> int | None:
    match = _CHUNK_SIZE.fullmatch(line[:-2])
    return int(match.group(1), 16) if match else None


async def _read_trailers(reader: asyncio.StreamReader) -> bytes:
    """The trailer section after the last chunk, up to and including its empty line."""
    parts = []
    while True:
        line = await reader.readuntil(CRLF)
        parts.append(line)
        if line == CRLF:
            return b"".join(parts)
        if len(parts) > MAX_HEADERS:
            raise BadRequest(400, "too many trailer lines")


async def read_response_head(reader: asyncio.StreamReader, method: bytes) -> Response:
    """The next response head from an upstream, and how its body is framed. UpstreamBroken when the
    connection ends before a whole head or the head is not HTTP/1.x."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as exc:
        raise UpstreamBroken(f"no response head ({type(exc).__name__})") from None
    lines = raw[:-4].split(CRLF)
    match = _STATUS_LINE.fullmatch(lines[0])
    if match is None:
        raise UpstreamBroken(f"malformed status line {lines[0][:80]!r}")
    try:
        response = Response(version=match.group(1), headers=_header_lines(lines[1:]), raw_head=raw,
                            status=int(match.group(2)))  # fmt: skip
        length = _content_length(response)
    except BadRequest as exc:
        raise UpstreamBroken(str(exc)) from None
    codings = response.tokens(b"transfer-encoding")
    if method == b"HEAD" or response.status < 200 or response.status in (204, 304):
        response.framing = NO_BODY
    elif codings and codings[-1] == b"chunked":
        response.framing = CHUNKED
    elif codings:
        response.framing = UNTIL_CLOSE  # RFC 9112 6.3: a response without chunked as its last coding
    elif length is not None:
        response.framing, response.length = FIXED, length
    else:
        response.framing = UNTIL_CLOSE
    return response


Sink = Callable[[bytes], Awaitable[None]]


async def relay_body(
    reader: asyncio.StreamReader, response: Response, sink: Sink, first: bytes = b""
) -> None:
    """Hand the response's body to `sink` piece by piece, as it arrives, with its framing (chunk sizes,
    trailers) unchanged; `first` (the head) goes out with the first piece, in one write. UpstreamBroken if
    the upstream ends it early or breaks the framing."""
    if first:
        sink = _prefixed(sink, first)
    try:
        if response.framing == FIXED:
            left = response.length
            while left:
                piece = await reader.read(min(left, READ_PIECE))
                if not piece:
                    raise UpstreamBroken(f"the body ended {left} bytes short")
                left -= len(piece)
                await sink(piece)
        elif response.framing == CHUNKED:
            await _relay_chunked(reader, sink)
        elif response.framing == UNTIL_CLOSE:
            while piece := await reader.read(READ_PIECE):
                await sink(piece)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as exc:
        raise UpstreamBroken(f"the body broke off ({type(exc).__name__})") from None
    finally:
        if first and not sink.sent:  # no body, or it broke off before its first piece: the head alone
            await sink.inner(first)


class _prefixed:
    def __init__(self, inner: Sink, first: bytes):
        self.inner, self.first, self.sent = inner, first, False

    async def __call__(self, piece: bytes) -> None:
        if not self.sent:
            self.sent = True
            piece = self.first + piece
        await self.inner(piece)


async def _relay_chunked(reader: asyncio.StreamReader, sink: Sink) -> None:
    while True:
        line = await reader.readuntil(CRLF)
        size = _chunk_size(line)
        if size is None:
            raise UpstreamBroken(f"bad chunk size line {line[:40]!r}")
        if size == 0:
            await sink(line + await _read_trailers(reader))
            return
        # one event of a stream is one chunk: its size line and data go on together, the moment they came
        data = await reader.readexactly(size + 2)
        if not data.endswith(CRLF):
            raise UpstreamBroken("a chunk not followed by CRLF")
        await sink(line + data)


def simple_response(status: int, reason: str, body: bytes, close: bool,
                    content_type: bytes = b"text/plain; charset=utf-8") -> bytes:  # fmt: skip
    """A whole response the mirror itself answers with (its 400s and 502s, the stats)."""
    head = [b"HTTP/1.1 %d %s" % (status, reason.encode()), b"content-type: " + content_type,
            b"content-length: %d" % len(body)]  # fmt: skip
    if close:
        head.append(b"connection: close")
    return CRLF.join(head) + CRLF + CRLF + body


REASONS = {
    200: "OK", 400: "Bad Request", 413: "Content Too Large", 417: "Expectation Failed",
    431: "Request Header Fields Too Large", 502: "Bad Gateway",
}  # fmt: skip
