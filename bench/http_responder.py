"""`python -m bench.http_responder`: a fast HTTP/1.1 server that answers every request at once with one fixed
chat-completion-like JSON body (keep-alive), and records each request's `traceparent` and
`x-llmobs-variant` headers. It is the fast real backend of bench/mirror.py (so the mirror's own cost is
not lost in a model's generation time) and the recording, killable shadow of tests/e2e/test_mirror.py.

    python -m bench.http_responder --ready-fd 3 [--record FILE] [--port 0]

--ready-fd: one JSON line {"pid", "port", "url", "phase": "ready"} once it listens. --record: one line per
request, `<traceparent>\\t<x-llmobs-variant>\\t<path>` ("-" when absent), written before the answer, so a
reader that sees the answer also sees the line. SIGTERM/SIGINT: stops.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket

from llmobs.mirror import http1
from llmobs.workloads.sync import announce

BODY = (
    b'{"id":"chatcmpl-0","object":"chat.completion","created":0,"model":"responder","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,'
    b'"completion_tokens":1,"total_tokens":2}}'
)
RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(BODY),
    BODY,
)


def _field(request: http1.Request, name: bytes) -> str:
    values = request.get(name)
    return values[0].decode("latin-1") if values else "-"


async def _serve(record, reader, writer) -> None:
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the listener's proto is 0: asyncio skips it
    try:
        while True:
            try:
                request = await http1.read_request(reader)
            except (http1.ClientClosed, http1.BadRequest, ConnectionError):
                return
            if record is not None:
                tp, variant = _field(request, b"traceparent"), _field(request, b"x-llmobs-variant")
                record.write(f"{tp}\t{variant}\t{request.target.decode('latin-1')}\n")
                record.flush()
            writer.write(RESPONSE)
            await writer.drain()
            if request.wants_close():
                return
    finally:
        writer.close()


async def main_async(args) -> None:
    record = open(args.record, "a", buffering=1) if args.record else None  # noqa: SIM115 (closed below)
    server = await asyncio.start_server(lambda r, w: _serve(record, r, w), "127.0.0.1", args.port)
    port = server.sockets[0].getsockname()[1]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    announce({"pid": os.getpid(), "port": port, "url": f"http://127.0.0.1:{port}", "phase": "ready"},
             None, args.ready_fd)  # fmt: skip
    await stop.wait()
    server.close()
    if record is not None:
        record.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-fd", type=int)
    p.add_argument("--record", help="append one line per request: traceparent, x-llmobs-variant, path")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
