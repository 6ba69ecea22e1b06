"""What `llmobs-agent mirror` adds to the primary's latency: direct vs through the mirror, side by side.

    .venv/bin/python -m bench.mirror [--rounds 6] [--requests 400] [--server responder|tiny] [--json PATH]

The backend (the primary) is a real HTTP server that answers fast, so the mirror's own cost is not lost in
generation time: by default bench.http_responder (asyncio, a fixed 300-byte chat-completion JSON per
request, keep-alive); `--server tiny` is the serving workload (llmobs.workloads.serve, tiny model) with
max_tokens=1. The shadow is a second http_responder. The mirror runs as its own process
(`python -m llmobs.cli mirror`), as deployed.

Arms, interleaved per round (bench/harness.py: A B C | C B A ...), each --requests sequential POSTs of a
small chat-completion body over one keep-alive connection (http.client; a new connection per arm-round):
  direct               to the primary itself
  mirror               through the mirror, the shadow up (every copy mirrored)
  mirror, shadow down  through a second mirror whose shadow refuses every connection (copies counted lost)
Figures per round: the latency p50 and p99 in microseconds (perf_counter_ns around request + whole
response). The note says the added p50 and p99 (median over rounds of the paired per-round differences).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import socket
import statistics
import time

from bench.harness import Arm, Report, add_json_option
from bench.held_mirror import HeldMirror, HeldResponder
from bench.held_server import HeldServer

DIRECT, MIRROR, DOWN = "direct", "mirror", "mirror, shadow down"


def _latencies(port: int, requests: int, body: bytes) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"content-type": "application/json"}
    out = []
    try:
        for _ in range(requests):
            t0 = time.perf_counter_ns()
            conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
            response = conn.getresponse()
            response.read()
            out.append((time.perf_counter_ns() - t0) / 1e3)
            assert response.status == 200, response.status
    finally:
        conn.close()
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _arm(name: str, port: int, requests: int, body: bytes) -> Arm:
    def one_round(ctx):
        with ctx.timed():
            values = _latencies(port, requests, body)
        return {"p50_us": _quantile(values, 0.50), "p99_us": _quantile(values, 0.99)}

    return Arm(name, one_round)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--requests", type=int, default=400, help="requests per arm per round")
    p.add_argument("--server", choices=("responder", "tiny"), default="responder", help="the primary")
    add_json_option(p)
    args = p.parse_args()
    report = Report("mirror", args)
    with contextlib.ExitStack() as stack:
        if args.server == "tiny":
            server = stack.enter_context(HeldServer("--model", "tiny", "--threads", "1"))
            primary_url, model = server.base_url.removesuffix("/v1"), server.model
            primary_port = server.ready["port"]
        else:
            responder = stack.enter_context(HeldResponder())
            primary_url, model, primary_port = responder.url, "responder", responder.ready["port"]
        shadow = stack.enter_context(HeldResponder())
        mirror = stack.enter_context(HeldMirror(primary_url, shadow.url))
        down = stack.enter_context(HeldMirror(primary_url, f"http://127.0.0.1:{_free_port()}"))
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                           "temperature": 0}).encode()  # fmt: skip
        ports = ((DIRECT, primary_port), (MIRROR, mirror.port), (DOWN, down.port))
        arms = [_arm(name, port, args.requests, body) for name, port in ports]
        made = report.compare(f"primary latency, {args.server} backend", arms, args.rounds, baseline=DIRECT,
                              better={"p50_us": "lower", "p99_us": "lower"}, metrics=["p50_us", "p99_us"],
                              warmup=1)  # fmt: skip
        for arm in (MIRROR, DOWN):
            for metric in ("p50_us", "p99_us"):
                added = statistics.median(
                    a - b for a, b in zip(made.values(arm, metric), made.values(DIRECT, metric), strict=True)
                )
                report.note(
                    f"{arm}: added {metric.removesuffix('_us')} {added:.0f} us (median of per-round diffs)"
                )
        for name, held in ((MIRROR, mirror), (DOWN, down)):
            stats = held.stats()
            shown = ("forwarded", "copies", "mirrored", "dropped_full", "dropped_down", "shadow_errors")
            report.note(f"{name} counters: " + " ".join(f"{key}={stats[key]}" for key in shown))
    report.finish()


if __name__ == "__main__":
    main()
