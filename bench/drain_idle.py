"""The agent's CPU while its target is idle, by the sparse drain period (the runtime's DRAIN_PERIOD_S[1]).

A quiet ring is drained every DRAIN_PERIOD_S[1] seconds: a shorter period brings a loss spike's events
(and the anomaly row) sooner, and wakes the agent more often. This starts one idle instrumented workload
(scripts/workload.py --wait-stdin: loaded, its map published, generating nothing), then attaches
`llmobs-agent attach --profile cpu,host --overhead-budget 0` to it with each period in turn, interleaved over
--rounds (bench/harness.py), and prints the agent's own CPU (utime+stime from /proc, after "attached
in", over --seconds) side by side, with the ratio to the first period. CPU time is counted in ticks
of 10 ms: 0.1% of a core resolution over 10 s.

    .venv/bin/python -m bench.drain_idle [--periods 0.1,0.05] [--rounds 3] [--seconds 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time

from bench.harness import Arm, Report, add_json_option
from bench.held_workload import HeldWorkload
from bench.procstat import cpu_seconds

AGENT = (
    "import sys, llmobs.runtime.agent as runtime; from llmobs.cli import main; "
    "runtime.DRAIN_PERIOD_S = (runtime.DRAIN_PERIOD_S[0], float(sys.argv[1])); sys.exit(main(sys.argv[2:]))"
)


def wait_for_line(proc: subprocess.Popen, text: bytes, timeout: float = 60.0) -> None:
    buffer = b""
    deadline = time.monotonic() + timeout
    while text not in buffer:
        readable, _, _ = select.select([proc.stderr], [], [], max(deadline - time.monotonic(), 0))
        chunk = os.read(proc.stderr.fileno(), 65536) if readable else b""
        if not chunk:
            raise RuntimeError(f"the agent did not print {text!r}: {buffer.decode()[-2000:]}")
        buffer += chunk


def agent_cpu_percent(pid: int, period: float, seconds: float) -> float:
    args = ["attach", "--pid", str(pid), "--profile", "cpu,host", "--overhead-budget", "0"]
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(period), *args], stderr=subprocess.PIPE)
    try:
        wait_for_line(agent, b"attached in")
        began, cpu0 = time.monotonic(), cpu_seconds(agent.pid)
        time.sleep(seconds)  # a benchmark's measuring interval, not synchronisation
        used = cpu_seconds(agent.pid) - cpu0
        return 100.0 * used / (time.monotonic() - began)
    finally:
        agent.send_signal(signal.SIGINT)
        agent.communicate(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--periods", default="0.1,0.05", help="sparse drain periods to compare (s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="measuring interval per attach")
    add_json_option(parser)
    args = parser.parse_args()
    periods = [float(p) for p in args.periods.split(",")]
    report = Report("drain_idle", args)
    with HeldWorkload("--model", "tiny", "--threads", "1") as workload:
        report.note(f"idle workload pid {workload.pid}; agent: attach --profile cpu,host --overhead-budget 0")

        def period_arm(period: float) -> Arm:
            def once(ctx) -> dict[str, float]:
                return {"agent CPU %": agent_cpu_percent(workload.pid, period, args.seconds)}

            return Arm(f"{period * 1000:.0f} ms", once)

        arms = [period_arm(p) for p in periods]
        report.compare("the agent's CPU (% of a core) by sparse drain period", arms, args.rounds,
                       metrics=["agent CPU %"])  # fmt: skip
        workload.process.kill()  # it never generated: it waits for "go", not for "bye"
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
