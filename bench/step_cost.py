"""Agent CPU per token step, total and by stage, before / after, interleaved (issue 14, [footprint]).

For each load, `attach --pid P --db X --overhead-budget 0` (default profile) runs on a target while the
target publishes token steps; after a warm-up, a window of --seconds is measured:
  - the agent's CPU: utime + stime from /proc/PID/stat at the window's ends (start-up, the bcc compile
    and the detach's final work are outside the window);
  - token steps: the `tokens` count of the agent's own `top` snapshot file (its LLMOBS_RUN_DIR is a
    temporary directory here) at the same two moments, so the steps are those the agent took in;
  - by stage (trees that have llmobs.stagecpu): the snapshot's agent.stage_cpu, diffed the same way.
Figures: agent CPU us per token step (and by stage), % of a core, steps/s taken in, the agent's RSS in the
window (bench/procstat.py RssSampler, every 0.1 s: max and median), the statements the store ran again
with its memory cap raised (the whole attach, from its summary at detach), and the drop counters at the
window's end by group (`drop_figures`: map lapped, map rejected, kernel, store queue full, store failed,
other sinks).

Loads: the synthetic publisher (bench/synthetic_publisher.py: the real map writer, --batch rows per
forward pass) at each --rates (default 1000, 5000, 20000 steps/s), the tiny model generating
(`python -m llmobs.workloads --model tiny --requests 0`, ~400-500 token steps/s), and a slow target
(the synthetic publisher at --slow-rate steps/s, batch 1): the agent's % of a core there.

Trees: --baseline (default /tmp/llmobs-main, a worktree of 6bfae97, made with `git worktree add` when
missing) and --candidate (this repository), each run with PYTHONPATH=<tree>/agent, so the agent and
the target import that tree's llmobs (as bench/runtime.py does). Rounds alternate ABBA (bench/harness).

    .venv/bin/python -m bench.step_cost [--rounds 2] [--seconds 8] [--only 1000,5000,20000,tiny,slow]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from llmobs import environment

from bench.harness import Arm, BenchError, Report, add_json_option
from bench.procstat import RssSampler, cpu_seconds
from bench.ready_child import ReadyChild
from bench.runtime import byte_compiled, ensure_baseline
from bench.synthetic_publisher import SyntheticPublisher

REPO = Path(__file__).resolve().parents[1]
BASELINE_COMMIT = "6bfae97"
DEFAULT_BASELINE = Path("/tmp/llmobs-main")
BETTER = {"us/step": "lower", "% core": "lower", "steps/s": "higher", "MB RSS max": "lower",
          "MB RSS median": "lower"}  # fmt: skip


# The agent's drop counters (Pipeline.drops, in its `top` snapshot) in the groups a reader acts on: the
# map's ring lapped (the agent fell behind the workload), steps the map rejected or its writer dropped,
# the kernel's ring and aggregate map, the store writer's queue full (the writer fell behind: a long
# commit) or its commits failed, and the other sinks (every other counter).
DROP_GROUPS = {
    "map lapped": ("map_lost",),
    "map rejected": ("map_corrupt", "map_writer_dropped"),
    "kernel": ("ring_drops", "agg_overflow"),
    "store queue full": ("store_dropped",),
    "store failed": ("store_failed",),
}


def drop_figures(drops: dict[str, int]) -> dict[str, int]:
    """The total (`agent: drops`) and each group's part of it."""
    figures = {"agent: drops": sum(drops.values())}
    grouped: set[str] = set()
    for name, counters in DROP_GROUPS.items():
        figures[f"drops: {name}"] = sum(drops.get(c, 0) for c in counters)
        grouped.update(counters)
    figures["drops: other sinks"] = sum(v for k, v in drops.items() if k not in grouped)
    return figures


def tree_env(tree: Path, run_dir: str) -> dict:
    path = os.pathsep.join([str(tree.resolve() / "agent"), str(REPO)])
    return {"PYTHONPATH": path, environment.LLMOBS_RUN_DIR: run_dir, "HF_HUB_OFFLINE": "1"}


class Attach:
    """`attach --pid P --db X --overhead-budget 0` of one tree; its stderr collected by a thread."""

    def __init__(self, pid: int, db: str, env: dict, extra: tuple[str, ...] = ()):
        argv = [sys.executable, "-m", "llmobs.cli", "attach", "--pid", str(pid), "--db", db,
                "--overhead-budget", "0", *extra]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env={**os.environ, **env}, cwd=REPO)  # fmt: skip
        self.err = b""
        fd = self.proc.stderr.fileno()
        deadline = time.monotonic() + 300
        while b"attached in" not in self.err:
            readable, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            chunk = os.read(fd, 65536) if readable else b""
            if not chunk:
                raise BenchError(f"attach printed no 'attached in': {self.err.decode()[-2000:]}")
            self.err += chunk
        self._reader = threading.Thread(target=self._collect, daemon=True)
        self._reader.start()

    def _collect(self) -> None:
        for chunk in iter(lambda: self.proc.stderr.read1(65536), b""):
            self.err += chunk

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=300)
        self._reader.join(30)
        if self.proc.returncode != 0:
            raise BenchError(f"attach exited {self.proc.returncode}: {self.err.decode()[-2000:]}")
        return self.err.decode()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def read_snapshot(run_dir: str, pid: int, newer_than_ns: int = 0, timeout: float = 10.0) -> dict:
    """The agent's `top` snapshot of pid, rewritten once a second: the first one newer than the given
    time (so the two ends of a window are two distinct readings)."""
    path = Path(run_dir) / f"attach.{pid}.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            if int(data["updated_ns"]) > newer_than_ns:
                return data
        time.sleep(0.05)  # the agent rewrites it once a second; this only waits for the next one
    raise BenchError(f"no fresh snapshot {path} within {timeout} s")


