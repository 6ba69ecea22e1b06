"""CPU per token step of the loss-anomaly detectors: calibrated (conformal; raw-loss and request-relative
score), ttest + mad (both), all three.

StreamingDetector, as the agent runs it, fed synthetic token steps (lognormal losses; requests of 512
generated tokens, trace ids as the map gives them) in batches of 1, 16, 64, 512 and 4,096 steps (a
slowly stepping generate() poll, a busy one, a server's batch, a training pass). Each arm scores for
--seconds of CPU; figures: steps per CPU second and microseconds of CPU per step. The agent's target is
20,000 token steps/s: a detector costing c us/step takes 20,000 x c us of CPU each second (2% of a core
at 1 us/step). The calibrated detector's references are warmed before the clock starts.

    .venv/bin/python -m bench.detector_cost [--seconds 1] [--rounds 3] [--json PATH]

Tables and ratios: bench/harness.py (arms interleaved, baseline: both).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from llmobs.diagnostics.detectors import DetectorConfig, StreamingDetector

from bench.harness import Arm, Report, add_json_option

BATCHES = (1, 16, 64, 512, 4096)
REQUEST_TOKENS = 512


def _columns(rng, seq: int, n: int) -> dict:
    at = np.arange(seq, seq + n)
    return {
        "pid": np.full(n, 1),
        "step_seq": at,
        "step": at % REQUEST_TOKENS,
        "batch_row": np.zeros(n, np.int32),
        "loss": rng.lognormal(0.5, 1.0, n).astype(np.float32),
        "trace_id": [f"{(seq + i) // REQUEST_TOKENS:032x}" for i in range(n)],
        "position": at % REQUEST_TOKENS + 16,
        "token_id": np.zeros(n, np.int64),
        "target_id": np.zeros(n, np.int64),
        "t_end_ns": np.zeros(n, np.int64),
    }


# selection[/calibrated_score[/aftermath]]: the default (calibrated, raw, aftermath 16) and without it
ARMS = ("both", "calibrated", "calibrated/raw/0", "calibrated/relative", "all")


def detector_arm(name: str, batch: int, seconds: float) -> Arm:
    rng = np.random.default_rng(0)
    selection, _, rest = name.partition("/")
    score, _, aftermath = rest.partition("/")

    def once(ctx) -> dict[str, float]:
        config = DetectorConfig(detector=selection, alarm_rate=1e-3, calibrated_score=score or "raw",
                                aftermath=int(aftermath or DetectorConfig.aftermath))  # fmt: skip
        detector = StreamingDetector(config)
        seq = 0
        while seq < 20_000:  # warm: every reference past its warm-up, as in a running agent
            detector.add(_columns(rng, seq, 1000), 0)
            seq += 1000
        batches = [_columns(rng, seq + k * batch, batch) for k in range(max(1, 20_000 // batch))]
        steps, began, k = 0, time.process_time(), 0
        with ctx.timed():
            while time.process_time() - began < seconds:
                columns = batches[k % len(batches)]
                detector.add(columns, 0)
                steps += batch
                k += 1
        cpu = time.process_time() - began
        return {"steps/CPU-s": steps / cpu, "us/step": cpu / steps * 1e6}

    return Arm(f"{name}, batches of {batch}", once)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=1.0, help="CPU seconds per arm and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    add_json_option(p)
    args = p.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        print("error: --batches must be positive integers, comma-separated", file=sys.stderr)
        print("hint: e.g. --batches 1,64,4096", file=sys.stderr)
        return 2
    report = Report("detector_cost", args)
    for batch in batches:
        arms = [detector_arm(name, batch, args.seconds) for name in ARMS]
        report.compare(f"detector CPU, batches of {batch} steps", arms, args.rounds, baseline=arms[0].name,
                       metrics=["steps/CPU-s", "us/step"], better={"us/step": "lower"})  # fmt: skip
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
