"""Benchmark of the overhead governor, the measured-vs-budget table: tokens/s and CPU per token of a real
workload with no agent, with the agent and its governor off, and with the governor at 0.5%, 1% and 3%,
interleaved round by round with the no-agent rounds; the measured slowdown (harness ratio to `none`,
with its 95% interval) beside the governor's own estimate and its learned cost scale.

Configurations (each round runs all of them, in turn, on the same workload process):

  none      no agent
  off       `attach --profile P --overhead-budget 0`       every probe stays attached, nothing estimated
  0.5% 1% 3%  `attach --profile P --overhead-budget F`     the governor sheds what the budget does not allow

In each agent round the agent attaches, a warm-up generation lets the governor see the hit rates (and
shed, and learn from its sheds), then the measured generation runs, then the agent is stopped (SIGINT)
and its summary parsed: the governor's estimate at detach covers the measured phase (window 5 s).

  slowdown (wall) = tokens/s(none) / tokens/s(config) - 1   what the user sees, the agent's CPU included
  slowdown (cpu)  = CPU per token(config) / CPU per token(none) - 1   the probes' cost in the workload

Run as root: `.venv/bin/python -m bench.governor [--model tiny|smollm2] [--rounds 3] [--profile all]
[--json PATH]` (about 4 minutes per model at 3 rounds here; docs/governor.md has a run).

`--attribute` takes the residual apart instead (what costs the workload CPU per token that the estimate
may not see), interleaved with `none` the same way:

  spin1 spin3   no agent; a SCHED_IDLE process beside the workload waking every 20 ms to spin 1% / 3%
                of a core (the agent's own CPU as it competes, without its probes or its reads)
  host0 cpu0    `attach --profile host|cpu --overhead-budget 0`: one profile, nothing shed
  all1          `attach --profile all --overhead-budget 0.01`: the governed default budget, every probe
  all1 before   the same with the agent of another tree (`--before TREE`, e.g. a worktree of the previous
                commit): a governor change measured beside the one before it, in the same rounds
with the agent's own CPU (% of a core) over the measured phase and, for the governed ones, the governor's
estimate at detach.
The machine is shared and noisy: read the ratios (bench/harness.py, with 95% intervals), not the
absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.footprint import tree_commit
from bench.harness import Arm, Report, add_json_option
from bench.procstat import cpu_seconds
from bench.runtime import tree_pythonpath

ROOT = Path(__file__).resolve().parents[1]
AGENT = [sys.executable, "-m", "llmobs.cli", "attach"]
REQUEST_TOKENS = 32
CONFIGS = {"none": None, "off": "0", "0.5%": "0.005", "1%": "0.01", "3%": "0.03"}  # budget fractions


# ---- the workload process (this module with --target) --------------------------------------------------
def run_target(model_name: str, threads: int) -> int:
    """An instrumented model answering `gen TOKENS` with `tokens_per_s cpu_ms_per_token` (requests of 32
    tokens; the CPU time is the process's, user + system, all threads: the traps are charged there)."""
    import llmobs
    import torch
    from llmobs.workloads import generate as workload  # PROMPTS, generate_once, load_model

    torch.set_num_threads(threads)
    model, tokenizer, model_id = workload.load_model(model_name)
    llmobs.instrument(model, tokenizer, model_id=model_id)
    workload.generate_once(model, tokenizer, [workload.PROMPTS[0]], 4)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        tokens = int(line.split()[1])
        began, cpu_began, done, index = time.perf_counter(), time.process_time(), 0, 0
        while done < tokens:  # requests of REQUEST_TOKENS (the tiny model's context is short)
            step = min(REQUEST_TOKENS, tokens - done)
            with llmobs.context(tenant="bench", session=f"bench-{index}"):
                workload.generate_once(
                    model, tokenizer, [workload.PROMPTS[index % len(workload.PROMPTS)]], step
                )
            done, index = done + step, index + 1
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu_began  # cpu: all threads, user+sys
        print(tokens / wall, cpu / tokens * 1000, flush=True)
    return 0


class Target:
    def __init__(self, model: str, threads: int):
        command = [
            sys.executable,
            "-m",
            "bench.governor",
            "--target",
            "--model",
            model,
            "--threads",
            str(threads),
        ]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        self.pid = self.proc.pid
        assert self._line(600) == "ready"

    def _line(self, timeout: float) -> str:
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not readable:
            raise TimeoutError("the workload did not answer")
        return self.proc.stdout.readline().strip()

    def generate(self, tokens: int) -> tuple[float, float]:
        self.proc.stdin.write(f"gen {tokens}\n")
        self.proc.stdin.flush()
        rate, cpu_ms = self._line(600).split()
        return float(rate), float(cpu_ms)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def tree_env(tree: Path | None) -> dict[str, str] | None:
    """The environment that makes a child import `tree`'s llmobs (None: this tree's, the venv's)."""
    return None if tree is None else {**os.environ, "PYTHONPATH": tree_pythonpath(tree)}


def check_tree(tree: Path) -> None:
    """SystemExit unless a child with tree_env(tree) imports that tree's llmobs."""
    done = subprocess.run([sys.executable, "-c", "import llmobs; print(llmobs.__file__)"],
                          env=tree_env(tree), capture_output=True, text=True)  # fmt: skip
    if not done.stdout.strip().startswith(str(tree.resolve() / "agent")):
        imported = done.stdout.strip() or done.stderr.strip()
        raise SystemExit(
            f"error: --before {tree}: a child imports {imported}, not {tree}/agent\n"
            "hint: give a checkout of this repository (git worktree add)"
        )


class Agent:
    """`llmobs-agent attach` on the target; stderr read line by line with bounded waits."""

    def __init__(self, pid: int, profile: str, budget: str, tree: Path | None = None):
        args = [*AGENT, "--pid", str(pid), "--profile", profile, "--overhead-budget", budget]
        self.proc = subprocess.Popen(
            args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=tree_env(tree)
        )
        self.text = ""

    def wait_for(self, needle: str, timeout: float = 120.0) -> None:
        fd = self.proc.stderr.fileno()
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            readable, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            chunk = os.read(fd, 65536) if readable else b""
            if not chunk:
                raise RuntimeError(f"agent: no {needle!r}:\n{self.text}")
            self.text += chunk.decode()

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=120)
        self.text += err.decode()
        if self.proc.returncode != 0:
            raise RuntimeError(f"agent exited {self.proc.returncode}:\n{self.text}")
        return self.text


