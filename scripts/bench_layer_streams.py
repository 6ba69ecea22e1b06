"""Cost of the layer streams and of training mode's dL/dE ring, measured side by side in one run.

    .venv/bin/python scripts/bench_layer_streams.py [--model tiny|smollm2] [--tokens 32] [--rounds 5]
                                                    [--train-steps 200]

1. MLP variance (and both streams): generate() with mlp_variance=MlpVariance(every=2), so sampled and
   unsampled forward passes alternate in the same run; each pass is timed from an outer pre-hook to an
   outer post-hook (wall ns). The same for layer_streams=LayerStreams(every=2) (attention + MLP).
   Prints medians and ratios; unsampled passes must cost what an uninstrumented pass costs.
2. Training mode (the tiny GPT-2, batch 4 x 32 tokens, AdamW): the same model and loop, alternating
   blocks of steps with the embedding hook (the ring's copy_ per step) and without it; prints the
   median step time of each and the ratio, and the CPU time spent inside the ring's write itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def bench_streams(args, policy_name: str) -> None:
    import llmobs
    import torch
    from llmobs.shm import writer as writer_module
    from workload import load_model

    model, _, model_id = load_model(args.model)
    times: dict[bool, list[int]] = {True: [], False: []}
    state = {}

    def pre(module, a, kw):
        state["t0"] = time.perf_counter_ns()

    def post(module, a, kw, out):
        seq = writer_module.get_writer().step_seq
        times[seq % 2 == 0].append(time.perf_counter_ns() - state["t0"])

    model.register_forward_pre_hook(pre, with_kwargs=True)  # outermost: brackets instrument's hooks
    policy = {"mlp": {"mlp_variance": llmobs.MlpVariance(every=2)},
              "both": {"layer_streams": llmobs.LayerStreams(every=2)}}[policy_name]  # fmt: skip
    inst = llmobs.instrument(model, model_id=model_id, **policy)
    model.register_forward_hook(post, with_kwargs=True)
    ids = torch.tensor([list(range(1, 17))])
    for _ in range(args.rounds):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                           pad_token_id=0)  # fmt: skip
    inst.remove()
    sampled, plain = statistics.median(times[True]), statistics.median(times[False])
    label = {"mlp": "MlpVariance(every=2)", "both": "LayerStreams(every=2)"}[policy_name]
    print(f"[{label}] model={args.model} tokens/round={args.tokens} rounds={args.rounds}")
    print(f"  unsampled forward pass  median {plain / 1e3:9.1f} us  (n={len(times[False])})")
    print(f"  sampled forward pass    median {sampled / 1e3:9.1f} us  (n={len(times[True])})")
    extra = (sampled - plain) / 1e3
    print(f"  ratio sampled/unsampled {sampled / plain:.3f}x; extra per sampled step {extra:.1f} us")


def bench_unsampled(args) -> None:
    """instrument() without a policy vs with LayerStreams that never samples: the same model, generate()
    calls alternating; the difference is what an unsampled pass pays for the policy (its begin/end)."""
    import llmobs
    import torch
    from workload import load_model

    model, _, model_id = load_model(args.model)
    ids = torch.tensor([list(range(1, 17))])
    plain, never = [], []
    for _ in range(args.rounds * 4):
        for bucket, with_policy in ((plain, False), (never, True)):
            # every=10**6: the policy installed, no pass sampled
            policy = {"layer_streams": llmobs.LayerStreams(every=10**6)} if with_policy else {}
            inst = llmobs.instrument(model, model_id=model_id, **policy)
            t0 = time.perf_counter_ns()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                               pad_token_id=0)  # fmt: skip
            bucket.append((time.perf_counter_ns() - t0) / args.tokens)
            inst.remove()
    inst = llmobs.instrument(model, model_id=model_id, layer_streams=llmobs.LayerStreams(every=10**6))
    from llmobs.shm.writer import get_writer

    writer, n = get_writer(), 20000
    t0 = time.thread_time_ns()
    for seq in range(1, n + 1):  # what the hooks call on every unsampled pass
        inst.layers.begin(seq, [0], [0])
        inst.layers.end(writer)
    direct = (time.thread_time_ns() - t0) / n
    inst.remove()
    print(
        f"[LayerStreams on an unsampled pass] begin+end CPU {direct / 1e3:.2f} us per pass (timed directly)"
    )
    a, b = statistics.median(plain), statistics.median(never)
    print(
        f"[instrument() alone vs + LayerStreams never sampled] per token {a / 1e3:.1f} us vs {b / 1e3:.1f} us"
    )
    print(f"  ratio {b / a:.3f}x; {(b - a) / 1e3:+.1f} us per token ({len(plain)} generate calls each)")


def bench_training(args) -> None:
    import llmobs
    import torch
    from train_workload import batch_of
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
    with_ring, without = [], []
    for step in range(args.train_steps):
        ring_on = step % 2 == 0  # alternate every step: both arms see the same machine load
        if not ring_on:
            rec._handle.remove()  # the embedding hook off: no tensor hook, no copy_
        ids = batch_of(0, 4, 32, False, generator)
        t0 = time.perf_counter_ns()
        out = model(ids, labels=ids)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        (with_ring if ring_on else without).append(time.perf_counter_ns() - t0)
        if not ring_on:
            rec._handle = rec.embedding.register_forward_hook(rec._on_embedding)
    inst.remove()
    a, b = statistics.median(without), statistics.median(with_ring)
    writes = rec.ring.head
    print(f"[training mode, tiny GPT-2, batch 4 x 32 tokens, ring {tuple(rec.ring.data.shape)} "
          f"{rec.ring.data.dtype}, {rec.ring.nbytes / 2**20:.2f} MiB]")  # fmt: skip
    print(f"  train step without ring median {a / 1e3:9.1f} us  (n={len(without)})")
    print(f"  train step with ring    median {b / 1e3:9.1f} us  (n={len(with_ring)})")
    per_write = write_cpu[0] / max(writes, 1) / 1e3
    print(f"  ratio with/without {b / a:.3f}x; ring write CPU per step {per_write:.1f} us ({writes} writes)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=200)
    args = p.parse_args()
    import torch
    from llmobs.shm import writer as writer_module

    torch.set_num_threads(1)
    writer_module.configure(shm_dir=tempfile.mkdtemp())
    print("torch threads 1; every number below is a median of interleaved samples from this run")
    bench_streams(args, "mlp")
    writer_module.reset_writer()
    bench_streams(args, "both")
    writer_module.reset_writer()
    bench_unsampled(args)
    writer_module.reset_writer()
    bench_training(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
