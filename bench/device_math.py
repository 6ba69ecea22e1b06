"""The publisher's per-token metrics (publisher/device_math.py) of a previous tree against this one, in one
process, interleaved round by round (bench/harness.py: each ratio with its 95% interval).

  forward   SmolLM2-135M under llmobs.instrument, teacher-forced passes of 81 tokens (80 token steps):
            the pass's wall time and the publisher's hook CPU per pass (instrument(measure=True))
  serving   prepare() + device_block() of a pass of --rows rows (49,152-token vocabulary, greedy
            tokens), as the serving publisher runs them: time and page faults per call

The two versions are the module file of each tree loaded side by side; the arms swap which one the
publisher calls. Page faults are this process's minor faults (getrusage) over the round.

    .venv/bin/python -m bench.device_math [--baseline-commit 4b4eef1] [--threads 1] [--rounds 8]
        [--only forward,serving] [--rows 8,32] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import Arm, Report, add_json_option
from bench.runtime import REPO, selected_figures

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODULE = "agent/llmobs/publisher/device_math.py"
FIGURES = ("forward", "serving")
BETTER = {"hook ms/pass": "lower", "pass ms": "lower", "ms/call": "lower", "faults/call": "lower"}


def load_version(commit: str, folder: str):
    """device_math.py as it was at `commit`, imported under its own name."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{MODULE}"], capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
    path = Path(folder) / f"device_math_{commit}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"device_math_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def forward_arms(versions: dict, passes: int) -> list[Arm]:
    import time

    import llmobs
    from llmobs.publisher import device_math
    from llmobs.workloads.generate import forward_input, forward_once
    from llmobs.workloads.models import load_model

    model, tokenizer, model_id = load_model("smollm2", 0)
    ids = forward_input(tokenizer, 81)
    inst = llmobs.instrument(model, tokenizer, model_id=model_id, measure=True)
    for _ in range(2):
        forward_once(model, ids)

    own = device_math.device_block

    def arm(module):
        def run(ctx):
            device_math.device_block = module.device_block  # what the publisher's hook calls
            try:
                forward_once(model, ids)  # its first call after the swap is not measured
                cpu0, began = inst.cpu_ns, time.perf_counter()
                for _ in range(passes):
                    forward_once(model, ids)
            finally:
                device_math.device_block = own
            return {"pass ms": (time.perf_counter() - began) / passes * 1e3,
                    "hook ms/pass": (inst.cpu_ns - cpu0) / passes / 1e6}  # fmt: skip

        return run

    return [Arm(name, arm(module)) for name, module in versions.items()]


def serving_arms(versions: dict, rows: int, calls: int) -> list[Arm]:
    import time

    import torch

    torch.manual_seed(0)
    logits = torch.randn(rows, 49_152) * 3
    chosen = logits.argmax(-1)

    def arm(module):
        def run(ctx):
            module.device_block(module.prepare(logits), chosen, all_valid=True)
            faults0, began = faults(), time.perf_counter()
            for _ in range(calls):
                module.device_block(module.prepare(logits), chosen, all_valid=True)
            return {"ms/call": (time.perf_counter() - began) / calls * 1e3,
                    "faults/call": (faults() - faults0) / calls}  # fmt: skip

        return run

    return [Arm(name, arm(module)) for name, module in versions.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--baseline-commit", default="4b4eef1", help="the tree before (a commit of this repo)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--only", default=",".join(FIGURES), help="figures to measure")
    parser.add_argument("--passes", type=int, default=6, help="forward: passes per round")
    parser.add_argument("--rows", default="8,32", help="serving: rows per pass, comma-separated")
    parser.add_argument("--calls", type=int, default=20, help="serving: calls per round")
    add_json_option(parser)
    args = parser.parse_args(argv)
    only = selected_figures(parser, args.only, FIGURES)
    import torch

    torch.set_num_threads(args.threads)
    from llmobs.publisher import device_math

    report = Report("device_math", args)
    with tempfile.TemporaryDirectory(prefix="bench-device-math-") as folder:
        versions = {"before": load_version(args.baseline_commit, folder), "after": device_math}
        report.note(f"before: {MODULE} at {args.baseline_commit}; after: this tree; {args.threads} thread(s)")
        if "forward" in only:
            arms = forward_arms(versions, args.passes)
            report.compare("forward: a teacher-forced SmolLM2 pass (80 token steps)", arms, args.rounds,
                           baseline="before", better=BETTER, metrics=["hook ms/pass", "pass ms"])  # fmt: skip
        for rows in [int(r) for r in args.rows.split(",") if r] if "serving" in only else []:
            arms = serving_arms(versions, rows, args.calls)
            report.compare(f"serving: prepare + device_block, {rows} rows", arms, args.rounds,
                           baseline="before", better=BETTER, metrics=["ms/call", "faults/call"])  # fmt: skip
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