class Workload(ReadyChild):
    """The tiny model generating forever (python -m llmobs.workloads), ready and waiting for go()."""

    def __init__(self, env: dict):
        argv = [
            sys.executable,
            "-m",
            "llmobs.workloads",
            "--model",
            "tiny",
            "--requests",
            "0",
            "--threads",
            "1",
        ]
        super().__init__(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL)

    def stop(self) -> dict:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        return {}


def _headroom_retries(err: str) -> int:
    found = re.search(r"store: ([\d,]+) statement\(s\) ran out of the DuckDB memory cap", err)
    return int(found.group(1).replace(",", "")) if found else 0


def measure(tree: Path, load: str, opts: dict) -> dict:
    """One round: the target, attach on it, warm-up, the window; the figures of the window."""
    with tempfile.TemporaryDirectory(prefix="bench-step-cost-") as tmp:
        env = tree_env(tree, tmp)
        if load == "tiny":
            target = Workload(env)
        else:
            rate, batch = (opts["slow_rate"], 1) if load == "slow" else (float(load), opts["batch"])
            target = SyntheticPublisher(rate, batch=batch, env=env)
        with target:
            agent = Attach(target.pid, f"{tmp}/a.duckdb", env, tuple(opts.get("attach_args", ())))
            try:
                target.go()
                first = read_snapshot(tmp, target.pid, time.monotonic_ns() + int(opts["warmup"] * 1e9),
                                      timeout=opts["warmup"] + 30)  # fmt: skip
                cpu0, wall0 = cpu_seconds(agent.proc.pid), time.monotonic()
                with RssSampler(agent.proc.pid) as rss:
                    last = read_snapshot(tmp, target.pid, time.monotonic_ns() + int(opts["seconds"] * 1e9),
                                         timeout=opts["seconds"] + 30)  # fmt: skip
                cpu1, wall1 = cpu_seconds(agent.proc.pid), time.monotonic()
                err = agent.stop()
            finally:
                agent.kill()
            target.stop()
    steps = last["stats"]["tokens"] - first["stats"]["tokens"]
    cpu, wall = cpu1 - cpu0, wall1 - wall0
    figures = {
        "steps/s": steps / wall,
        "% core": 100 * cpu / wall,
        "us/step": cpu * 1e6 / steps if steps else 0,
        "MB RSS max": max(rss.samples) / 2**20,
        "MB RSS median": statistics.median(rss.samples) / 2**20,
        # statements run again with the store's cap raised, the whole attach (its summary line at detach)
        "store headroom retries": _headroom_retries(err),
    }
    before = (first.get("stats", {}).get("agent") or {}).get("stage_cpu")
    after = (last.get("stats", {}).get("agent") or {}).get("stage_cpu")
    if before and after and steps:
        for stage, seconds in after["stages"].items():
            spent = seconds - before["stages"].get(stage, 0.0)
            if stage != "other":
                figures[f"us/step {stage}"] = spent * 1e6 / steps
        figures.update(drop_figures(last.get("drops") or {}))
    if "Traceback" in err:
        raise BenchError(f"attach printed a traceback: {err[-2000:]}")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", type=Path, help=f"the tree before (default {DEFAULT_BASELINE})")
    parser.add_argument("--candidate", type=Path, default=REPO, help="the tree after (default: this one)")
    parser.add_argument("--no-baseline", action="store_true", help="measure the candidate alone")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0, help="the measured window per round")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds after go before the window")
    parser.add_argument("--rates", default="1000,5000,20000", help="synthetic publisher steps/s")
    parser.add_argument("--batch", type=int, default=16, help="synthetic publisher rows per forward pass")
    parser.add_argument("--slow-rate", type=float, default=20.0, help="the slow target's steps/s")
    parser.add_argument("--only", help="loads to run (default: the rates, tiny, slow)")
    parser.add_argument(
        "--attach-args", default="", help='more attach flags for both trees, e.g. "--detector both"'
    )
    add_json_option(parser)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("error: attach needs root (eBPF)\nhint: run as root", file=sys.stderr)
        return 4
    loads = (args.only or f"{args.rates},tiny,slow").split(",")
    trees = {"after": args.candidate}
    if not args.no_baseline:
        trees = {"before": ensure_baseline(args.baseline or DEFAULT_BASELINE, BASELINE_COMMIT), **trees}
    byte_compiled(*trees.values())
    opts = {"seconds": args.seconds, "warmup": args.warmup, "batch": args.batch, "slow_rate": args.slow_rate,
            "attach_args": args.attach_args.split()}  # fmt: skip
    report = Report("step_cost", args)
    report.note(" ".join(f"{name}: {tree}" for name, tree in trees.items())
                + f"; {args.rounds} interleaved round(s), {args.seconds:g} s windows")  # fmt: skip
    for load in loads:
        arms = [Arm(name, lambda _ctx, tree=tree, load=load: measure(tree, load, opts))
                for name, tree in trees.items()]  # fmt: skip
        named = {"tiny": "tiny workload", "slow": f"slow target ({args.slow_rate:g} steps/s)"}
        title = named[load] if load in named else f"synthetic {float(load):,.0f} steps/s, batch {args.batch}"
        report.compare(title, arms, args.rounds, baseline="before" if "before" in trees else None,
                       better=BETTER)  # fmt: skip
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
