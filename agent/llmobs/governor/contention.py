"""What the agent's own CPU costs a workload when the two compete for the cores.

The probes' hits are charged to the workload's CPU time; the agent's draining, decoding and storing
are not - they cost the workload only when it has to wait for a core the agent holds. The kernel says
how long each thread waited: /proc/PID/task/TID/schedstat, field 2 (run_delay, ns on a runqueue).
So per tick, with W the workload's busy cores, A the agent's (/proc/self/stat), H the whole host's
(/proc/stat, every CPU) and `wait` the workload's runqueue wait (cores' worth):

    others       = max(H - W - A, 0)           what else competes with the workload
    agent's part = wait * A / (A + others)     the wait shared out by who held the cores, at most A

On a host with spare cores `wait` is ~0 and the agent costs the workload nothing; on 2 shared cores
it can cost more than the probes. The governor adds this to its estimate in proportion to each
probe's hit rate (the agent's work is per event) and sheds accordingly.
"""

from __future__ import annotations

import os

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """utime + stime of this (the agent's) process, all threads."""
    with open("/proc/self/stat", "rb") as handle:
        fields = handle.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def host_busy_seconds() -> float:
    """Non-idle CPU seconds of the whole host since boot (/proc/stat, the `cpu` line: all but idle and
    iowait; guest time is already inside user)."""
    with open("/proc/stat", "rb") as handle:
        values = [int(v) for v in handle.readline().split()[1:]]
    busy = sum(values[:8]) - values[3] - values[4]  # user nice system idle iowait irq softirq steal
    return busy / _CLK_TCK


def run_delay_seconds(pid: int) -> float | None:
    """Seconds the threads of `pid` have waited on a runqueue (sum over /proc/PID/task/*/schedstat;
    threads that exited take their share with them, so read it as a rate over short windows)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as handle:
                total += int(handle.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def agent_share(wait: float, agent: float, host: float, workload: float) -> float:
    """The agent's part of the workload's runqueue wait (cores), see the module docstring."""
    if wait <= 0 or agent <= 0:
        return 0.0
    others = max(host - workload - agent, 0.0)
    return min(wait * agent / (agent + others), agent)


class Contention:
    """Reads the counters above once per governor tick; `sample(pid)` gives this pid's wait counter,
    `tick()` the agent's and the host's. Kept as a class so a test can hand the governor a fake."""

    def tick(self) -> tuple[float, float]:
        """(agent CPU seconds, host busy seconds), cumulative."""
        return own_cpu_seconds(), host_busy_seconds()

    def wait(self, pid: int) -> float | None:
        return run_delay_seconds(pid)
