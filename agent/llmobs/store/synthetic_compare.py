"""Synthetic stores of labelled requests with known effects: for compare, the attribution matrix, their
tests and bench/compare_cost.py. Rows follow store migration 13 (request_labels, token_steps.shadow)
and the map contract of docs/compare.md: a shadow request scores its primary's tokens (same trace id,
step, position and target), has its own request_seq and a `shadow_of` label.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class RequestSpec:
    request_seq: int
    prompt: int  # requests with the same prompt share trace id, tokens and base losses
    model_id: str = "smollm2"
    tenant: str = "acme"
    labels: dict = field(default_factory=dict)  # includes 'variant' when it has one
    loss_shift: float = 0.0  # added to every token's base loss
    latency_ns: int = 2_000_000  # per decode token; the first token takes 4x
    shadow: bool = False
    finish_reason: str | None = None  # set: also a request_events 'end' row (a served request)
    allocations_per_token: int | None = None  # set: pass_shares rows (one per token step)


def prompt_trace(prompt: int) -> str:
    return f"{(prompt * 2654435761) % 2**64:016x}{(prompt + 1) * 40503:016x}"


def tables(
    pid: int,
    specs: list[RequestSpec],
    tokens: int,
    *,
    noise: float = 0.3,
    seed: int = 0,
    start_ns: int = 10**12,
) -> dict[str, pa.Table]:
    """token_steps, request_labels, request_events and pass_shares of `specs`, `tokens` tokens each: a
    token's loss is its prompt's base loss (gamma) + the request's loss_shift + N(0, noise)."""
    rng = np.random.default_rng(seed)
    m = len(specs)
    prompts = sorted({s.prompt for s in specs})
    index = {p: i for i, p in enumerate(prompts)}
    base = np.random.default_rng(seed + 1).gamma(2.0, 1.0, size=(len(prompts), tokens)).astype(np.float64)
    targets = np.random.default_rng(seed + 2).integers(0, 49_152, size=(len(prompts), tokens))
    pi = np.array([index[s.prompt] for s in specs])
    step = np.tile(np.arange(tokens), m)
    req = np.repeat(np.arange(m), tokens)
    shift = np.array([s.loss_shift for s in specs])
    loss = (base[pi].ravel() + shift[req] + rng.normal(0, noise, size=m * tokens)).astype(np.float32)
    lat = np.array([s.latency_ns for s in specs], dtype=np.int64)[req] * np.where(step == 0, 4, 1)
    t_start = start_ns + np.cumsum(np.concatenate(([0], lat[:-1] + 1000))).astype(np.int64)
    step_seq = 1 + np.arange(m * tokens, dtype=np.int64)  # one pass per token step
    traces = np.array([prompt_trace(s.prompt) for s in specs], dtype=object)
    seqs = np.array([s.request_seq for s in specs], dtype=np.int64)
    steps = pa.table(
        {
            "pid": np.full(m * tokens, pid, np.int32),
            "step_seq": step_seq,
            "trace_id": pa.array(traces[req], pa.string()),
            "step": step.astype(np.int32),
            "position": (16 + step).astype(np.int32),
            "token_id": targets[pi].ravel().astype(np.int32),
            "target_id": targets[pi].ravel().astype(np.int32),
            "loss": loss,
            "latency_ns": lat,
            "t_start_ns": t_start,
            "t_end_ns": t_start + lat,
            "batch_row": np.zeros(m * tokens, np.int32),
            "tenant": pa.array(np.array([s.tenant for s in specs], dtype=object)[req], pa.string()),
            "model_id": pa.array(np.array([s.model_id for s in specs], dtype=object)[req], pa.string()),
            "tokens_in_pass": np.ones(m * tokens, np.int32),
            "request_seq": seqs[req],
            "shadow": np.array([s.shadow for s in specs])[req],
        }
    )
    labels = [
        (pid, s.request_seq, prompt_trace(s.prompt), k, str(v), 1) for s in specs for k, v in s.labels.items()
    ]
    out = {
        "token_steps": steps,
        "request_labels": pa.table(
            dict(
                zip(
                    ("pid", "request_seq", "trace_id", "key", "value", "ts_ns"),
                    map(list, zip(*labels, strict=True)),
                    strict=True,
                )
            )
        )
        if labels
        else None,
    }
    first = np.arange(m) * tokens
    served = [i for i, s in enumerate(specs) if s.finish_reason is not None]
    if served:
        i = np.array(served)
        t0 = t_start[first[i]] - 500_000
        out["request_events"] = pa.table(
            {
                "pid": np.full(len(i), pid, np.int32),
                "kind": ["end"] * len(i),
                "request_seq": seqs[i],
                "trace_id": list(traces[i]),
                "model_id": [specs[j].model_id for j in i],
                "t_start_ns": t0,
                "t_end_ns": t_start[first[i] + tokens - 1] + lat[first[i] + tokens - 1],
                "ttft_ns": t_start[first[i]] + lat[first[i]] - t0,
                "tpot_ns": np.array([specs[j].latency_ns + 1000 for j in i], np.int64),
                "finish_reason": [specs[j].finish_reason for j in i],
            }
        )
    shared = np.array([s.allocations_per_token is not None for s in specs])[req]
    if shared.any():
        alloc = np.array([s.allocations_per_token or 0 for s in specs], dtype=np.int64)[req]
        k = shared
        out["pass_shares"] = pa.table(
            {
                "pid": np.full(int(k.sum()), pid, np.int32),
                "step_seq": step_seq[k],
                "t_start_ns": t_start[k],
                "row_kind": ["step"] * int(k.sum()),
                "batch_row": np.zeros(int(k.sum()), np.int32),
                "step": step[k].astype(np.int32),
                "position": (16 + step[k]).astype(np.int32),
                "request_seq": seqs[req][k],
                "tokens": np.ones(int(k.sum()), np.int32),
                "weight": np.ones(int(k.sum()), np.int64),
                "compute_ns": lat[k] // 2,
                "off_cpu_ns": lat[k] // 10,
                "allocations": alloc[k],
                "alloc_bytes": alloc[k] * 4096,
                "compute_calls": np.full(int(k.sum()), 30),
                "launches": np.zeros(int(k.sum()), np.int64),
                "gpu_ns": lat[k] // 3,
            }
        )
    return {k: v for k, v in out.items() if v is not None}


def shadow_pairs(
    pairs: int,
    tokens: int,
    *,
    shift: float,
    variants=("fp32", "q4-jitter"),
    template_every=2,
    seed: int = 0,
    pid: int = 7,
) -> dict[str, pa.Table]:
    """`pairs` primaries (variant A, labels template v1/v3 alternating) each shadow-scored by variant B
    (loss + `shift`): 2 x pairs x tokens token steps, every token of B paired with one of A."""
    specs = []
    for i in range(pairs):
        template = "v3" if i % template_every else "v1"
        specs.append(
            RequestSpec(
                i + 1, prompt=i, model_id="smollm2", labels={"variant": variants[0], "template": template}
            )
        )
        specs.append(
            RequestSpec(
                pairs + i + 1,
                prompt=i,
                model_id="smollm2-q4",
                shadow=True,
                loss_shift=shift,
                labels={"variant": variants[1], "template": template, "shadow_of": i + 1},
            )
        )
    return tables(pid, specs, tokens, seed=seed)
