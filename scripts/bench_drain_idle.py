"""The agent's CPU while its target is idle, by the sparse drain period (attach's DRAIN_PERIOD_S[1]).

A quiet ring is drained every DRAIN_PERIOD_S[1] seconds: a shorter period brings a loss spike's events
(and the anomaly row) sooner, and wakes the agent more often. This starts one idle instrumented workload
(scripts/workload.py --wait-stdin: loaded, its map published, generating nothing), then attaches
`llmobs-agent attach --profile cpu,host --budget 0` to it with each period in turn, interleaved over
--rounds, and prints the agent's own CPU (utime+stime from /proc, after "attached in", over --seconds) side
by side, with the ratio to the first period. CPU time is counted in ticks of 10 ms: 0.1% of a core
resolution over 10 s.

    .venv/bin/python scripts/bench_drain_idle.py [--periods 0.1,0.05] [--rounds 3] [--seconds 10]
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "bpf"))
from held_workload import HeldWorkload  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
AGENT = (
    "import sys, llmobs.commands.attach as attach; from llmobs.cli import main; "
    "attach.DRAIN_PERIOD_S = (attach.DRAIN_PERIOD_S[0], float(sys.argv[1])); sys.exit(main(sys.argv[2:]))"
)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as handle:
        fields = handle.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


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
    args = ["attach", "--pid", str(pid), "--profile", "cpu,host", "--budget", "0"]
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--periods", default="0.1,0.05", help="sparse drain periods to compare (s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="measuring interval per attach")
    args = parser.parse_args()
    periods = [float(p) for p in args.periods.split(",")]
    results: dict[float, list[float]] = {p: [] for p in periods}
    with HeldWorkload("--model", "tiny", "--threads", "1") as workload:
        print(f"idle workload pid {workload.pid}; agent: attach --profile cpu,host --budget 0", flush=True)
        for round_no in range(args.rounds):
            order = periods if round_no % 2 == 0 else periods[::-1]  # interleaved, order reversed
            for period in order:
                results[period].append(agent_cpu_percent(workload.pid, period, args.seconds))
            line = "  ".join(f"{p * 1000:.0f} ms {results[p][-1]:.2f}%" for p in periods)
            print(f"round {round_no + 1}: agent CPU (% of a core) {line}", flush=True)
        workload.process.kill()  # it never generated: it waits for "go", not for "bye"
    first = statistics.median(results[periods[0]])
    for period in periods:
        median = statistics.median(results[period])
        ratio = median / first if first else float("nan")
        print(f"sparse period {period * 1000:.0f} ms: median {median:.2f}% of a core  ({ratio:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
