"""The agent's CPU scheduling policy: by default it runs only on CPU the workload leaves (SCHED_IDLE).

Why: on a host whose cores the workload fills (a CPU model's intra-op threads, one per core), every
wake-up of the agent took a core from one of those threads, and a parallel region waits for its
slowest thread: measured here (SmolLM2, 2 threads on 2 cores, 4 interleaved rounds), the workload made
0.942x its tokens/s under the default attach with the agent at normal priority and 0.976x with the
agent under SCHED_IDLE, for the same agent CPU. A SCHED_IDLE thread never preempts a normal one and
gets only what is left; where nothing is left (a saturated host) the agent falls behind, and what it
then loses is counted where it always is (kernel ring drops, the map's lost steps), never the
workload's time. `normal` keeps the process's policy as it was started (e.g. systemd's
CPUSchedulingPolicy).

Applied once the agent is attached and its threads started (Agent.run): attaching itself (the BPF
compile, the map's first read) is not slowed by the policy. Every thread of the process is set (the
store writer, correlate, OTLP, DuckDB's workers); threads started later inherit their creator's policy.
Lowering a policy needs no privilege.

And undone when the agent stops (Agent.close, `restore`): the detach's final harvest, commit and
correlate must not wait for CPU the workload never leaves. Measured: with the tiny workload and three
busy loops on this 2-core box, an idle-scheduled attach had not finished its detach 120 s after SIGINT.
"""

from __future__ import annotations

import os

IDLE = "idle"
NORMAL = "normal"
POLICIES = (IDLE, NORMAL)


def apply(policy: str) -> str | None:
    """Sets `policy` on every thread of this process. Returns None, or why a thread could not be set
    (the agent goes on at the policy it had: this only ever lowers its own priority)."""
    if policy not in POLICIES:
        raise ValueError(f"cpu priority must be one of {', '.join(POLICIES)}, not {policy!r}")
    if policy == NORMAL:
        return None
    return _set_all(os.SCHED_IDLE)


def _set_all(policy: int, priority: int = 0) -> str | None:
    failed = []
    for tid in _threads():
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(priority))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:
            failed.append(f"thread {tid}: {exc.strerror or exc}")
    return "; ".join(failed) or None


def started_with() -> tuple[int, int]:
    """The calling thread's (policy, priority) now: what `restore` puts back (a systemd unit's
    CPUSchedulingPolicy, or SCHED_OTHER)."""
    return os.sched_getscheduler(0), os.sched_getparam(0).sched_priority


def restore(previous: tuple[int, int]) -> str | None:
    """Puts every thread back under `previous` (started_with() before `apply`); None, or why a thread
    could not be set (leaving SCHED_IDLE is refused to an unprivileged process past RLIMIT_NICE)."""
    return _set_all(*previous)


def current(tid: int = 0) -> str:
    """The policy of thread `tid` (0: the calling one), as POLICIES names it (`normal` for any other)."""
    return IDLE if os.sched_getscheduler(tid) == os.SCHED_IDLE else NORMAL


def _threads() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread alone
        return [0]
