"""A synthetic token-step publisher: the real map writer (llmobs.shm.writer, the code path
`llmobs.request` and `instrument` use) driven at a chosen rate of token steps/s, with no model.

What it publishes looks like a serving process: `--batch` concurrent requests, one batch row each,
decoded together one forward pass at a time (one `begin_step` per pass, then one `publish_steps` per
tenant group of rows, the way the HF publisher publishes a batch: one call for the pass's rows). Each
request has its own random trace id, a tenant from a small pool, a session, and a length drawn from
[--min-steps, --max-steps]; when it ends its row starts a new request. Losses are normal
around 2 nats (sd 0.4), with a rare spike (--spike-rate) so the detectors have something to flag; entropy,
probabilities, ranks and token ids are plausible. Rows per call: at 20k steps/s a call per row would
cost the publisher itself ~8 us a record; batching rows per pass (default 16) is also what a serving
batch does.

Pacing: passes are due at `t0 + published / rate`; the loop sleeps until the next is due (a sleep only
to pace; nothing waits on another process). If it cannot keep up it publishes as fast as it can and
says so in its summary (achieved steps/s).

Synchronisation (as llmobs.workloads): `--ready-fd N` / `--ready-file PATH` get one JSON line
{"phase": "ready", "pid", "map"} once the map exists, then {"phase": "done", ...} at the end;
`--wait-stdin` waits for one line on stdin after "ready" before publishing. It stops after --seconds
or --steps (0: neither, run until SIGTERM/SIGINT or stdin EOF with --wait-stdin); the last stdout
line is a JSON summary (steps, passes, seconds, steps_per_s, cpu_s, map).

    .venv/bin/python -m bench.synthetic_publisher --rate 20000 --seconds 10 [--batch 16]

`SyntheticPublisher` starts it as a subprocess for a benchmark: `with SyntheticPublisher(rate=5000) as
pub: attach to pub.pid; pub.go(); ...; summary = pub.stop()`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.ready_child import ReadyChild

REPO = Path(__file__).resolve().parents[1]
TENANTS = ("acme", "globex", "initech", "umbrella")


class StepSource:
    """The requests of `batch` rows and the numbers each of their token steps carries."""

    def __init__(self, batch: int, min_steps: int, max_steps: int, spike_rate: float, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.batch = batch
        self.min_steps, self.max_steps = min_steps, max_steps
        self.spike_rate = spike_rate
        self.trace_hi = np.zeros(batch, np.uint64)
        self.trace_lo = np.zeros(batch, np.uint64)
        self.tenant = np.zeros(batch, np.int64)  # index into TENANTS
        self.session = np.zeros(batch, np.int64)
        self.step = np.zeros(batch, np.int64)  # the next step index of each row's request
        self.length = np.zeros(batch, np.int64)
        self.prompt = np.zeros(batch, np.int64)
        self.requests = 0
        for row in range(batch):
            self._new_request(row)

    def _new_request(self, row: int) -> None:
        words = self.rng.integers(1, 2**63, size=2, dtype=np.int64).astype(np.uint64)
        self.trace_hi[row], self.trace_lo[row] = words
        self.tenant[row] = self.requests % len(TENANTS)
        self.session[row] = self.rng.integers(0, 64)
        self.step[row] = 0
        self.length[row] = self.rng.integers(self.min_steps, self.max_steps + 1)
        self.prompt[row] = self.rng.integers(8, 512)
        self.requests += 1

    def block(self, n: int) -> np.ndarray:
        """The device block of n rows: float32 [n, 7] (loss, entropy, target_prob, top1_prob, then the
        int32 bits of rank, token id, target id), as device_math.device_block lays it out."""
        rng = self.rng
        loss = np.abs(rng.normal(2.0, 0.4, n)).astype(np.float32)  # the t-test's alpha flags ~1% of these
        spikes = rng.random(n) < self.spike_rate
        loss[spikes] += np.float32(6.0)
        block = np.empty((n, 7), np.float32)
        block[:, 0] = loss
        block[:, 1] = rng.gamma(5.0, 0.5, n)
        block[:, 2] = np.exp(-loss)
        block[:, 3] = np.maximum(block[:, 2], rng.uniform(0.2, 0.9, n).astype(np.float32))
        ints = block.view(np.int32)
        target = rng.integers(0, 50_000, n, dtype=np.int32)
        ints[:, 4] = np.where(spikes, rng.integers(100, 5000, n), rng.integers(0, 3, n))
        ints[:, 5] = target
        ints[:, 6] = target
        return block

    def advance(self) -> None:
        """Every row made one step; rows whose request is complete start a new one."""
        self.step += 1
        for row in np.flatnonzero(self.step >= self.length).tolist():
            self._new_request(row)


def publish(args, stop: threading.Event) -> dict:
    import torch
    from llmobs.shm import layout
    from llmobs.shm.writer import get_writer

    torch.set_num_threads(1)
    writer = get_writer()
    writer.set_model("synthetic-llm")
    source = StepSource(args.batch, args.min_steps, args.max_steps, args.spike_rate, args.seed)
    model_hash = writer.name(layout.NAME_MODEL, "synthetic-llm")
    tenant_hash = [writer.name(layout.NAME_TENANT, t) for t in TENANTS]
    session_hash = [writer.name(layout.NAME_SESSION, f"session-{i}") for i in range(64)]
    flags = layout.FLAG_HAS_TARGET | layout.FLAG_GENERATE
    yield_ready(args, writer.path)
    published = passes = 0
    rate = float(args.rate)
    began, cpu0 = time.monotonic(), time.process_time()
    deadline = began + args.seconds if args.seconds else None
    rows = np.arange(args.batch, dtype=np.int64)
    while not stop.is_set():
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            break
        if args.steps and published >= args.steps:
            break
        due = began + published / rate
        if now < due:
            time.sleep(min(due - now, 0.05))
            continue
        block = source.block(args.batch)
        t_start = time.monotonic_ns()
        seq = writer.begin_step(int(source.trace_hi[0]), int(source.trace_lo[0]), tenant_hash[0], 0)
        t_end = time.monotonic_ns()
        position = source.prompt + source.step
        for tenant in np.unique(source.tenant).tolist():  # one call per tenant group of rows
            mine = rows[source.tenant == tenant]
            writer.publish_steps(
                torch.from_numpy(block[mine]), step_seq=seq, t_start=t_start, t_end=t_end,
                trace_hi=source.trace_hi[mine], trace_lo=source.trace_lo[mine],
                tenant_hash=tenant_hash[tenant], session_hash=session_hash[int(source.session[mine[0]])],
                model_hash=model_hash, step=source.step[mine], position=position[mine], batch_row=mine,
                kv_len=position[mine], flags=flags,
            )  # fmt: skip
        writer.clear_context()
        source.advance()
        published += args.batch
        passes += 1
    seconds = time.monotonic() - began
    return {
        "pid": os.getpid(),
        "map": writer.path,
        "steps": published,
        "passes": passes,
        "requests": source.requests,
        "seconds": round(seconds, 3),
        "steps_per_s": round(published / max(seconds, 1e-9), 1),
        "target_steps_per_s": rate,
        "cpu_s": round(time.process_time() - cpu0, 3),
        "dropped": int(writer.steps_dropped),
    }


def yield_ready(args, map_path: str) -> None:
    from llmobs.workloads.sync import announce

    announce({"phase": "ready", "pid": os.getpid(), "map": map_path}, args.ready_file, args.ready_fd)
    if args.wait_stdin:
        sys.stdin.readline()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=1000.0, help="token steps per second (default 1000)")
    p.add_argument("--batch", type=int, default=16, help="rows (concurrent requests) per forward pass")
    p.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: no limit)")
    p.add_argument("--steps", type=int, default=0, help="stop after this many token steps (0: no limit)")
    p.add_argument("--min-steps", type=int, default=16, help="shortest request, token steps")
    p.add_argument("--max-steps", type=int, default=256, help="longest request, token steps")
    p.add_argument("--spike-rate", type=float, default=0.0005, help="fraction of steps with a loss spike")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-file", help="write a JSON line here when ready and when done")
    p.add_argument("--ready-fd", type=int, help="write the JSON lines to this inherited fd")
    p.add_argument("--wait-stdin", action="store_true", help="after ready, wait for a line on stdin")
    args = p.parse_args(argv)
    if args.rate <= 0 or args.batch < 1 or not 1 <= args.min_steps <= args.max_steps:
        print("error: --rate must be > 0, --batch >= 1 and 1 <= --min-steps <= --max-steps\n"
              "hint: see --help", file=sys.stderr)  # fmt: skip
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    summary = publish(args, stop)
    from llmobs.workloads.sync import announce

    announce({**summary, "phase": "done"}, args.ready_file, args.ready_fd)
    print(json.dumps(summary), flush=True)
    return 0


class SyntheticPublisher(ReadyChild):
    """This module as a subprocess (for benchmarks): started, ready (its map exists), waiting for go()."""

    def __init__(self, rate: float, *, batch: int = 16, seconds: float = 0.0, steps: int = 0,
                 env: dict | None = None, extra: tuple[str, ...] = ()):  # fmt: skip
        argv = [sys.executable, "-m", "bench.synthetic_publisher", "--rate", str(rate), "--batch", str(batch),
                "--seconds", str(seconds), "--steps", str(steps), *extra]  # fmt: skip
        super().__init__(argv, timeout=120, env=env or {}, cwd=REPO)

    def stop(self, timeout: float = 60.0) -> dict:
        """SIGTERM (if still publishing) and its JSON summary."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=timeout)
        return json.loads(out.decode().strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