def _percent(pattern: str, text: str) -> float | None:
    match = re.search(pattern, text)
    return float(match.group(1)) / 100 if match else None


def one_round(target: Target, config: str, profile: str, warm: int, tokens: int) -> dict:
    agent = None
    if CONFIGS[config] is not None:
        agent = Agent(target.pid, profile, CONFIGS[config])
        agent.wait_for("attached in")
    target.generate(warm)  # the governor sees the rates and sheds here
    rate, cpu_ms = target.generate(tokens)
    result = {"tokens_per_s": rate, "cpu_ms_per_token": cpu_ms}
    if agent is not None:
        result.update(governor_summary(agent.stop()))
    return result


def governor_summary(text: str) -> dict:
    """From an agent's stderr: the governor's estimate at detach, what it shed, its learned scale."""
    # at detach: the last 5 s window, i.e. the measured phase after the sheds (the run's mean, which
    # included the minutes before the first shed, read 6% at a 1% budget whose window read 0.2%)
    result: dict = {"estimate": _percent(r"estimated slowdown at detach ([\d.]+)%, mean", text)}
    if result["estimate"] is None:  # the summary came after the target was untracked: no state there
        afters = re.findall(r"governor: pid \d+ \S+ \w+: estimated slowdown [\d.]+% -> ([\d.]+)%", text)
        result["estimate"] = float(afters[-1]) / 100 if afters else None
    result["shed"] = re.findall(r"\) shed(?:-last)? (\w+):", text)
    scales = re.findall(r"cost scale [\d.]+ -> ([\d.]+)", text)
    if scales:
        result["cost_scale"] = float(scales[-1])
    calibration = re.search(r"calibration \((\w+), (\d+) ms\)", text)
    if calibration:
        result["calibration_ms"] = int(calibration.group(2))
    return result


