"""`python -m llmobs.workloads.clients --base-url URL`: concurrent OpenAI clients of two (or more) tenants.

The real `openai` Python client drives an OpenAI-compatible server (llmobs.workloads.serve) from N threads
at once; thread i is a client of tenant i mod T. Every request carries its own W3C `traceparent` (a fresh
random trace id and span id, sampled) and the `x-llmobs-tenant` / `x-llmobs-session` headers, asks for a
chat completion with `max_tokens` and temperature 0, and is recorded as one JSON line (--record PATH):

  tenant, session, thread, index, traceparent, trace_id, span_id, request_id (the completion's id: the
  server's x-request-id), started (unix seconds), ttft_s (client-measured time to the first content chunk;
  streaming only, else null), total_s, text, completion_tokens, prompt_tokens, finish_reason, error

The last line on stdout is a JSON summary (per tenant: requests, errors, tokens, TTFT/total p50/p99; and
tokens/s over the whole run). Exit status 0; 1 if any request failed; 2 bad arguments or no server answering
at --base-url.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import threading
import time

PROMPTS = [
    "Explain what a GPU kernel launch is in one sentence.",
    "Write a haiku about shared memory.",
    "List three prime numbers.",
    "What is continuous batching in LLM serving?",
    "Summarise the plot of Hamlet in two sentences.",
    "Why is the sky blue?",
]


def new_traceparent() -> str:
    """A W3C traceparent of a new trace: version 00, random trace id and span id, sampled."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def served_model(base_url: str, api_key: str = "llmobs") -> str:
    """The id of the first model the server lists (a pinned server lists exactly its own)."""
    import openai

    models = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).models.list()
    return next(iter(models)).id


def one_request(client, model: str, prompt: str, tenant: str, session: str, max_tokens: int, stream: bool,
                traceparent: str | None = None) -> dict:  # fmt: skip
    """One chat completion; what it returned and how long it took, measured here. Never raises."""
    traceparent = traceparent or new_traceparent()
    headers = {"traceparent": traceparent, "x-llmobs-tenant": tenant, "x-llmobs-session": session}
    parts = traceparent.split("-")
    rec = {
        "tenant": tenant, "session": session, "traceparent": traceparent,
        "trace_id": parts[1] if len(parts) > 2 else None, "span_id": parts[2] if len(parts) > 2 else None,
        "request_id": None, "started": time.time(), "ttft_s": None, "total_s": None, "text": "",
        "completion_tokens": None, "prompt_tokens": None, "finish_reason": None, "error": None,
    }  # fmt: skip
    t0 = time.perf_counter()
    try:
        messages = [{"role": "user", "content": prompt}]
        kwargs = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                  "extra_headers": headers}  # fmt: skip
        if stream:
            text = []
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                rec["request_id"] = rec["request_id"] or chunk.id
                for choice in chunk.choices:
                    if choice.delta and choice.delta.content:
                        if rec["ttft_s"] is None:
                            rec["ttft_s"] = time.perf_counter() - t0
                        text.append(choice.delta.content)
                    rec["finish_reason"] = choice.finish_reason or rec["finish_reason"]
                if chunk.usage is not None:  # the server sends usage with its last chunk
                    rec["completion_tokens"] = chunk.usage.completion_tokens
                    rec["prompt_tokens"] = chunk.usage.prompt_tokens
            rec["text"] = "".join(text)
        else:
            out = client.chat.completions.create(**kwargs)
            rec["request_id"] = out.id
            rec["text"] = out.choices[0].message.content or "" if out.choices else ""
            rec["finish_reason"] = out.choices[0].finish_reason if out.choices else None
            if out.usage is not None:
                rec["completion_tokens"] = out.usage.completion_tokens
                rec["prompt_tokens"] = out.usage.prompt_tokens
    except Exception as exc:  # a failed request is a record, not a crash of the whole run
        rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
    rec["total_s"] = time.perf_counter() - t0
    return rec


