"""What shadow scoring (llmobs.shadow, llmobs.publisher.shadow) costs, side by side in one run.

    .venv/bin/python -m bench.shadow_cost [--prompt 32] [--tokens 64] [--rounds 4] [--json PATH]

The primary is SmolLM2-135M, the shadow its int4 fake-quantized copy (llmobs.workloads.variants; the
same size, so its teacher-forced pass costs what a real variant's would). Arms, rounds interleaved:
  generate() alone            instrument() only
  generate() + shadow         instrument() and llmobs.shadow(primary, int4)
Each round runs two generate() calls of --tokens tokens after a --prompt-token prompt: the first is not
timed; the second is, while the shadow thread scores the first one (so the timed request shares the
machine with a shadow pass, as a server's next request would); the round then waits for the shadow
queue to drain, so no pass leaks into the next round. Figures per round: the timed request's decode
tokens/s and wall ms, the hooks' CPU per step on the live thread (measure=True: the shadow's share is
a list append per step and the hand-over at the end), and for the shadow arm the wall time of the
shadow pass of a request (one forward over prompt + tokens, the metrics, the records) and its ratio to
the request's own wall time. torch runs one intra-op thread (both threads share the machine's cores
as a server's would).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from bench.harness import Arm, Report, add_json_option


def _generate(model, ids, tokens: int) -> float:
    """Wall seconds of one greedy generate() of `tokens` tokens."""
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                       min_new_tokens=tokens, do_sample=False, pad_token_id=0)  # fmt: skip
    return time.perf_counter() - t0


def bench(args, model, shadow_model, model_id, ids, report: Report) -> None:
    import llmobs
    from llmobs.publisher import shadow as shadow_module

    def arm(with_shadow: bool):
        def run(ctx) -> dict[str, float]:
            inst = llmobs.instrument(model, model_id=model_id, measure=True)
            handle = llmobs.shadow(model, shadow_model, variant="int4") if with_shadow else None
            try:
                _generate(model, ids, args.tokens)  # its shadow pass runs during the timed request
                cpu0 = inst.cpu_ns
                wall = _generate(model, ids, args.tokens)
                hooks_us = (inst.cpu_ns - cpu0) / args.tokens / 1e3
                if handle is not None:
                    if not handle.wait_idle(600):
                        raise RuntimeError("the shadow queue did not drain")
                    if handle.failed or handle.dropped or handle.requests != 2:
                        why = handle.scorer.last_error
                        raise RuntimeError(f"shadow: {handle.requests} scored, {handle.failed} failed, "
                                           f"{handle.dropped} dropped ({why})")  # fmt: skip
            finally:
                if handle is not None:
                    handle.remove()
                inst.remove()
            figures = {
                "tokens/s": args.tokens / wall,
                "request ms": wall * 1e3,
                "hook CPU us per step": hooks_us,
            }
            if handle is not None:
                figures["shadow pass ms"] = handle.last_wall_ns / 1e6
                figures["shadow / request"] = handle.last_wall_ns / 1e9 / wall
            return figures

        return run

    arms = [Arm("generate() alone", arm(False)), Arm("generate() + llmobs.shadow", arm(True))]
    title = (f"[shadow scoring, SmolLM2-135M primary, int4 shadow, prompt {ids.shape[1]} tokens, "
             f"{args.tokens} tokens/request, rounds={args.rounds}]")  # fmt: skip
    made = report.compare(
        title, arms, args.rounds, warmup=1,
        metrics=["tokens/s", "request ms", "hook CPU us per step", "shadow pass ms", "shadow / request"],
        better={"tokens/s": "higher"},
    )  # fmt: skip
    shadow_module._scorer = None  # the benchmark's scorer goes with it
    request_ms = made.median(arms[1].name, "request ms")
    pass_ms = made.median(arms[1].name, "shadow pass ms")
    report.note(
        f"  shadow pass per request: {pass_ms:.1f} ms = {pass_ms / request_ms:.3f} x the request's "
        f"own {request_ms:.0f} ms (one forward over {ids.shape[1]} + {args.tokens} positions)"
    )
    alone, shadowed = made.median(arms[0].name, "tokens/s"), made.median(arms[1].name, "tokens/s")
    report.note(f"  primary tokens/s: {alone:.1f} alone, {shadowed:.1f} with a shadow pass beside it "
                f"({(shadowed / alone - 1) * 100:+.1f}%)")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--rounds", type=int, default=4)
    add_json_option(p)
    args = p.parse_args()
    import torch
    from llmobs.shm import writer as writer_module
    from llmobs.workloads.models import load_model
    from llmobs.workloads.variants import fake_quantize

    torch.set_num_threads(1)
    writer_module.configure(shm_dir=tempfile.mkdtemp())
    model, tokenizer, model_id = load_model("smollm2")
    shadow_model = fake_quantize(model, bits=4)
    text = "The history of the city is long, and its people remember every street by a story. " * 8
    ids = tokenizer([text], return_tensors="pt")["input_ids"][:, : args.prompt].to(torch.long)
    report = Report("shadow_cost", args)
    report.note(
        f"torch threads 1, {os.cpu_count()} CPUs; every number below is from interleaved samples of this run"
    )
    bench(args, model, shadow_model, model_id, ids, report)
    report.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
