"""Cost of a sampled attention-entropy step vs an unsampled one, interleaved in one run.

    .venv/bin/python -m bench.attention_entropy --model tiny|smollm2 [--tokens 32] [--rounds 5] [--json PATH]

Runs generate() with attention_entropy=AttentionEntropy(every=2) so odd and even forward passes
alternate in the same run, and times each forward pass (pre-hook to post-hook, wall; bench/
forward_passes.py); prints min / median / max of each kind and the ratio sampled/unsampled with its
interval (bench/harness.py), and the extra time per sampled step.
"""

from __future__ import annotations

import argparse
import tempfile

from bench.forward_passes import FIGURE, SAMPLED, UNSAMPLED, time_generate
from bench.harness import Report, add_json_option


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    add_json_option(p)
    args = p.parse_args()
    import torch
    from llmobs.shm import writer as writer_module

    torch.set_num_threads(1)
    writer_module.configure(shm_dir=tempfile.mkdtemp())
    import llmobs
    from llmobs.workloads.models import load_model

    model, tok, model_id = load_model(args.model)
    report = Report("attention_entropy", args)
    title = f"AttentionEntropy(every=2), model={args.model}, {args.tokens} tokens x {args.rounds} generate()"
    passes = report.comparison(title, [UNSAMPLED, SAMPLED], baseline=UNSAMPLED)
    time_generate(model, passes, args.tokens, args.rounds, model_id=model_id,
                  attention_entropy=llmobs.AttentionEntropy(every=2))  # fmt: skip
    report.show(passes)
    extra = passes.median(SAMPLED, FIGURE) - passes.median(UNSAMPLED, FIGURE)
    report.note(f"extra per sampled step {extra:.1f} us (torch threads 1)")
    report.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
