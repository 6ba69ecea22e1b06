"""Cost of the layer streams and of training mode's dL/dE ring, measured side by side in one run.

    .venv/bin/python -m bench.layer_streams [--model tiny|smollm2] [--tokens 32] [--rounds 5]
                                            [--train-steps 200] [--json PATH]

1. MLP variance (and both streams): generate() with mlp_variance=MlpVariance(every=2), so sampled and
   unsampled forward passes alternate in the same run; each pass is timed from an outer pre-hook to an
   outer post-hook (wall; bench/forward_passes.py). The same for layer_streams=LayerStreams(every=2)
   (attention + MLP). Unsampled passes must cost what an uninstrumented pass costs.
2. instrument() alone vs with LayerStreams that never samples, generate() calls interleaved, and the
   policy's begin+end timed directly.
3. Training mode (the tiny GPT-2, batch 4 x 32 tokens, AdamW): the same model and loop, alternating
   steps with the embedding hook (the ring's copy_ per step) and without it; the step time of each and
   the ratio, and the CPU time spent inside the ring's write itself.
Every table is bench/harness.py's: min / median / max, ratios with a 95% interval.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from bench.forward_passes import FIGURE, SAMPLED, UNSAMPLED, time_generate
from bench.harness import Arm, Report, add_json_option


def bench_streams(args, policy_name: str, report: Report) -> None:
    import llmobs
    from llmobs.workloads.models import load_model

    model, _, model_id = load_model(args.model)
    label = {"mlp": "MlpVariance(every=2)", "both": "LayerStreams(every=2)"}[policy_name]
    title = f"[{label}] model={args.model} tokens/round={args.tokens} rounds={args.rounds}"
    passes = report.comparison(title, [UNSAMPLED, SAMPLED], baseline=UNSAMPLED)
    policy = {"mlp": {"mlp_variance": llmobs.MlpVariance(every=2)},
              "both": {"layer_streams": llmobs.LayerStreams(every=2)}}[policy_name]  # fmt: skip
    time_generate(model, passes, args.tokens, args.rounds, model_id=model_id, **policy)
    report.show(passes)
    extra = passes.median(SAMPLED, FIGURE) - passes.median(UNSAMPLED, FIGURE)
    report.note(f"  extra per sampled step {extra:.1f} us")


def bench_unsampled(args, report: Report) -> None:
    """instrument() without a policy vs with LayerStreams that never samples: the same model, generate()
    calls interleaved; the difference is what an unsampled pass pays for the policy (its begin/end)."""
    import llmobs
    import torch
    from llmobs.workloads.models import load_model

    model, _, model_id = load_model(args.model)
    ids = torch.tensor([list(range(1, 17))])

    def generate(with_policy: bool):
        def arm(ctx) -> dict[str, float]:
            # every=10**6: the policy installed, no pass sampled
            policy = {"layer_streams": llmobs.LayerStreams(every=10**6)} if with_policy else {}
            inst = llmobs.instrument(model, model_id=model_id, **policy)
            with ctx.timed() as watch, torch.no_grad():
                model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                               pad_token_id=0)  # fmt: skip
            inst.remove()
            return {"us per token": watch.wall / args.tokens * 1e6}

        return arm

    arms = [Arm("instrument() alone", generate(False)), Arm("+ LayerStreams never sampled", generate(True))]
    report.compare("[LayerStreams on unsampled passes]", arms, args.rounds * 4, metrics=["us per token"])
    inst = llmobs.instrument(model, model_id=model_id, layer_streams=llmobs.LayerStreams(every=10**6))
    from llmobs.shm.writer import get_writer

    writer, n = get_writer(), 20000
    t0 = time.thread_time_ns()
    for seq in range(1, n + 1):  # what the hooks call on every unsampled pass
        inst.layers.begin(seq, [0], [0])
        inst.layers.end(writer)
    direct = (time.thread_time_ns() - t0) / n
    inst.remove()
    report.note(
        f"  LayerStreams begin+end on an unsampled pass: CPU {direct / 1e3:.2f} us per pass (timed directly)"
    )


def bench_training(args, report: Report) -> None:
    import llmobs
    import torch
    from llmobs.workloads.train import batch_of
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).train()
    inst = llmobs.instrument(model, model_id="tiny-train", training=True)
    rec = inst.training
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    write_cpu = [0]
    original_write = rec.ring.write

    def timed_write(seq, grad):
        t0 = time.thread_time_ns()
        original_write(seq, grad)
        write_cpu[0] += time.thread_time_ns() - t0

    rec.ring.write = timed_write

    def train_step(ring_on: bool):
        def arm(ctx) -> dict[str, float]:
            if not ring_on:
                rec._handle.remove()  # the embedding hook off: no tensor hook, no copy_
            ids = batch_of(0, 4, 32, False, generator)
            with ctx.timed() as watch:
                out = model(ids, labels=ids)
                optimizer.zero_grad(set_to_none=True)
                out.loss.backward()
                optimizer.step()
            if not ring_on:
                rec._handle = rec.embedding.register_forward_hook(rec._on_embedding)
            return {"us per train step": watch.wall * 1e6}

        return arm

    arms = [Arm("without ring", train_step(False)), Arm("with ring", train_step(True))]
    made = report.comparison("training", [a.name for a in arms], metrics=["us per train step"])
    made.run(arms, args.train_steps // 2)  # one step per arm per round: both see the same machine load
    made.title = (f"[training mode, tiny GPT-2, batch 4 x 32 tokens, ring {tuple(rec.ring.data.shape)} "
                  f"{rec.ring.data.dtype}, {rec.ring.nbytes / 2**20:.2f} MiB]")  # fmt: skip
    report.show(made)
    inst.remove()
    writes = rec.ring.head
    per_write = write_cpu[0] / max(writes, 1) / 1e3
    report.note(f"  ring write CPU per step {per_write:.1f} us ({writes} writes)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=200)
    add_json_option(p)
    args = p.parse_args()
    import torch
    from llmobs.shm import writer as writer_module

    torch.set_num_threads(1)
    writer_module.configure(shm_dir=tempfile.mkdtemp())
    report = Report("layer_streams", args)
    report.note("torch threads 1; every number below is from interleaved samples of this run")
    bench_streams(args, "mlp", report)
    writer_module.reset_writer()
    bench_streams(args, "both", report)
    writer_module.reset_writer()
    bench_unsampled(args, report)
    writer_module.reset_writer()
    bench_training(args, report)
    report.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