SPINNER = """
import os, sys, time
period, busy = float(sys.argv[1]), float(sys.argv[2])
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # as the agent runs (runtime/cpu_priority.py)
while True:
    time.sleep(period)
    end = time.thread_time() + busy  # CPU time: a fixed amount of work per wake, as the agent's
    while time.thread_time() < end:
        pass
"""
SPIN_PERIOD_S = 0.02
ATTRIBUTION = {"none": None, "spin1": 0.01, "spin3": 0.03, "host0": ("host", "0"), "cpu0": ("cpu", "0"),
               "all1": ("all", "0.01")}  # fmt: skip
BEFORE = "all1 before"  # all1 with the --before tree's agent


def attribution_round(target: Target, config: str, warm: int, tokens: int, before: Path | None) -> dict:
    """One round of an --attribute configuration: the workload's figures, and the agent's CPU over the
    measured phase (% of a core) and its governor's estimate at detach where an agent runs."""
    what, agent, spinner = ATTRIBUTION[config if config != BEFORE else "all1"], None, None
    if isinstance(what, float):
        busy = SPIN_PERIOD_S * what / (1 - what)
        spinner = subprocess.Popen([sys.executable, "-c", SPINNER, str(SPIN_PERIOD_S), str(busy)])
    elif what is not None:
        agent = Agent(target.pid, *what, tree=before if config == BEFORE else None)
        agent.wait_for("attached in")
    try:
        target.generate(warm)
        cpu_began, began = (cpu_seconds(agent.proc.pid) if agent else 0.0), time.perf_counter()
        rate, cpu_ms = target.generate(tokens)
        result = {"tokens_per_s": rate, "cpu_ms_per_token": cpu_ms}
        if agent is not None:
            spent = cpu_seconds(agent.proc.pid) - cpu_began
            result["agent_core_pct"] = spent / (time.perf_counter() - began) * 100
            summary = governor_summary(agent.stop())
            if what[1] != "0" and summary["estimate"] is not None:
                result["estimate_pct"] = summary["estimate"] * 100
        return result
    finally:
        if agent is not None and agent.proc.poll() is None:  # a round that failed: no agent left behind
            agent.proc.kill()
            agent.proc.wait()
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def measure_calibration(repeats: int, report: Report) -> None:
    """The class measurement alone (no handlers), in this process, `repeats` times."""
    from llmobs.bpf import calibrate

    def once(ctx) -> dict[str, float]:
        calibrate.reset_cache()
        took = calibrate.measure(None, []).took_s * 1000
        calibrate.wait_released()
        return {"ms": took}

    report.compare("calibration (classes only, in-process)", [Arm("calibrate.measure", once)], repeats,
                   metrics=["ms"])  # fmt: skip


def _slowdown(ratio: dict | None, invert: bool) -> str:
    """A harness ratio (arm / none) as a slowdown with its 95% interval: 'x.x% [lo, hi]'."""
    if ratio is None:
        return "-"

    def slow(r: float) -> float:
        return (1 / r if invert else r) - 1

    text = f"{slow(ratio['ratio']):+.1%}"
    if ratio.get("ci"):
        low, high = sorted(slow(r) for r in ratio["ci"])
        text += f" [{low:+.1%}, {high:+.1%}]"
    return text