def run_clients(
    base_url: str,
    *,
    threads: int = 4,
    tenants: tuple[str, ...] = ("tenant-a", "tenant-b"),
    requests: int = 2,
    max_tokens: int = 16,
    stream: bool = False,
    model: str | None = None,
    timeout: float = 600.0,
    record: str | None = None,
    api_key: str = "llmobs",
) -> tuple[list[dict], float]:
    """Run `threads` clients at once, each sending `requests` requests one after the other; thread i is a
    client of tenants[i % len(tenants)] in session f"{tenant}-s{i}". Returns (records, wall seconds)."""
    import openai

    model = model or served_model(base_url, api_key)
    records: list[dict] = []
    lock = threading.Lock()
    start = threading.Barrier(threads + 1)  # every thread is ready before the clock starts

    def client_thread(i: int) -> None:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)
        tenant = tenants[i % len(tenants)]
        start.wait()
        for n in range(requests):
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            rec = one_request(client, model, prompt, tenant, f"{tenant}-s{i}", max_tokens, stream)
            rec.update(thread=i, index=n)
            with lock:
                records.append(rec)
        client.close()

    workers = [threading.Thread(target=client_thread, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    records.sort(key=lambda r: (r["thread"], r["index"]))
    if record:
        with open(record, "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    return records, wall


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of the non-null values, or None."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    rank = max(1, -(-len(values) * q // 100))  # ceil
    return round(values[int(rank) - 1], 4)


def summarise(records: list[dict], wall: float) -> dict:
    tokens = sum(r["completion_tokens"] or 0 for r in records if not r["error"])
    per_tenant = {}
    for tenant in sorted({r["tenant"] for r in records}):
        mine = [r for r in records if r["tenant"] == tenant]
        ok = [r for r in mine if not r["error"]]
        per_tenant[tenant] = {
            "requests": len(mine),
            "errors": len(mine) - len(ok),
            "tokens": sum(r["completion_tokens"] or 0 for r in ok),
        }
        for what in ("ttft", "total"):
            for q in (50, 99):
                per_tenant[tenant][f"{what}_p{q}_s"] = percentile([r[f"{what}_s"] for r in ok], q)
    errors = [r["error"] for r in records if r["error"]]
    return {
        "requests": len(records), "errors": len(errors), "first_error": errors[0] if errors else None,
        "tokens": tokens, "seconds": round(wall, 4), "tokens_per_s": round(tokens / wall, 3) if wall else 0.0,
        "tenants": per_tenant,
    }  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m llmobs.workloads.clients",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--base-url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1"
    )
    p.add_argument("--threads", type=int, default=4, help="concurrent clients")
    p.add_argument(
        "--tenants", default="tenant-a,tenant-b", help="comma-separated; thread i is tenant i mod T"
    )
    p.add_argument("--requests", type=int, default=2, help="requests per client, one after the other")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--stream", action="store_true", help="stream the completions (measures TTFT)")
    p.add_argument("--model", help="the model name to send (default: the first one GET /models lists)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--record", help="write one JSON line per request here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tenants = tuple(t.strip() for t in args.tenants.split(",") if t.strip())
    if args.threads < 1 or args.requests < 1 or args.max_tokens < 1 or not tenants:
        print("error: --threads, --requests and --max-tokens must be at least 1, and --tenants not empty",
              file=sys.stderr)  # fmt: skip
        print("hint: e.g. --threads 4 --requests 2 --max-tokens 16 --tenants a,b", file=sys.stderr)
        return 2
    try:
        model = args.model or served_model(args.base_url)
    except Exception as exc:
        print(
            f"error: no model listed at {args.base_url}/models ({type(exc).__name__}: {exc})", file=sys.stderr
        )
        print("hint: start the server first (python -m llmobs.workloads.serve) and pass its base_url",
              file=sys.stderr)  # fmt: skip
        return 2
    records, wall = run_clients(
        args.base_url, threads=args.threads, tenants=tenants, requests=args.requests,
        max_tokens=args.max_tokens, stream=args.stream, model=model, timeout=args.timeout, record=args.record,
    )  # fmt: skip
    summary = summarise(records, wall)
    print(json.dumps(summary), flush=True)
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
