#!/usr/bin/env python3
"""CUDA generation loop for scripts/gpu_check.sh and the gpu test tier: a random-init GPT-2 on the GPU,
instrumented with llmobs (or not, for the baseline), generating until told to stop.

Models (random weights, no download): `tiny` (2 layers, 64 wide, as in the unit tests) and `small`
(GPT-2 small's shape: 12 layers, 768 wide, vocab 50257), which gives each token step a realistic
few hundred kernels. The map's CUPTI ring is made large (65536 records) so a trace of 8 steps of
`small` fits without the reader racing the ring.

Synchronisation without sleeps: --ready-fd N gets one JSON line {"pid", "map", "phase": "ready"} once
the model is on the GPU and warmed up (--wait-stdin: then a line on stdin starts the measured
requests); the last stdout line is a JSON summary with tokens_per_s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SHAPES = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 256},
    "small": {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="small")
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=0, help="generate() calls; 0 = until SIGTERM/SIGINT")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--no-instrument", action="store_true", help="baseline: no llmobs at all")
    p.add_argument("--ready-fd", type=int, help="write the ready JSON line to this inherited fd")
    p.add_argument("--wait-stdin", action="store_true", help="after ready, wait for a stdin line to start")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *a: stop.update(now=True))
    torch.manual_seed(args.seed)
    shape = SHAPES[args.model]
    config = GPT2Config(**shape, n_positions=1024, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).eval().to(args.device)
    map_path = ""
    if not args.no_instrument:
        import llmobs
        from llmobs.shm.writer import configure, get_writer

        configure(cupti_capacity=1 << 16)
        llmobs.instrument(model, model_id=f"gpt2-{args.model}-random")
        map_path = get_writer().path
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    ids = torch.randint(1, shape["vocab_size"], (args.batch, args.prompt_len), generator=gen).to(args.device)
    mask = torch.ones_like(ids)

    def generate():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                           min_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0)  # fmt: skip

    def sync():
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize()

    generate()  # warm-up: CUDA context, cuBLAS handles, allocator
    sync()
    if args.ready_fd is not None:
        line = {"pid": os.getpid(), "map": map_path, "phase": "ready", "model": args.model}
        os.write(args.ready_fd, (json.dumps(line) + "\n").encode())
    if args.wait_stdin:
        sys.stdin.readline()
    n = tokens = 0
    started = time.perf_counter()
    try:
        while not stop["now"] and (args.requests == 0 or n < args.requests):
            generate()
            n += 1
            tokens += args.max_new_tokens * args.batch
    except KeyboardInterrupt:
        pass
    sync()
    seconds = time.perf_counter() - started
    summary = {"pid": os.getpid(), "model": args.model, "requests": n, "tokens": tokens,
               "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
               "instrumented": not args.no_instrument, "map": map_path}  # fmt: skip
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
