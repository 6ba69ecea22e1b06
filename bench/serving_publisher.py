"""Continuous batching with and without the publisher: transformers' ContinuousBatchingManager on the CPU,
the same requests each round, two identical models (one instrumented), interleaved by the harness.

    python -m bench.serving_publisher [--rounds 6] [--requests 8] [--tokens 24] [--json PATH]

Per round each arm adds `--requests` prompts (different lengths, half of them while the first half is
decoding, so passes mix prefills and decodes) and waits for them all; figures: generated tokens/s of the
engine, and for the instrumented arm the publisher's own CPU (thread time inside its calls: the
bookkeeping and the per-token metric math) per forward pass (mixed-batch step) and per row (token step).
The adapter's wrappers around the engine's methods are not inside that figure; the tokens/s ratio is
the whole cost.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile

from bench.harness import Arm, Report, add_json_option


def _model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=1024)  # fmt: skip
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def _prompts(args) -> list[list[int]]:
    return [[(7 * i + j) % (args.vocab - 1) + 1 for j in range(8 + 5 * i)] for i in range(args.requests)]


def _serve(model, args, stats: dict | None, ctx):
    """One round: start a manager, add half the requests, the rest once the first token came back. Only
    the requests are timed (the manager's start and stop, the same for both arms, are not)."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=args.tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(max_batch_tokens=args.batch_tokens, page_size=16, num_blocks=256)
    prompts = _prompts(args)
    half = len(prompts) // 2
    with (
        torch.no_grad(),
        model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, block=True, timeout=60, warmup=False
        ) as manager,
    ):
        adapter = getattr(manager, "_llmobs_serving", None)
        if adapter is not None:
            adapter.publisher.measure = True
        with ctx.timed() as watch:
            ids = [manager.add_request(p, request_id=f"r{i}", streaming=i == 0)
                   for i, p in enumerate(prompts[:half])]  # fmt: skip
            first = manager.get_result(request_id="r0", timeout=120)
            assert first is not None, "the engine gave no first token"
            ids += [manager.add_request(p, request_id=f"r{half + i}") for i, p in enumerate(prompts[half:])]
            done, tokens = set(), 0
            while len(done) < len(ids):
                result = manager.get_result(timeout=120)
                assert result is not None, "the engine stopped answering"
                if result.is_finished() and result.request_id not in done:
                    done.add(result.request_id)
                    tokens += len(result.generated_tokens)
        if adapter is not None and stats is not None:
            p = adapter.publisher
            stats.update(cpu_ns=p.cpu_ns, passes=p.passes, steps=p.steps)
    return tokens, watch.wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per request")
    parser.add_argument(
        "--batch-tokens", type=int, default=64, help="ContinuousBatchingConfig.max_batch_tokens"
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    add_json_option(parser)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from llmobs import environment

    os.environ.setdefault(environment.LLMOBS_SHM_DIR, tempfile.mkdtemp(prefix="llmobs-bench-"))
    import llmobs

    plain = _model(args)
    instrumented = copy.deepcopy(plain)
    llmobs.instrument(instrumented, model_id="bench-llama")
    publisher_stats: list[dict] = []

    def run(model, stats_list):
        def arm(ctx):
            stats: dict = {}
            tokens, wall = _serve(model, args, stats, ctx)
            figures = {"tokens/s": tokens / wall}
            if stats:
                stats_list.append(stats)
                figures["publisher us/pass"] = stats["cpu_ns"] / max(stats["passes"], 1) / 1e3
                figures["publisher us/row"] = stats["cpu_ns"] / max(stats["steps"], 1) / 1e3
                figures["rows/pass"] = stats["steps"] / max(stats["passes"], 1)
            return figures

        return arm

    report = Report("serving_publisher", args)
    model = f"tiny Llama {args.hidden}x{args.layers}, CPU"
    report.compare(
        f"continuous batching, {args.requests} requests x {args.tokens} tokens ({model})",
        [Arm("engine alone", run(plain, [])), Arm("instrumented", run(instrumented, publisher_stats))],
        rounds=args.rounds, baseline="engine alone", warmup=1, better={"tokens/s": "higher"},
    )  # fmt: skip
    from llmobs.publisher import request as publisher

    report.note(f"publisher errors: {publisher.errors}")
    report.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
