"""Cost of a sampled attention-entropy step vs an unsampled one, interleaved in one run.

    .venv/bin/python scripts/bench_attention_entropy.py --model tiny|smollm2 [--tokens 32] [--rounds 5]

Runs generate() with attention_entropy=AttentionEntropy(every=2) so odd and even forward passes
alternate in the same run, and times each forward pass (pre-hook to post-hook, wall ns); prints the
median of each kind and their ratio, plus a generate() without the policy for reference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    import torch
    from llmobs.shm import writer as writer_module

    torch.set_num_threads(1)
    writer_module.configure(shm_dir=tempfile.mkdtemp())
    import llmobs
    from workload import load_model

    model, tok, model_id = load_model(args.model)
    times: dict[bool, list[int]] = {True: [], False: []}
    state = {}

    def pre(module, a, kw):
        state["t0"] = time.perf_counter_ns()

    def post(module, a, kw, out):
        seq = writer_module.get_writer().step_seq
        times[seq % 2 == 0].append(time.perf_counter_ns() - state["t0"])

    # outermost hooks: registered before instrument's, so they bracket its pre- and post-hooks
    model.register_forward_pre_hook(pre, with_kwargs=True)
    inst = llmobs.instrument(model, model_id=model_id, attention_entropy=llmobs.AttentionEntropy(every=2))
    model.register_forward_hook(post, with_kwargs=True)
    ids = torch.tensor([list(range(1, 17))])
    for _ in range(args.rounds):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                           pad_token_id=0)  # fmt: skip
    sampled, plain = statistics.median(times[True]), statistics.median(times[False])
    print(f"model={args.model} tokens/round={args.tokens} rounds={args.rounds} (torch threads 1)")
    print(f"unsampled forward pass  median {plain / 1e3:9.1f} us  (n={len(times[False])})")
    print(f"sampled forward pass    median {sampled / 1e3:9.1f} us  (n={len(times[True])})")
    extra = (sampled - plain) / 1e3
    print(f"ratio sampled/unsampled {sampled / plain:.2f}x; extra per sampled step {extra:.1f} us")
    inst.remove()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
