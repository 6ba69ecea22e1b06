"""Replay of a window near the end of a long context: from the nearest KV snapshot vs from the prompt.

    .venv/bin/python -m bench.replay_cost [--context 2048] [--window 8] [--every 256,64] [--repeats 2]
                                          [--rounds 1] [--threads 1] [--json PATH]

Setup (one subprocess, not timed): SmolLM2-135M on the CPU, a context of --context token ids (seeded),
and for each interval E in --every the snapshot the flight recorder would hold for it with snapshots
every E positions: the keys/values of [0, S), S = the last multiple of E at or before the window,
written to a file. The window is the --window positions before the last token (every replayed pass
has a target), so it sits near the worst case for E = 256: 248 positions after the snapshot at 2,048.

Arms, each round in a fresh subprocess of its own (bench/harness.py Command, interleaved):
  snapshot/E  replay_window(..., snapshot=<[0, S)>): prefill [S, first) then the window's passes
  prompt      replay_window(..., snapshot=None): the full recomputation, prefill [0, first) then the same
Both with every capture of the replay on (op sequence, fingerprints, per-head entropy) and --repeats
repeats. Figures (from the child): `replay_ms` (the replay_window call, wall), `prefill_ms` (its
prefill passes), `peak_rss_mb` (VmHWM during the call: the peak is reset after the model, the snapshot
and a 2-position warm-up are in memory) and `above_model_mb` (that peak minus the RSS with the model
loaded, before the snapshot). Printed side by side with the seed's 142 vs 890 ms and 3.1 vs 14.2 GB.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import Command, Report, add_json_option

REPO = Path(__file__).resolve().parents[1]
SEED_MS = (142.0, 890.0)  # seed 4.2: replay from the nearest snapshot vs full recomputation
SEED_GB = (3.1, 14.2)  # and their peak memory
FIGURES = ["replay_ms", "prefill_ms", "peak_rss_mb", "above_model_mb"]


def intervals(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--every needs positive intervals, comma-separated: {text!r}")
    return values


def window(context: int, size: int, every: int) -> tuple[int, int, int]:
    """(first_pos, last_pos, snapshot length): the `size` positions before the last token, and the
    last multiple of `every` at or before first_pos."""
    last = context - 2
    first = last - size + 1
    return first, last, (first // every) * every


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _settle() -> None:
    """Give freed memory back to the kernel so the RSS is what is held, not what malloc keeps."""
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _load(threads: int):
    import torch

    torch.set_num_threads(threads)
    from llmobs.workloads.models import load_model

    model, _, _ = load_model("smollm2")
    return model


def prepare(args, out: Path) -> None:
    import torch
    from transformers import DynamicCache

    model = _load(args.threads)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (args.context,), generator=generator)
    for every in args.every:
        _, _, length = window(args.context, args.window, every)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=tokens[:length].view(1, -1), cache=cache, use_cache=True, logits_to_keep=1)
        layers = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        torch.save({"tokens": tokens, "length": length, "layers": layers}, out / f"snapshot-{every}.pt")


def child(args, mode: str, out: Path) -> None:
    import torch
    from llmobs.publisher.replay import KvSnapshot, replay_window

    model = _load(args.threads)
    _settle()
    model_kb = _status_kb("VmRSS")
    every = args.every[0] if mode == "prompt" else int(mode.removeprefix("snapshot/"))
    saved = torch.load(out / f"snapshot-{every}.pt")
    tokens = saved["tokens"]
    snapshot = KvSnapshot(saved["length"], saved["layers"]) if mode != "prompt" else None
    if snapshot is None:
        del saved
    replay_window(model, tokens, 1, 2, repeats=1)  # first-call costs (allocator, kernels) out of the figure
    _settle()
    _reset_peak()
    first, last, _ = window(args.context, args.window, every)
    t0 = time.perf_counter()
    result = replay_window(model, tokens, first, last, snapshot=snapshot, repeats=args.repeats)
    replay_ms = (time.perf_counter() - t0) * 1e3
    peak_kb = _status_kb("VmHWM")
    assert result.status == "ok" and result.meta["source"] == ("snapshot" if snapshot else "prompt")
    print(json.dumps({
        "replay_ms": replay_ms, "prefill_ms": result.meta["prefill_ms"], "peak_rss_mb": peak_kb / 1024,
        "above_model_mb": (peak_kb - model_kb) / 1024, "loss0": float(result.loss[0, 0]),
    }))  # fmt: skip


def _figures(stdout: str) -> dict[str, float]:
    return json.loads(stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=2048, help="tokens in the request (>= 2048 for the figure)")
    p.add_argument("--window", type=int, default=8, help="replayed positions, just before the last token")
    p.add_argument(
        "--every",
        type=intervals,
        default=[256, 64],
        help="the recorder's snapshot intervals, one snapshot arm each (default 256,64)",
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads in each arm")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    add_json_option(p)
    args = p.parse_args()
    first, last, _ = window(args.context, args.window, max(args.every))
    if args.window < 1 or first < 1:
        print(f"error: a window of {args.window} does not fit a context of {args.context} tokens",
              file=sys.stderr)  # fmt: skip
        print("hint: use --window >= 1 and --context > --window + 2", file=sys.stderr)
        return 2
    if args.child == "prepare":
        prepare(args, Path(args.dir))
        return 0
    if args.child:
        child(args, args.child, Path(args.dir))
        return 0

    every_text = ",".join(map(str, args.every))
    shared = ["--context", str(args.context), "--window", str(args.window), "--every", every_text,
              "--repeats", str(args.repeats), "--threads", str(args.threads)]  # fmt: skip
    # the tree's llmobs first (as bench/runtime.py); OMP threads as torch's, so no idle spinners
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "agent"), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(args.threads)}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="replay-cost-") as tmp:
        me = [sys.executable, "-m", "bench.replay_cost", *shared, "--dir", tmp]
        subprocess.run([*me, "--child", "prepare"], check=True, cwd=REPO, env={**os.environ, **env},
                       capture_output=True)  # fmt: skip
        modes = [*(f"snapshot/{every}" for every in args.every), "prompt"]
        arms = [Command(mode, [*me, "--child", mode], env=env, cwd=REPO, figures=_figures, timeout=1800)
                for mode in modes]  # fmt: skip
        report = Report("replay_cost", args)
        starts = ", ".join(f"[0, {window(args.context, args.window, e)[2]})" for e in args.every)
        title = (f"replay of positions [{first}, {last}] x{args.repeats} of a {args.context}-token SmolLM2 "
                 f"context: snapshots {starts} vs the prompt (torch threads {args.threads})")  # fmt: skip
        made = report.compare(title, arms, rounds=args.rounds, baseline="prompt", metrics=FIGURES,
                              better={m: "lower" for m in FIGURES})  # fmt: skip
    seed_ms, seed_gb = SEED_MS[1] / SEED_MS[0], SEED_GB[1] / SEED_GB[0]
    full = {m: made.median("prompt", m) for m in FIGURES}
    for mode in modes[:-1]:
        ours = {m: made.median(mode, m) for m in FIGURES}
        ms, rss, above = ours["replay_ms"], ours["peak_rss_mb"], ours["above_model_mb"]
        report.note(f"{mode}: wall ours {ms:,.0f} vs {full['replay_ms']:,.0f} ms "
                    f"({full['replay_ms'] / ms:.2f}x faster; seed {SEED_MS[0]:.0f} vs {SEED_MS[1]:.0f} ms, "
                    f"{seed_ms:.2f}x); peak RSS {rss / 1024:.2f} vs {full['peak_rss_mb'] / 1024:.2f} GB "
                    f"({full['peak_rss_mb'] / rss:.2f}x less; seed {SEED_GB[0]} vs {SEED_GB[1]} GB, "
                    f"{seed_gb:.2f}x); above the loaded model {above:,.0f} vs "
                    f"{full['above_model_mb']:,.0f} MB")  # fmt: skip
    report.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
