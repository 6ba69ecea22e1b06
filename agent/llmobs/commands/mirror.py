"""`llmobs-agent mirror`: the traffic mirror for OpenAI-compatible HTTP APIs (llmobs.mirror, docs/mirror.md).

Checked before serving, each as one `error:` + `hint:` line: the URLs and --listen (exit 2), the listening
port (exit 22: in use, or not ours), the primary accepting a connection (exit 23). A shadow that is down
at start is only noted: the mirror serves the primary anyway and counts each copy it cannot deliver.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import signal
import socket
import sys

from llmobs.errors import MirrorListenFailed, PrimaryUnreachable, UsageError
from llmobs.mirror import http1
from llmobs.mirror.counters import STATS_PATH
from llmobs.mirror.proxy import Mirror
from llmobs.mirror.upstream import BadUrl, Upstream, parse_listen, parse_upstream

EXAMPLES = """examples:
  llmobs-agent mirror --listen 127.0.0.1:8080 --primary http://127.0.0.1:8000 --shadow http://127.0.0.1:8001
  llmobs-agent mirror --listen 127.0.0.1:0 --primary http://10.0.0.5:8000 --shadow http://10.0.0.6:8000 \\
      --shadow-header x-llmobs-variant:qlora-r8 --queue 64
  curl -s http://127.0.0.1:8080/llmobs/mirror/stats      # the counters, while it runs
"""
_HEADER_NAME = http1.TOKEN


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    add = parser.add_argument
    add("--listen", required=True, metavar="HOST:PORT", help="where clients connect (port 0: a free one)")
    add("--primary", required=True, metavar="URL", help="the server that answers (http://HOST:PORT)")
    add("--shadow", required=True, metavar="URL", help="the server that gets a copy of each request")
    add(
        "--shadow-header",
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="a header set on the shadow's copies only (repeatable), e.g. x-llmobs-variant:qlora-r8",
    )
    add(
        "--queue",
        type=int,
        default=256,
        help="copies waiting for the shadow at most; past it a copy is dropped and counted (default 256)",
    )
    add(
        "--queue-bytes",
        type=int,
        default=64 << 20,
        help="bytes of copies waiting at most (request bodies can be large; default 64 MiB)",
    )
    add(
        "--shadow-concurrency", type=int, default=4, help="copies in flight to the shadow at once (default 4)"
    )
    add("--shadow-timeout", type=float, default=120.0, help="seconds a copy's whole answer may take (120)")
    add("--connect-timeout", type=float, default=5.0, help="seconds to connect to an upstream (default 5)")
    add(
        "--graceful-timeout",
        type=float,
        default=10.0,
        help="seconds requests in flight get after SIGTERM/SIGINT (default 10)",
    )
    add(
        "--max-body",
        type=int,
        default=http1.MAX_BODY,
        help=f"bytes of a request body at most (default {http1.MAX_BODY}; larger: 413)",
    )


def _shadow_headers(values: list[str]) -> dict[bytes, bytes]:
    headers = {}
    for value in values:
        name, sep, text = value.partition(":")
        name, text = name.strip(), text.strip()
        if not sep or not _HEADER_NAME.fullmatch(name.encode("latin-1", "replace")) or not text.isprintable():
            raise UsageError(f"--shadow-header {value!r} is not NAME:VALUE (a header name, printable value)",
                             hint="e.g. --shadow-header x-llmobs-variant:qlora-r8")  # fmt: skip
        if name.lower() in ("host", "traceparent", "content-length", "transfer-encoding"):
            raise UsageError(
                f"--shadow-header cannot set {name}: the mirror sets it (or the framing needs it)"
            )
        headers[name.lower().encode()] = text.encode("latin-1", "replace")
    return headers


def _check_positive(args: argparse.Namespace) -> None:
    for flag in ("queue", "queue_bytes", "shadow_concurrency", "max_body"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    for flag in ("shadow_timeout", "connect_timeout", "graceful_timeout"):
        if not getattr(args, flag) > 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be a positive number of seconds")


def _check_primary(primary: Upstream, timeout: float) -> None:
    try:
        socket.create_connection((primary.host, primary.port), timeout=timeout).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise PrimaryUnreachable(f"the primary {primary.url} accepts no connection: {reason}") from None


def _shadow_down(shadow: Upstream, timeout: float) -> str | None:
    try:
        socket.create_connection((shadow.host, shadow.port), timeout=timeout).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _listen(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family = infos[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        hint = "--listen takes an address of this host, e.g. 127.0.0.1:8080"
        raise MirrorListenFailed(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}", hint=hint
        ) from None
    try:
        # SO_REUSEADDR: a mirror restarted at once may bind over its predecessor's TIME_WAIT connections;
        # on Linux it never lets two listeners share a port, so "in use" is still reported here, at start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
    except OSError as exc:
        sock.close()
        what = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise MirrorListenFailed(f"cannot listen on {host}:{port}: {what}") from None
    sock.setblocking(False)
    return sock


def run(args: argparse.Namespace) -> int:
    try:
        host, port = parse_listen(args.listen)
        primary = parse_upstream(args.primary, "--primary")
        shadow = parse_upstream(args.shadow, "--shadow")
    except BadUrl as exc:
        hint = "e.g. --listen 127.0.0.1:8080 --primary http://127.0.0.1:8000 --shadow http://127.0.0.1:8001"
        raise UsageError(str(exc), hint=hint) from None
    headers = _shadow_headers(args.shadow_header)
    _check_positive(args)
    _check_primary(primary, args.connect_timeout)
    sock = _listen(host, port)
    mirror = Mirror(primary, shadow, queue_size=args.queue, queue_bytes=args.queue_bytes,
                    shadow_workers=args.shadow_concurrency,
                    shadow_timeout=args.shadow_timeout, connect_timeout=args.connect_timeout,
                    shadow_headers=headers, max_body=args.max_body,
                    graceful_s=args.graceful_timeout)  # fmt: skip
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    print(f"mirror: listening on http://{shown}:{bound[1]} -> primary {primary.url}, shadow {shadow.url} "
          f"(queue {args.queue}); counters: GET {STATS_PATH.decode()}", flush=True)  # fmt: skip
    reason = _shadow_down(shadow, args.connect_timeout)
    if reason is not None:
        print(f"mirror: note: the shadow {shadow.url} is down now ({reason}); the primary is served and each "
              "copy that fails is counted", file=sys.stderr, flush=True)  # fmt: skip
    asyncio.run(_serve(mirror, sock))
    print(f"mirror: stopped: {mirror.counters.line()}", flush=True)
    return 0


async def _serve(mirror: Mirror, sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, mirror.stop)
    await mirror.start(sock)
    await mirror.wait_stopped()
