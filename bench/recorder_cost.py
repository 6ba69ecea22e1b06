"""What the flight recorder (llmobs.Recorder, llmobs.publisher.recorder) costs the workload, side by side
in one run.

    .venv/bin/python -m bench.recorder_cost [--model smollm2|tiny] [--prompt 300] [--tokens 32]
                                            [--every 256,16] [--rounds 4] [--window 8] [--json PATH]

1. Decode step: generate() of --tokens tokens after a --prompt-token prompt, instrument() alone vs
   instrument(recorder=Recorder(every=E)) for each E in --every, rounds interleaved. Per decode step:
   the wall time (from one pass's start to the next's, the prefill excluded), and the CPU time spent
   in llmobs' hooks (measure=True), whose difference is the recorder's per-step work (the token id's
   device copy, the step_seq, the cache-length check); that work is also timed directly, as is the KV
   snapshot: an E-position chunk is cloned once per E positions, so its cost per decode step is
   chunk / E (the median chunk of exactly E positions; the prompt's chunk is longer for E < 256). The
   target: recorder per step <= 1% of a decode step, for each E.
2. Live tokens/s while a replay runs: generate() alone vs generate() during a replay, at each
   Recorder.replay_share in --shares (1: unpaced; 0.5: the default), of a 2*window+1
   step window (from the nearest snapshot) of the previous round's request on the `llmobs-replay`
   thread (CMD_REPLAY through the real control block, acknowledged at the generate's first step).
   tokens/s counts only the live steps that ran while the replay was running (each step's start is
   stamped by a forward pre-hook on the live thread), so a replay that ends early does not dilute it.
torch runs one intra-op thread (both threads share the machine's cores as a server's would).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

from bench.harness import Arm, Report, add_json_option

RECORDER_EVERY = 256  # the live-during-replay part's interval (the seed's)


def intervals(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--every needs positive intervals, comma-separated: {text!r}")
    return values


def _prompt(tokenizer, n: int):
    import torch

    text = "The history of the city is long, and its people remember every street by a story. " * 64
    ids = tokenizer([text], return_tensors="pt")["input_ids"][:, :n]
    if ids.shape[1] < n:
        raise SystemExit(f"error: the prompt text has only {ids.shape[1]} tokens\nhint: use --prompt <= that")
    return ids.to(torch.long)


def _generate(model, ids, tokens: int) -> None:
    import torch

    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                       min_new_tokens=tokens, do_sample=False, pad_token_id=0)  # fmt: skip


def bench_decode(args, model, model_id, ids, report: Report) -> None:
    import llmobs
    from llmobs.publisher import recorder as flight

    chunk_ns: dict[int, list[int]] = {e: [] for e in args.every}  # CPU time of each KV snapshot (its
    original = flight.Recording._snapshot  # clone()s) on the live thread, by interval

    def timed_snapshot(self, cache, length):
        ends = [c[-1][0] if c else 0 for c in self.chunks]
        t0 = time.thread_time_ns()
        original(self, cache, length)
        spent = time.thread_time_ns() - t0
        every = self.recorder.options.every
        grown = [(c[-1][0] if c else 0) - e for c, e in zip(self.chunks, ends, strict=True)]
        # only chunks of exactly `every` positions: the decode-time ones (the prompt's may be longer)
        chunk_ns[every].append(spent if set(grown) <= {0, every} and any(grown) else -spent)

    def chunks_total() -> int:
        return sum(abs(ns) for v in chunk_ns.values() for ns in v)

    flight.Recording._snapshot = timed_snapshot
    # the recorder's per-step calls timed directly too (CPU, this thread): less noisy than a difference
    direct_ns, calls = dict.fromkeys(args.every, 0), dict.fromkeys(args.every, 0)
    originals = {name: getattr(flight.Recording, name) for name in ("token_step", "after_forward")}

    def timed(fn):
        def wrapped(self, *a):
            t0, chunks = time.thread_time_ns(), chunks_total()
            fn(self, *a)
            every = self.recorder.options.every
            direct_ns[every] += time.thread_time_ns() - t0 - (chunks_total() - chunks)
            calls[every] += fn is originals["token_step"]

        return wrapped

    for name, fn in originals.items():
        setattr(flight.Recording, name, timed(fn))
    steps = args.tokens
    starts: list[int] = []

    def stamp(module, args_):
        starts.append(time.perf_counter_ns())

    def arm(every: int | None):
        def run(ctx) -> dict[str, float]:
            rec = llmobs.Recorder(every=every) if every else None
            inst = llmobs.instrument(model, model_id=model_id, measure=True, recorder=rec)
            handle = model.register_forward_pre_hook(stamp)  # after llmobs' own: every pass's start
            starts.clear()
            chunks_before = chunks_total()
            try:
                _generate(model, ids, steps)
            finally:
                handle.remove()
                inst.remove()
            decode = [(b - a) / 1e6 for a, b in zip(starts[1:], starts[2:], strict=False)]  # prefill excluded
            hooks = inst.cpu_ns - (chunks_total() - chunks_before)  # the snapshot is counted on its own
            return {
                "ms per decode step": sum(decode) / len(decode),
                "hook CPU us per step": hooks / steps / 1e3,
            }

        return run

    arms = [Arm("instrument() alone", arm(None))]
    arms += [Arm(f"+ Recorder(every={e})", arm(e)) for e in args.every]
    title = (f"[decode step, model={args.model}, prompt {ids.shape[1]} tokens, {steps} steps/round, "
             f"rounds={args.rounds}]")  # fmt: skip
    made = report.compare(
        title, arms, args.rounds, warmup=1, metrics=["ms per decode step", "hook CPU us per step"]
    )
    flight.Recording._snapshot = original
    for name, fn in originals.items():
        setattr(flight.Recording, name, fn)
    step_ms = made.median(arms[0].name, "ms per decode step")
    for every, recorded in zip(args.every, arms[1:], strict=True):
        added_us = made.median(recorded.name, "hook CPU us per step") - made.median(
            arms[0].name, "hook CPU us per step"
        )
        chunks = sorted(ns for ns in chunk_ns[every] if ns >= 0)
        chunk_ms = (chunks[len(chunks) // 2] / 1e6) if chunks else float("nan")
        direct_us = direct_ns[every] / max(calls[every], 1) / 1e3
        amortised_us = chunk_ms * 1e3 / every
        per_step_us = direct_us + amortised_us
        share = per_step_us / (step_ms * 1e3) * 100
        tag = f"  every={every}:"
        report.note(
            f"{tag} recorder hook CPU per decode step {added_us:.1f} us (median difference of the "
            f"arms), {direct_us:.1f} us (its calls timed directly, {calls[every]} steps)"
        )
        report.note(f"{tag} KV snapshot chunk of {every} positions {chunk_ms:.2f} ms CPU (median of "
                    f"{len(chunks)}), {amortised_us:.1f} us per decode step amortised")  # fmt: skip
        report.note(f"{tag} recorder per decode step (direct + amortised chunk) {per_step_us:.1f} us "
                    f"= {share:.3f}% of a {step_ms:.2f} ms decode step (target <= 1%)")  # fmt: skip


def bench_live_during_replay(args, model, model_id, ids, report: Report) -> None:
    import llmobs
    from llmobs.publisher.replay import in_replay_thread
    from llmobs.shm import layout
    from llmobs.shm import writer as writer_module
    from llmobs.shm.control import ControlClient

    inst = llmobs.instrument(
        model, model_id=model_id, recorder=llmobs.Recorder(every=RECORDER_EVERY, repeats=2)
    )
    rec = inst.recorder
    stamps: list[tuple[int, bool]] = []

    def stamp(module, args_, kwargs):
        if not in_replay_thread():
            stamps.append((time.perf_counter_ns(), rec.busy))

    handle = model.register_forward_pre_hook(stamp, with_kwargs=True)
    client = ControlClient(os.getpid(), os.path.dirname(writer_module.get_writer().path))
    replay_ms: dict[float, list[float]] = {}
    _generate(model, ids, args.tokens)  # a recorded request to replay (and warm-up)

    def arm(share: float | None):
        with_replay = share is not None

        def run(ctx) -> dict[str, float] | None:
            stamps.clear()
            if with_replay:
                rec.options = dataclasses.replace(rec.options, replay_share=share)
                last = list(rec._recordings.values())[-1]
                target = int(last.step_seq[last.n - 1 - args.window])  # a window near its end
                seq = client.post(layout.CMD_REPLAY, layout.replay_arg(target, 0, args.window))
            _generate(model, ids, args.tokens)
            if with_replay:
                ack = client.ack()
                if ack["ack_seq"] != seq or ack["ack_status"] != layout.ACK_OK:
                    raise RuntimeError(f"CMD_REPLAY was not acknowledged OK: {ack}")
                rec.wait_idle(600)
                replay_ms.setdefault(share, []).append(_wall_ms(rec.last_result))
            chosen = [t for t, busy in stamps if busy] if with_replay else [t for t, _ in stamps]
            if len(chosen) < 3:
                return {"live tokens/s": float("nan"), "steps measured": len(chosen)}
            return {"live tokens/s": (len(chosen) - 1) / ((chosen[-1] - chosen[0]) / 1e9),
                    "steps measured": len(chosen)}  # fmt: skip

        return run

    arms = [Arm("generate() alone", arm(None))]
    arms += [Arm(f"generate() during a replay, share {share:g}", arm(share)) for share in args.shares]
    title = (f"[live decode during a replay, window +-{args.window} from a snapshot, repeats 2, "
             f"{args.tokens} tokens/round, rounds={args.rounds}]")  # fmt: skip
    report.compare(title, arms, args.rounds, metrics=["live tokens/s", "steps measured"],
                   better={"live tokens/s": "higher"})  # fmt: skip
    for share, walls in replay_ms.items():
        report.note(f"  replay wall at share {share:g} (median of {len(walls)}): "
                    f"{sorted(walls)[len(walls) // 2]:.0f} ms")  # fmt: skip
    handle.remove()
    client.close()
    inst.remove()


def _wall_ms(path: str | None) -> float:
    import json

    import numpy as np

    if path is None or not os.path.exists(path):
        return float("nan")
    with np.load(path) as z:
        meta = json.loads(str(z["meta"][()]))
    os.unlink(path)
    if meta.get("status") != "ok":
        raise RuntimeError(f"the replay failed: {meta.get('reason')}")
    return float(meta.get("wall_ms", float("nan")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    p.add_argument("--prompt", type=int, default=300, help="prompt tokens (> 256: one snapshot chunk)")
    p.add_argument("--tokens", type=int, default=32, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--window", type=int, default=8, help="replayed steps either side of the target")
    p.add_argument(
        "--shares",
        type=lambda text: [float(v) for v in text.split(",")],
        default=[1.0, 0.5],
        help="Recorder.replay_share of each replay arm (default 1,0.5)",
    )
    p.add_argument(
        "--every",
        type=intervals,
        default=[256, 16],
        help="snapshot intervals, one recorder arm each (default 256,16)",
    )
    add_json_option(p)
    args = p.parse_args()
    if args.tokens <= 2 * args.window + 1:
        p.error("--tokens must exceed 2 * --window + 1 (the replayed window lies inside one request)")
    import torch
    from llmobs.shm import writer as writer_module
    from llmobs.workloads.models import load_model

    torch.set_num_threads(1)
    writer_module.configure(shm_dir=tempfile.mkdtemp())
    model, tokenizer, model_id = load_model(args.model)
    ids = _prompt(tokenizer, args.prompt)
    report = Report("recorder_cost", args)
    report.note(
        f"torch threads 1, {os.cpu_count()} CPUs; every number below is from interleaved samples of this run"
    )
    bench_decode(args, model, model_id, ids, report)
    bench_live_during_replay(args, model, model_id, ids, report)
    report.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
