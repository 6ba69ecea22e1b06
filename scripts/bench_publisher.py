#!/usr/bin/env python3
"""Benchmark of the in-process publisher on SmolLM2-135M on the CPU, measured side by side in one run.

1. Publisher CPU cost per token step (thread CPU time, interleaved rounds, V = SmolLM2's vocabulary):
   - bookkeeping: context cell + record claim + host fields + device-block copy + commit
   - math:        the per-token torch metrics (log_softmax, entropy, target prob/rank, top-1)
   - full step:   req.begin_step() + req.step(logits, target), what instrument() adds per token
2. Tokens/s of SmolLM2 generate() with vs without instrument(), interleaved A/B rounds.
Prints ratios (the machine is shared and noisy; absolute numbers drift between runs).

    .venv/bin/python scripts/bench_publisher.py [--rounds 6] [--tokens 32] [--steps 2000]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent


def _workload():
    spec = importlib.util.spec_from_file_location("workload", ROOT / "workload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cpu_ns_per_call(fn, n: int) -> float:
    t0 = time.thread_time_ns()
    for _ in range(n):
        fn()
    return (time.thread_time_ns() - t0) / n


def micro(vocab: int, steps: int, rounds: int) -> dict[str, list[float]]:
    import llmobs
    import torch
    from llmobs.publisher_math import device_block
    from llmobs.shm.writer import get_writer

    logits = torch.randn(1, vocab)
    target = torch.tensor([123])
    block = device_block(logits, target)
    w = get_writer()
    req = llmobs.request([1, 2, 3], tenant="bench", session="s", model_id="bench")
    hi, lo = [int(req.trace_hi[0])], [int(req.trace_lo[0])]

    def bookkeeping():
        seq = w.begin_step(hi[0], lo[0], req.tenant_hash, req.session_hash)
        w.publish_steps(
            block, step_seq=seq, t_start=1, t_end=2, trace_hi=hi, trace_lo=lo, tenant_hash=1,
            session_hash=2, model_hash=3, step=0, position=[3], batch_row=[0], kv_len=-1, flags=1,
        )  # fmt: skip

    def math():
        device_block(logits, target, all_valid=True)

    def full():
        req.begin_step()
        req.step(logits, target, all_valid=True)

    results: dict[str, list[float]] = {"bookkeeping": [], "math": [], "full": []}
    for fn in (bookkeeping, math, full):  # warm-up
        _cpu_ns_per_call(fn, 50)
    for _ in range(rounds):
        for name, fn in (("bookkeeping", bookkeeping), ("math", math), ("full", full)):
            results[name].append(_cpu_ns_per_call(fn, steps))
    return results


def macro(rounds: int, tokens: int, threads: int) -> dict[str, list[float]]:
    import llmobs
    import torch

    wl = _workload()
    if threads:
        torch.set_num_threads(threads)
    model, tokenizer, model_id = wl.load_model("smollm2")
    prompts = [wl.PROMPTS[0]]
    wl.generate_once(model, tokenizer, prompts, 4)  # warm-up
    out: dict[str, list[float]] = {"plain": [], "instrumented": [], "plain_cpu": [], "instrumented_cpu": []}
    for r in range(rounds):
        order = ("plain", "instrumented") if r % 2 == 0 else ("instrumented", "plain")  # ABBA: no order bias
        for mode in order:
            inst = llmobs.instrument(model, tokenizer, model_id=model_id) if mode == "instrumented" else None
            t0, c0 = time.perf_counter(), time.process_time()
            with llmobs.context(tenant="bench", session=f"r{r}"):
                wl.generate_once(model, tokenizer, prompts, tokens)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if inst is not None:
                inst.remove()
            out[mode].append(tokens / wall)
            out[mode + "_cpu"].append(tokens / cpu)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default %(default)s)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per generate() (default %(default)s)")
    p.add_argument("--steps", type=int, default=2000, help="calls per micro-benchmark round")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    args = p.parse_args(argv)

    from llmobs.shm.writer import configure

    configure(shm_dir=tempfile.mkdtemp(prefix="llmobs-bench-"))
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    vocab = 49152  # SmolLM2-135M
    m = micro(vocab, args.steps, args.rounds)
    med = {k: statistics.median(v) / 1000 for k, v in m.items()}
    rounds = f"median of {args.rounds} interleaved rounds x {args.steps} calls"
    print(f"\n[1] publisher CPU per token step (this thread's CPU time), V={vocab}, {rounds}")
    print(f"    bookkeeping (cell + record + copy + commit): {med['bookkeeping']:8.2f} us   (target <= 5 us)")
    print(f"    metric math (torch ops on the logits):       {med['math']:8.2f} us")
    print(f"    full step (begin_step + step):               {med['full']:8.2f} us")

    r = macro(args.rounds, args.tokens, args.threads)
    plain, inst = statistics.median(r["plain"]), statistics.median(r["instrumented"])
    plain_cpu, inst_cpu = statistics.median(r["plain_cpu"]), statistics.median(r["instrumented_cpu"])
    print(f"\n[2] SmolLM2-135M generate(), {args.tokens} tokens x {args.rounds} interleaved A/B rounds (CPU)")
    print("    per round tokens/s plain:        " + " ".join(f"{x:6.2f}" for x in r["plain"]))
    print("    per round tokens/s instrumented: " + " ".join(f"{x:6.2f}" for x in r["instrumented"]))
    print(f"    median tokens/s (wall): plain {plain:.2f}  instrumented {inst:.2f}  ratio {inst / plain:.4f}"
          f"  ({(1 - inst / plain) * 100:+.2f}% slower)")  # fmt: skip
    print(f"    median tokens per CPU-second: plain {plain_cpu:.2f}  instrumented {inst_cpu:.2f}  "
          f"ratio {inst_cpu / plain_cpu:.4f}")  # fmt: skip
    per_token_ms = 1000 / plain
    print(f"    full step cost / token time: {med['full'] / (per_token_ms * 1000) * 100:.3f}% "
          f"({med['full']:.1f} us of {per_token_ms:.1f} ms)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
