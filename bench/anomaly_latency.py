"""Spike-to-row latency of the live loss-anomaly detectors, and the detectors' throughput.

Latency: a real workload (scripts/workload.py, tiny GPT-2 by default) generates with known loss spikes
(--spike-steps: at those token indices of every request the least likely token is chosen). The agent
side runs here, in process, like `attach --db`: the eBPF probes attached (unless --no-bpf), the ring
drained and the pipeline polled every --poll-ms, the store written by the pipeline. For each injected
spike the detectors flag, the latency is the commit time of its anomaly row minus the step's t_end_ns
(CLOCK_MONOTONIC, stamped by the workload at the end of that forward pass). It includes the
publisher's own lag: a generate() step is published when the next forward pass starts (only then is
the chosen token known). One run per poll period listed, so the periods compare in one invocation.

--attach: `attach --db` in process instead (the runtime's own loop, llmobs.runtime.Agent: its drain
cadence, the governor at the default 1% budget, the store opened as attach opens it) on the workload at
full speed (--batch 4: ~500 tokens/s on an idle host); reports p50/p99/max over every injected spike
(requests x batch x spikes, >= 30 wanted), where the p99 went (before the detectors scored the step /
scored to committed: LiveAnomalies.lag_summary), the incidents stored and the workload's tokens/s.
--detector / --calibrated-score choose the detectors (attach's defaults otherwise); --spike-after N
keeps the first N requests clean (the calibrated detector learns its reference from the traffic).

Throughput: StreamingDetector (both detectors) on synthetic token steps in batches of 1, 64 and 4096
steps (a generate() poll, a small batch, a training batch), in steps scored per second of CPU.

Tables and ratios: bench/harness.py. Run as root from the repository root:

    .venv/bin/python -m bench.anomaly_latency [--poll-ms 20,100] [--requests 10] [--rounds 1] [--json PATH]
    .venv/bin/python -m bench.anomaly_latency --attach --batch 4 --requests 4 --tokens 96 \
        --spike-steps 24,48,72
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from llmobs.diagnostics.detectors import DetectorConfig, StreamingDetector
from llmobs.pipeline import Pipeline
from llmobs.store.sink import DuckDBStore

from bench.harness import Arm, Report, add_json_option
from bench.held_workload import HeldWorkload, read_json_line


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


def run_attached(args, db: Path) -> dict:
    """`attach --db` in process: the runtime's own loop (llmobs.runtime.Agent: its drain cadence, the
    governor at the default budget, the store opened as attach opens it) on a workload at full speed,
    stopped when the workload says it is done. The injected spikes' latencies, what was flagged, and
    the incidents stored."""
    from llmobs.bpf.session import AttachSession, Options
    from llmobs.runtime.agent import Agent
    from llmobs.store.sink import agent_store

    spikes = {int(s) for s in args.spike_steps.split(",")}
    workload_args = ("--model", args.model, "--requests", str(args.requests), "--batch", str(args.batch),
                     "--max-new-tokens", str(args.tokens), "--spike-steps", args.spike_steps,
                     "--spike-after", str(args.spike_after))  # fmt: skip
    # attach's detector defaults (config_of: as `attach --db` builds them), then the chosen selection
    from dataclasses import replace

    from llmobs.diagnostics.detectors import config_of

    config = replace(config_of({"detector.name": args.detector}), calibrated_score=args.calibrated_score)
    with HeldWorkload(*workload_args) as workload:
        session = AttachSession(workload.pid, Options(profiles=tuple(args.profiles.split(","))))
        session.start()
        store = agent_store(db)
        pipeline = Pipeline(store, workload.pid, session=session, snapshot=False, detector=config)
        agent = Agent(store=store, owns_store=True, budget=0.01)
        agent.add(session, pipeline)
        detached = []
        agent.on_detach = detached.append
        workload._send(b"go\n")
        try:
            agent.run(lambda: _ready(workload._ready_r, 0.0))
        finally:
            agent.close("bench done")
        done = read_json_line(workload._ready_r)
        assert done["phase"] == "done", done
    rows = list(pipeline.anomalies.latencies)
    injected = (args.requests - args.spike_after) * args.batch * len(spikes)
    found = {}
    for detector in (f"loss_{name}" for name in config.enabled):
        hits = [r for r in rows if r[2] == detector and r[1] in spikes]
        others = [r for r in rows if r[2] == detector and r[1] not in spikes]
        found[detector] = {"hits": len(hits), "others": len(others), "ms": [r[3] / 1e6 for r in hits]}
    with DuckDBStore(db, read_only=True) as stored:
        generated = stored.connection.execute(
            "SELECT count(*) / ((max(t_end_ns) - min(t_start_ns)) / 1e9) FROM token_steps"
        ).fetchall()[0][0]
        incidents = stored.connection.execute(
            "SELECT count(*), count(*) FILTER (WHERE first_step IN (SELECT unnest($spikes))) FROM incidents",
            {"spikes": sorted(spikes)},
        ).fetchall()[0]
    return {"injected": injected, "found": found, "summary": detached[0].summary if detached else None,
            "tokens_per_s": generated, "incidents": incidents,
            "lag": pipeline.anomalies.lag_summary()}  # fmt: skip


def _ready(fd: int, timeout: float) -> bool:
    """True once the workload wrote its next status line ('done'), waiting at most `timeout`."""
    import select

    readable, _, _ = select.select([fd], [], [], timeout)
    return bool(readable)


def detector_arm(batch: int, seconds: float) -> Arm:
    """StreamingDetector (both detectors, window 32) fed batches of `batch` synthetic token steps for
    `seconds` of CPU: token steps scored per CPU second."""
    rng = np.random.default_rng(0)

    def once(ctx) -> dict[str, float]:
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
        return {"steps/CPU-s": steps / (time.process_time() - began)}

    return Arm(f"batches of {batch}", once)


def poll_arm(args, poll_ms: int, tmp: Path, summaries: list[str]) -> Arm:
    def once(ctx) -> dict[str, float]:
        result = run_once(args, poll_ms / 1e3, tmp / f"run{poll_ms}-{ctx.index}.duckdb")
        summaries.append(f"{poll_ms} ms, round {ctx.index}: {result['summary'].anomalies}")
        figures = {}
        for detector, f in result["found"].items():
            ms = np.asarray(f["ms"]) if f["ms"] else np.asarray([np.nan])
            figures[f"{detector} caught of {result['injected']}"] = f["hits"]
            figures[f"{detector} other"] = f["others"]
            for label, value in (
                ("p50", np.percentile(ms, 50)),
                ("p99", np.percentile(ms, 99)),
                ("max", ms.max()),
            ):
                figures[f"{detector} {label} ms"] = value
        return figures

    return Arm(f"poll {poll_ms} ms", once)


def attach_arm(args, tmp: Path, summaries: list[str]) -> Arm:
    def once(ctx) -> dict[str, float]:
        result = run_attached(args, tmp / f"attach-{ctx.index}.duckdb")
        summary = result["summary"]
        summaries.append(f"attach, round {ctx.index}: {summary.anomalies if summary else 'no summary'}")
        summaries.append(f"attach, round {ctx.index}: {result['lag']}")
        figures = {"tokens/s": result["tokens_per_s"], "incidents": result["incidents"][0],
                   f"incidents at a spike of {result['injected']}": result["incidents"][1]}  # fmt: skip
        for detector, f in result["found"].items():
            ms = np.asarray(f["ms"]) if f["ms"] else np.asarray([np.nan])
            figures[f"{detector} caught of {result['injected']}"] = f["hits"]
            figures[f"{detector} other"] = f["others"]
            for label, value in (("p50", np.percentile(ms, 50)), ("p99", np.percentile(ms, 99)),
                                 ("max", ms.max())):  # fmt: skip
                figures[f"{detector} {label} ms"] = value
        return figures

    return Arm("attach --db", once)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=("tiny", "smollm2"))
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--tokens", type=int, default=48, help="tokens per request")
    p.add_argument("--spike-steps", default="16,32", help="token indices of the injected spikes")
    p.add_argument("--batch", type=int, default=1, help="prompts per request (--attach: 4 is ~500 tokens/s)")
    p.add_argument("--poll-ms", default="20,100", help="pipeline poll periods to run (attach uses 20-100)")
    p.add_argument("--attach", action="store_true",
                   help="run `attach --db` in process (the runtime's loop) instead of the poll "
                        "periods: spike-to-row p99 under load over requests x batch x spikes")  # fmt: skip
    p.add_argument(
        "--profiles",
        default="cpu,host",
        help="--attach: probe profiles (attach's default cpu,host; cpu,host,mem: a busier writer)",
    )
    p.add_argument("--rounds", type=int, default=1, help="interleaved runs of each poll period")
    p.add_argument("--no-bpf", action="store_true", help="map only: no eBPF probes attached")
    p.add_argument("--detector", default="both", choices=("calibrated", "ttest", "mad", "both", "all"),
                   help="--attach: the detectors (attach's --detector; default its default)")  # fmt: skip
    p.add_argument("--calibrated-score", default="raw", choices=("raw", "relative"),
                   help="--attach: what the calibrated detector ranks")  # fmt: skip
    p.add_argument("--spike-after", type=int, default=0,
                   help="--attach: the first N requests without spikes (the calibrated detector learns "
                        "the traffic: it needs clean traffic first)")  # fmt: skip
    add_json_option(p)
    args = p.parse_args()
    if not args.no_bpf and os.geteuid() != 0:
        print("error: run as root (or pass --no-bpf)\nhint: sudo .venv/bin/python -m bench.anomaly_latency",
              file=sys.stderr)  # fmt: skip
        return 4
    report = Report("anomaly_latency", args)
    report.note(f"workload: {args.model}, {args.requests} requests x {args.tokens} tokens, spikes at token "
                f"{args.spike_steps} of each; probes {'off' if args.no_bpf else args.profiles}")  # fmt: skip
    summaries: list[str] = []
    with tempfile.TemporaryDirectory(prefix="llmobs-bench-anom-") as tmp:
        if args.attach:
            spikes = (args.requests - args.spike_after) * args.batch * len(args.spike_steps.split(","))
            if spikes < 30:
                report.note(f"only {spikes} spikes injected: a p99 wants >= 30 (raise --requests)")
            report.compare("spike -> anomaly row latency under attach --db", [attach_arm(args, Path(tmp),
                           summaries)], args.rounds)  # fmt: skip
        else:
            arms = [poll_arm(args, int(x), Path(tmp), summaries) for x in args.poll_ms.split(",")]
            report.compare("spike -> anomaly row latency by poll period", arms, args.rounds)
    for line in summaries:
        report.note(line)
    arms = [detector_arm(batch, 1.0) for batch in (1, 64, 4096)]
    report.compare("detector throughput (both detectors, window 32)", arms, 1, metrics=["steps/CPU-s"])
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
