"""The serving workload's HTTP layer (llmobs.workloads.serve.RequestContext): the traceparent, tenant and
session headers of a request reach the handler's context, through a real FastAPI app with a
BaseHTTPMiddleware like transformers' own (it runs the route in another task), and a malformed header
never fails the request."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

fastapi = pytest.importorskip("fastapi")

from llmobs.publisher import request as publisher  # noqa: E402
from llmobs.workloads import serve  # noqa: E402

GOOD = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
LATER = "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra"


@pytest.mark.parametrize(
    "value, expected",
    [
        (GOOD, GOOD),
        (f"  {GOOD} ", GOOD),  # optional whitespace around a header value
        # a later version may append fields
        (LATER, LATER),
        (GOOD + "-extra", None),  # version 00 has exactly four fields
        ("ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", None),
        ("00-00000000000000000000000000000000-b7ad6b7169203331-01", None),
        ("00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01", None),
        ("00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01", None),  # upper case is invalid
        ("00-0af7651916cd43dd8448eb211c80319-b7ad6b7169203331-01", None),
        ("garbage", None),
        ("", None),
        (None, None),
    ],
)
def test_valid_traceparent(value, expected):
    assert serve.valid_traceparent(value) == expected


def _app(enter=None):
    app = fastapi.FastAPI()

    @app.middleware("http")  # a BaseHTTPMiddleware, as transformers' request_id_middleware: another task
    async def passthrough(request, call_next):
        return await call_next(request)

    @app.get("/seen")
    async def seen():
        return {"traceparent": serve.current_traceparent(), "tenant": publisher._tenant.get(),
                "session": publisher._session.get()}  # fmt: skip

    app.add_middleware(serve.RequestContext, enter=enter or serve.llmobs_enter())
    return app


def _get(app, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict]:
    """One GET /seen through the ASGI interface, as uvicorn calls the app."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": "/seen", "raw_path": b"/seen", "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}  # fmt: skip
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)


def test_headers_reach_the_handler():
    status, seen = _get(
        _app(),
        [(b"traceparent", GOOD.encode()), (b"x-llmobs-tenant", b"acme"), (b"x-llmobs-session", b"s-1")],
    )
    assert status == 200
    assert seen == {"traceparent": GOOD, "tenant": "acme", "session": "s-1"}
    # and nothing leaks out of the request
    assert serve.current_traceparent() is None and publisher._tenant.get() is None


@pytest.mark.filterwarnings("ignore:llmobs serve")  # warned once per process, counted every time
def test_malformed_headers_are_ignored_and_counted():
    before = dict(serve.stats)
    status, seen = _get(
        _app(),
        [
            (b"traceparent", b"00-nothex-01"),
            (b"x-llmobs-tenant", b"has space"),
            (b"x-llmobs-session", b"\xff" * 3),
        ],
    )
    assert status == 200
    assert seen == {"traceparent": None, "tenant": None, "session": None}
    assert serve.stats["malformed_traceparent"] == before["malformed_traceparent"] + 1
    assert serve.stats["malformed_label"] == before["malformed_label"] + 2


def test_a_failing_context_still_serves():
    def broken(tenant, session, traceparent):
        raise RuntimeError("the publisher is broken")

    status, seen = _get(_app(broken), [(b"x-llmobs-tenant", b"acme"), (b"traceparent", GOOD.encode())])
    assert status == 200
    assert seen == {"traceparent": GOOD, "tenant": None, "session": None}


def _recording_app(**server):
    """The app with an `enter` that records what each request was labelled with (not the publisher's:
    the variant and labels reach llmobs.context through it; their validation is the publisher's)."""
    seen: list[dict] = []

    def enter(tenant, session, traceparent, variant=None, labels=None):
        seen.append({"tenant": tenant, "variant": variant, "labels": labels})
        return contextlib.nullcontext()

    app = _app(enter)
    app.user_middleware[0].kwargs.update(
        server
    )  # the RequestContext's own variant/labels (--variant, --label)
    return app, seen


@pytest.mark.filterwarnings("ignore:llmobs serve")
def test_variant_and_labels_from_the_server_and_the_headers():
    app, seen = _recording_app(variant="base", labels={"template": "v1", "region": "eu"})
    before = dict(serve.stats)
    _get(app, [])
    _get(app, [(b"x-llmobs-variant", b"qlora-r8"), (b"x-llmobs-labels", b" template=v3 , lang=de")])
    _get(app, [(b"x-llmobs-labels", b"template"), (b"x-llmobs-tenant", b"acme")])  # malformed: ignored
    assert seen == [
        {"tenant": None, "variant": "base", "labels": {"template": "v1", "region": "eu"}},
        {"tenant": None, "variant": "qlora-r8", "labels": {"template": "v3", "region": "eu", "lang": "de"}},
        {"tenant": "acme", "variant": "base", "labels": {"template": "v1", "region": "eu"}},
    ]
    assert serve.stats["malformed_label"] == before["malformed_label"] + 1


@pytest.mark.parametrize("text", ["a", "a=", "=b", "a=1,a=2", "a=1,,b=2", "k=" + "v" * 1100])
def test_malformed_labels_header(text):
    assert serve.parse_labels(text) is None