def budget_table(made, shed: dict[str, set[str]]) -> list[str]:
    """The measured-vs-budget table: per configuration the measured slowdowns (wall: tokens/s; cpu: the
    workload's CPU per token; ratios to the interleaved `none` rounds, 95% intervals), the governor's
    estimate at detach (median), whether the CPU slowdown is within budget + 0.5 points, the learned
    cost scale and what any round shed."""
    lines = [
        "slowdown (wall) = tokens/s(none) / tokens/s - 1: what the user sees, the agent's CPU included",
        "slowdown (cpu)  = workload CPU per token / CPU per token(none) - 1: the probes' cost",
        f"{'config':<7} {'budget':>6} {'slowdown wall [95% CI]':>26} {'slowdown cpu [95% CI]':>26} "
        f"{'estimate':>8} {'ok':>3} {'scale':>5}  shed",
    ]
    for config, budget in CONFIGS.items():
        if budget is None:
            continue
        wall = made.ratio(config, "tokens_per_s")
        cpu = made.ratio(config, "cpu_ms_per_token")
        estimate = made.median(config, "estimate") if made.values(config, "estimate") else None
        scale = made.median(config, "cost_scale") if made.values(config, "cost_scale") else None
        within = "-"
        if float(budget) > 0 and cpu is not None:
            within = "yes" if cpu["ratio"] - 1 <= float(budget) + 0.005 else "no"
        lines.append(
            f"{config:<7} {float(budget):>6.1%} {_slowdown(wall, True):>26} {_slowdown(cpu, False):>26} "
            f"{f'{estimate:.2%}' if estimate is not None else '-':>8} {within:>3} "
            f"{f'{scale:.2f}' if scale is not None else '-':>5}  {','.join(sorted(shed[config])) or '-'}"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the workload (default 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", default="all", help="attach's --profile (default all: every probe)")
    parser.add_argument("--tokens", type=int, help="measured tokens per round (default: ~5 s of generation)")
    parser.add_argument(
        "--attribute", action="store_true", help="take the residual apart: spinners, one profile at a time"
    )
    parser.add_argument(
        "--before",
        type=Path,
        metavar="TREE",
        help="--attribute: also 'all1 before', the agent of TREE (a checkout of this repo)",
    )
    add_json_option(parser)
    args = parser.parse_args()
    if args.target:
        return run_target(args.model, args.threads)
    if os.geteuid() != 0:
        print("error: run as root (attach needs it)\nhint: sudo .venv/bin/python -m bench.governor",
              file=sys.stderr)  # fmt: skip
        return 4
    if args.before is not None:
        if not args.attribute:
            raise SystemExit("error: --before needs --attribute\nhint: add --attribute")
        check_tree(args.before)
    report = Report("governor", args)
    if not args.attribute:
        measure_calibration(5, report)

    target = Target(args.model, args.threads)
    shed: dict[str, set[str]] = {name: set() for name in CONFIGS}
    try:
        probe_rate, _ = target.generate(16)
        tokens = args.tokens or max(int(probe_rate * 5), 16)
        warm = max(int(probe_rate * 4), 8)  # >= 4 s: the governor's window must see the load and shed
        report.note(f"workload {args.model} ({args.threads} thread(s)), pid {target.pid}: {probe_rate:.1f} "
                    f"tokens/s unprobed; rounds of {warm} warm-up + {tokens} measured tokens; "
                    f"profile {args.profile}")  # fmt: skip

        if args.attribute:
            configs = [*ATTRIBUTION, *([BEFORE] if args.before else [])]
            if args.before:
                report.note(f"{BEFORE}: the agent of {args.before} ({tree_commit(args.before)})")
            arms = [Arm(c, lambda ctx, c=c: attribution_round(target, c, warm, tokens, args.before))
                    for c in configs]  # fmt: skip
            report.compare(
                "the residual taken apart: workload CPU per token, spinners and one profile at a time",
                arms, args.rounds, baseline="none",
                better={"tokens_per_s": "higher", "cpu_ms_per_token": "lower"},
                metrics=["tokens_per_s", "cpu_ms_per_token", "agent_core_pct", "estimate_pct"],
            )  # fmt: skip
            report.finish()
            return 0

        def config_arm(config: str) -> Arm:
            def once(ctx) -> dict[str, float]:
                result = one_round(target, config, args.profile, warm, tokens)
                shed[config].update(result.pop("shed", []))
                return {k: v for k, v in result.items() if v is not None}

            return Arm(config, once)

        made = report.compare(
            "tokens/s and workload CPU per token by agent configuration",
            [config_arm(c) for c in CONFIGS], args.rounds, baseline="none",
            better={"tokens_per_s": "higher", "cpu_ms_per_token": "lower"},
            metrics=["tokens_per_s", "cpu_ms_per_token", "estimate", "cost_scale", "calibration_ms"],
        )  # fmt: skip
    finally:
        target.close()
    for line in budget_table(made, shed):
        report.note(line)
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
