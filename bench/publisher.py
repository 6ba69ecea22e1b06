"""Benchmark of the in-process publisher on SmolLM2-135M on the CPU, measured side by side in one run.

1. Publisher CPU cost per token step (thread CPU time, interleaved rounds, V = SmolLM2's vocabulary):
   - bookkeeping: context cell + record claim + host fields + device-block copy + commit
   - math:        the per-token torch metrics (log_softmax, entropy, target prob/rank, top-1)
   - full step:   req.begin_step() + req.step(logits, target), what instrument() adds per token
2. Tokens/s of SmolLM2 generate() with vs without instrument(), interleaved A/B rounds.
Prints ratios with their intervals (bench/harness.py; the machine is shared and noisy, absolute
numbers drift between runs).

    .venv/bin/python -m bench.publisher [--rounds 6] [--tokens 32] [--steps 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time

from bench.harness import Arm, Comparison, Report, add_json_option

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def thread_cpu_us_per_call(fn, n: int) -> dict[str, float]:
    """This thread's CPU per call (microseconds): the publisher's cost without other threads' noise."""
    t0 = time.thread_time_ns()
    for _ in range(n):
        fn()
    return {"thread CPU us/call": (time.thread_time_ns() - t0) / n / 1000}


def micro(vocab: int, steps: int, rounds: int, report: Report) -> Comparison:
    import llmobs
    import torch
    from llmobs.publisher.device_math import device_block
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

    # bookkeeping = cell + record + copy + commit (target <= 5 us); math = the torch ops on the logits
    calls = {"bookkeeping": bookkeeping, "metric math": math, "full step (begin_step + step)": full}
    arms = [Arm(name, lambda ctx, fn=fn: thread_cpu_us_per_call(fn, steps)) for name, fn in calls.items()]
    title = f"[1] publisher CPU per token step, V={vocab}, {steps} calls per round"
    return report.compare(title, arms, rounds, warmup=1, metrics=["thread CPU us/call"])


def macro(pairs: int, tokens: int, report: Report) -> Comparison:
    """Interleaved A/B pairs: tokens/s plain and instrumented (wall and process CPU), and the CPU
    time the instrument hooks themselves took per token."""
    import llmobs
    from llmobs.workloads.generate import PROMPTS, generate_once
    from llmobs.workloads.models import load_model

    model, tokenizer, model_id = load_model("smollm2")
    prompts = [PROMPTS[0]]
    generate_once(model, tokenizer, prompts, 4)  # warm-up

    def generate(instrumented: bool):
        def arm(ctx) -> dict[str, float]:
            inst = (
                llmobs.instrument(model, tokenizer, model_id=model_id, measure=True) if instrumented else None
            )
            with ctx.timed() as watch, llmobs.context(tenant="bench", session=f"r{ctx.index}"):
                generate_once(model, tokenizer, prompts, tokens)
            figures = {"tokens/s": tokens / watch.wall, "tokens/CPU-s": tokens / watch.cpu}
            if inst is not None:
                inst.remove()
                figures["hooks' CPU us/token"] = inst.cpu_ns / 1000 / tokens
            return figures

        return arm

    title = f"[2] SmolLM2-135M generate() on the CPU, {tokens} tokens per round"
    return report.compare(title, [Arm("plain", generate(False)), Arm("instrumented", generate(True))], pairs,
                          better={"tokens/s": "higher", "tokens/CPU-s": "higher"},
                          metrics=["tokens/s", "tokens/CPU-s", "hooks' CPU us/token"])  # fmt: skip


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
    add_json_option(p)
    args = p.parse_args(argv)

    from llmobs.shm.writer import configure

    # tmpfs like /dev/shm itself: a map on a disk filesystem pays writeback faults the real one never does
    shm_dir = tempfile.mkdtemp(prefix="llmobs-bench-", dir="/dev/shm")
    configure(shm_dir=shm_dir)
    atexit.register(shutil.rmtree, shm_dir, True)  # after the writer's own exit handler removed its map
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    report = Report("publisher", args)
    report.note(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    micro(49152, args.steps, args.rounds, report)  # V = SmolLM2-135M's vocabulary
    made = macro(args.rounds, args.tokens, report)
    hook = made.median("instrumented", "hooks' CPU us/token")
    plain_ms = 1000 / made.median("plain", "tokens/CPU-s")
    report.note(f"instrument hooks' own CPU per token: {hook:.1f} us = {hook / (plain_ms * 1000) * 100:.3f}% "
                f"of a plain token's {plain_ms:.1f} ms CPU (target <= 1%)")  # fmt: skip
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
