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
import atexit
import importlib.util
import os
import shutil
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


def macro(pairs: int, tokens: int) -> dict[str, list[float]]:
    """Interleaved A/B pairs (order alternates). Per pair: tokens/s plain and instrumented (wall and
    process CPU), and the CPU time the instrument hooks themselves took per token."""
    import llmobs

    wl = _workload()
    model, tokenizer, model_id = wl.load_model("smollm2")
    prompts = [wl.PROMPTS[0]]
    wl.generate_once(model, tokenizer, prompts, 4)  # warm-up
    out: dict[str, list[float]] = {k: [] for k in ("plain", "instrumented", "plain_cpu", "instrumented_cpu",
                                                   "hook_us_per_token")}  # fmt: skip
    for r in range(pairs):
        order = ("plain", "instrumented") if r % 2 == 0 else ("instrumented", "plain")
        for mode in order:
            inst = (
                llmobs.instrument(model, tokenizer, model_id=model_id, measure=True)
                if mode != "plain"
                else None
            )
            t0, c0 = time.perf_counter(), time.process_time()
            with llmobs.context(tenant="bench", session=f"r{r}"):
                wl.generate_once(model, tokenizer, prompts, tokens)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if inst is not None:
                inst.remove()
                out["hook_us_per_token"].append(inst.cpu_ns / 1000 / tokens)
            out[mode].append(tokens / wall)
            out[mode + "_cpu"].append(tokens / cpu)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--rounds", type=int, default=10, help="interleaved rounds / A-B pairs (default %(default)s)"
    )
    p.add_argument("--tokens", type=int, default=24, help="tokens per generate() (default %(default)s)")
    p.add_argument("--steps", type=int, default=2000, help="calls per micro-benchmark round")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared 2-core machine a parallel op stalls for ms "
        "whenever the other core is busy, which swamps what is measured; 0 = torch default)",
    )
    args = p.parse_args(argv)

    from llmobs.shm.writer import configure

    # tmpfs like /dev/shm itself: a map on a disk filesystem pays writeback faults the real one never does
    shm_dir = tempfile.mkdtemp(prefix="llmobs-bench-", dir="/dev/shm")
    configure(shm_dir=shm_dir)
    atexit.register(shutil.rmtree, shm_dir, True)  # after the writer's own exit handler removed its map
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    vocab = 49152  # SmolLM2-135M
    m = micro(vocab, args.steps, args.rounds)
    med = {k: statistics.median(v) / 1000 for k, v in m.items()}
    rounds = f"median of {args.rounds} interleaved rounds x {args.steps} calls"
    print(f"\n[1] publisher CPU per token step (this thread's CPU time), V={vocab}, {rounds}")
    print(f"    bookkeeping (cell + record + copy + commit): {med['bookkeeping']:8.2f} us   (target <= 5 us)")
    print(f"    metric math (torch ops on the logits):       {med['math']:8.2f} us")
    print(f"    full step (begin_step + step):               {med['full']:8.2f} us")

    r = macro(args.rounds, args.tokens)
    ratio = [i / p for i, p in zip(r["instrumented"], r["plain"], strict=True)]
    ratio_cpu = [i / p for i, p in zip(r["instrumented_cpu"], r["plain_cpu"], strict=True)]
    hook = statistics.median(r["hook_us_per_token"])
    plain_ms = 1000 / statistics.median(r["plain_cpu"])
    pairs = f"{args.tokens} tokens x {args.rounds} interleaved A/B pairs"
    print(f"\n[2] SmolLM2-135M generate() on the CPU, {pairs}")
    print("    tokens/s plain:          " + " ".join(f"{x:6.2f}" for x in r["plain"]))
    print("    tokens/s instrumented:   " + " ".join(f"{x:6.2f}" for x in r["instrumented"]))
    print("    pair ratio (wall):       " + " ".join(f"{x:6.3f}" for x in ratio))
    print(f"    median pair ratio instrumented/plain: wall {statistics.median(ratio):.4f}, "
          f"process CPU {statistics.median(ratio_cpu):.4f}")  # fmt: skip
    print(f"    instrument hooks' own CPU per token: {hook:.1f} us = {hook / (plain_ms * 1000) * 100:.3f}% "
          f"of a plain token's {plain_ms:.1f} ms CPU (target <= 1%)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
