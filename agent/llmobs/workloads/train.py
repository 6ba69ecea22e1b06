"""Training workload: the tiny GPT-2 in a real training loop (AdamW, backward, step) under llmobs
training mode, with an optional injected loss spike (a corrupted batch at a known step).

    python -m llmobs.workloads.train [--steps 200] [--spike-step 60] [--batch 4] [--seq 32]
    (scripts/train_workload.py is the same program by path)

The data is learnable on purpose: every row is one of 8 fixed random sequences, so the loss falls from
~5.5 nats to well under 1 within a few dozen steps. The corrupted batch (--spike-step) replaces every
token by a random id: its loss jumps back to ~ln(256) or above, a spike the agent's training monitor
must catch (llmobs.diagnostics.training), and its dL/dE differs visibly in the heatmap.

Synchronisation without sleeps (like `python -m llmobs.workloads`):
  --ready-fd N      JSON lines on an inherited pipe: {"phase": "ready", "pid", "map"} once the map
                    exists, {"phase": "done", "steps", ...} after the last step
  --wait-stdin      after "ready", wait for one line on stdin before training
  --until-stdin     train until a line (or EOF) arrives on stdin instead of stopping after --steps
                    (an agent then has all the time it needs to ask for the gradient slices)
  --hold            after "done", stay alive until stdin has a line or EOF
The last line on stdout is a JSON summary: pid, steps, spike_step, spike_step_seq, losses (per step).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time

from llmobs.workloads.models import tiny_gpt2
from llmobs.workloads.sync import announce

PATTERNS = 8  # the corpus: this many fixed sequences, memorised within a few dozen steps


def batch_of(step: int, batch: int, seq: int, corrupt: bool, generator):
    """[batch, seq] token ids: rows drawn from the fixed corpus, or random ids when `corrupt`."""
    import torch

    if corrupt:
        return torch.randint(1, 256, (batch, seq), generator=generator)
    corpus = torch.randint(1, 256, (PATTERNS, seq), generator=torch.Generator().manual_seed(seq))
    return corpus[torch.randint(0, PATTERNS, (batch,), generator=generator)]


def stdin_has_line(timeout: float) -> bool:
    readable, _, _ = select.select([sys.stdin], [], [], timeout)
    return bool(readable)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--spike-step", type=int, default=-1, help="training step whose batch is corrupted")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ready-fd", type=int)
    p.add_argument("--wait-stdin", action="store_true")
    p.add_argument("--until-stdin", action="store_true")
    p.add_argument("--hold", action="store_true")
    p.add_argument("--no-llmobs", action="store_true", help="the same loop uninstrumented (benchmarks)")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = tiny_gpt2()
    model.train()
    map_path = ""
    if not args.no_llmobs:
        import llmobs
        from llmobs.shm.writer import get_writer

        llmobs.instrument(model, model_id="tiny-gpt2-train", training=True)
        map_path = get_writer().path
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(1)

    def report(line: dict) -> None:
        announce(line, ready_fd=args.ready_fd)

    report({"phase": "ready", "pid": os.getpid(), "map": map_path})
    if args.wait_stdin:
        sys.stdin.readline()
    losses, spike_seq = [], 0
    t0 = time.perf_counter()
    step = 0
    while True:
        if args.until_stdin:
            if stdin_has_line(0):
                break
        elif step >= args.steps:
            break
        ids = batch_of(step, args.batch, args.seq, step == args.spike_step, generator)
        out = model(ids, labels=ids)
        if step == args.spike_step and not args.no_llmobs:
            spike_seq = get_writer().step_seq
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        losses.append(round(float(out.loss.detach()), 4))
        step += 1
    seconds = time.perf_counter() - t0
    summary = {"phase": "done", "pid": os.getpid(), "steps": step, "spike_step": args.spike_step,
               "spike_step_seq": spike_seq, "seconds": round(seconds, 3), "map": map_path}  # fmt: skip
    report(summary)
    if args.hold:
        sys.stdin.readline()
    print(json.dumps({**summary, "losses": losses}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
