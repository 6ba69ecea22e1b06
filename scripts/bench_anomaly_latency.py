#!/usr/bin/env python3
"""Spike-to-row latency of the live loss-anomaly detectors, and the detectors' throughput.

Latency: a real workload (scripts/workload.py, tiny GPT-2 by default) generates with known loss spikes
(--spike-steps: at those token indices of every request the least likely token is chosen). The agent
side runs here, in process, like `attach --db`: the eBPF probes attached (unless --no-bpf), the ring
drained and the pipeline polled every --poll-ms, the store written by the pipeline. For each injected
spike the detectors flag, the latency is the commit time of its anomaly row minus the step's t_end_ns
(CLOCK_MONOTONIC, stamped by the workload at the end of that forward pass). It includes the
publisher's own lag: a generate() step is published when the next forward pass starts (only then is
the chosen token known). One run per poll period listed, so the periods compare in one invocation.

Throughput: StreamingDetector (both detectors) on synthetic token steps in batches of 1, 64 and 4096
steps (a generate() poll, a small batch, a training batch), in steps scored per second of CPU.

Run as root from the repository root:  .venv/bin/python scripts/bench_anomaly_latency.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "bpf"))

from held_workload import HeldWorkload, read_json_line  # noqa: E402
from llmobs.diagnostics.detectors import DetectorConfig, StreamingDetector  # noqa: E402
from llmobs.pipeline import Pipeline  # noqa: E402
from llmobs.store.sink import DuckDBStore  # noqa: E402


def run_once(args, poll_s: float, db: Path) -> dict:
    """One workload under the in-process agent; the injected spikes' latencies and what was flagged."""
    spikes = {int(s) for s in args.spike_steps.split(",")}
    workload_args = ("--model", args.model, "--requests", str(args.requests),
                     "--max-new-tokens", str(args.tokens), "--spike-steps", args.spike_steps,
                     "--threads", "1")  # fmt: skip
    with HeldWorkload(*workload_args) as workload:
        session = None
        if not args.no_bpf:
            from llmobs.bpf.session import AttachSession, Options

            session = AttachSession(workload.pid, Options())
            session.start()
        pipeline = Pipeline(DuckDBStore(db), workload.pid, session=session, snapshot=False, owns_store=True)
        try:
            workload._send(b"go\n")
            done = False
            while not done:
                events = session.poll() if session else None
                pipeline.poll(events)
                # the workload's "done" line ends the run; waiting on it is the drain period's sleep
                done = _ready(workload._ready_r, poll_s)
            events, final = session.close() if session else (None, None)
            summary = pipeline.close(events, final)
        except BaseException:
            if session:
                session.close()
            raise
        assert read_json_line(workload._ready_r)["phase"] == "done"
    rows = list(pipeline.anomalies.latencies)
    injected = args.requests * len(spikes)
    found = {}
    for detector in ("loss_ttest", "loss_mad"):
        hits = [r for r in rows if r[2] == detector and r[1] in spikes]
        others = [r for r in rows if r[2] == detector and r[1] not in spikes]
        found[detector] = {"hits": len(hits), "others": len(others), "ms": [r[3] / 1e6 for r in hits]}
    return {"poll_ms": poll_s * 1e3, "injected": injected, "found": found, "summary": summary}


def _ready(fd: int, timeout: float) -> bool:
    """True once the workload wrote its next status line ('done'), waiting at most `timeout`."""
    import select

    readable, _, _ = select.select([fd], [], [], timeout)
    return bool(readable)


def throughput(seconds: float = 1.0) -> list[tuple[int, float]]:
    """(batch size, token steps scored per CPU second) for the streaming detector."""
    rng = np.random.default_rng(0)
    out = []
    for batch in (1, 64, 4096):
        detector = StreamingDetector(DetectorConfig())
        steps, seq, began = 0, 0, time.process_time()
        while time.process_time() - began < seconds:
            n = batch
            steps_at = np.arange(seq, seq + n)
            columns = {
                "pid": np.full(n, 1), "step_seq": steps_at, "step": steps_at % 512,
                "batch_row": np.zeros(n, np.int32), "loss": rng.gamma(2.0, 1.0, n).astype(np.float32),
                "trace_id": [f"{(seq + i) // 512:032x}" for i in range(n)], "position": np.arange(n),
                "token_id": np.zeros(n, np.int64), "target_id": np.zeros(n, np.int64),
                "t_end_ns": np.zeros(n, np.int64),
            }  # fmt: skip
            detector.add(columns, 0)
            seq += n
            steps += n
        out.append((batch, steps / (time.process_time() - began)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=("tiny", "smollm2"))
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--tokens", type=int, default=48, help="tokens per request")
    p.add_argument("--spike-steps", default="16,32", help="token indices of the injected spikes")
    p.add_argument("--poll-ms", default="20,100", help="pipeline poll periods to run (attach uses 20-100)")
    p.add_argument("--no-bpf", action="store_true", help="map only: no eBPF probes attached")
    args = p.parse_args()
    if not args.no_bpf and os.geteuid() != 0:
        print("error: run as root (or pass --no-bpf)", file=sys.stderr)
        return 4
    print(f"workload: {args.model}, {args.requests} requests x {args.tokens} tokens, spikes at token "
          f"{args.spike_steps} of each; probes {'off' if args.no_bpf else 'cpu,host'}")  # fmt: skip
    print(
        f"{'poll':>6} {'detector':>10} {'caught':>9} {'other':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"
    )
    with tempfile.TemporaryDirectory(prefix="llmobs-bench-anom-") as tmp:
        for i, poll_ms in enumerate(int(x) for x in args.poll_ms.split(",")):
            result = run_once(args, poll_ms / 1e3, Path(tmp) / f"run{i}.duckdb")
            for detector, f in result["found"].items():
                ms = np.asarray(f["ms"]) if f["ms"] else np.asarray([np.nan])
                caught = f"{f['hits']:>4}/{result['injected']:<4}"
                p50, p99 = np.percentile(ms, 50), np.percentile(ms, 99)
                numbers = f"{p50:>8.1f} {p99:>8.1f} {ms.max():>8.1f}"
                print(f"{poll_ms:>4}ms {detector:>10} {caught} {f['others']:>6} {numbers}")
            print(f"       {result['summary'].anomalies}")
    print("detector throughput (both detectors, window 32), token steps per CPU second:")
    for batch, rate in throughput():
        print(f"  batches of {batch:>5} steps: {rate:>12,.0f} steps/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
