"""The agent's CPU scheduling policy: by default it runs only on CPU the workload leaves (SCHED_IDLE).

Why: on a host whose cores the workload fills (a CPU model's intra-op threads, one per core), every
wake-up of the agent took a core from one of those threads, and a parallel region waits for its
slowest thread: measured here (SmolLM2, 2 threads on 2 cores, 4 interleaved rounds), the workload made
0.942x its tokens/s under the default attach with the agent at normal priority and 0.976x with the
agent under SCHED_IDLE, for the same agent CPU. A SCHED_IDLE thread never preempts a normal one and
gets only what is left; where nothing is left (a saturated host) the agent falls behind for at most a
few seconds (StarvationGuard, below). `normal` keeps the process's policy as it was started (e.g.
systemd's CPUSchedulingPolicy).

Applied once the agent is attached and its threads started (Agent.run): attaching itself (the BPF
compile, the map's first read) is not slowed by the policy. Every thread of the process is set (the
store writer, correlate, OTLP, DuckDB's workers); threads started later inherit their creator's policy.
Lowering a policy needs no privilege.

And undone when the agent stops (Agent.close, `restore`): the detach's final harvest, commit and
correlate must not wait for CPU the workload never leaves. Measured: with the tiny workload and three
busy loops on this 2-core box, an idle-scheduled attach had not finished its detach 120 s after SIGINT.

Never starved for long (StarvationGuard): under that load the idle-scheduled loop ran about once in 40 s,
which would miss the daemon's systemd watchdog (30 s) and leave every anomaly row tens of seconds late.
A thread of the agent's, kept at its start priority and waking once a second, puts the agent back at
that priority when its loop has not turned for MAX_STARVED_S, and idle again once the loop has turned
for SETTLE_S without a gap: on a saturated host the agent then costs the workload what it needs to keep
up, as every agent did before, and no more. Each rescue is counted (`cpu_starved`, said at detach).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

IDLE = "idle"
NORMAL = "normal"
POLICIES = (IDLE, NORMAL)
# The loop turns every 20-100 ms (runtime/agent.py DRAIN_PERIOD_S); this long without a turn is starvation.
MAX_STARVED_S = 2.0
# Back to idle once the loop has turned this long without a gap (it has caught up).
SETTLE_S = 5.0
GUARD_THREAD_NAME = "llmobs-cpuguard"  # the one thread of the agent's never idle-scheduled


def apply(policy: str) -> str | None:
    """Sets `policy` on every thread of this process. Returns None, or why a thread could not be set
    (the agent goes on at the policy it had: this only ever lowers its own priority)."""
    if policy not in POLICIES:
        raise ValueError(f"cpu priority must be one of {', '.join(POLICIES)}, not {policy!r}")
    if policy == NORMAL:
        return None
    return _set_all(os.SCHED_IDLE)


def _set_all(policy: int, priority: int = 0, skip: int | None = None) -> str | None:
    failed = []
    for tid in _threads():
        if tid == skip:
            continue
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


class StarvationGuard:
    """While the agent is idle-scheduled: gives its threads back their start priority (`previous`)
    when `last_turn()` (the loop's monotonic time of its last turn) is older than MAX_STARVED_S, and
    idle again after SETTLE_S of turns without such a gap. `on_starved()` is called at each rescue."""

    def __init__(
        self,
        previous: tuple[int, int],
        last_turn: Callable[[], float],
        on_starved: Callable[[], None],
        *,
        max_starved_s: float = MAX_STARVED_S,
        settle_s: float = SETTLE_S,
        check_s: float = 1.0,
    ):
        self.previous = previous
        self.max_starved_s, self.settle_s, self.check_s = max_starved_s, settle_s, check_s
        self.last_turn = last_turn
        self.on_starved = on_starved
        self.rescues = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmobs-cpu-guard", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        # created by an idle thread, it inherited SCHED_IDLE: its own wake-ups must not starve
        os.sched_setscheduler(0, self.previous[0], os.sched_param(self.previous[1]))
        # its name in `top -H` and /proc (15 characters at most)
        comm_path = f"/proc/self/task/{threading.get_native_id()}/comm"
        with contextlib.suppress(OSError), open(comm_path, "w") as comm:
            comm.write(GUARD_THREAD_NAME)
        idle, fed_since = True, None
        while not self._stop.wait(self.check_s):
            now = time.monotonic()
            starved = now - self.last_turn() > self.max_starved_s
            if idle and starved:
                _set_all(*self.previous)
                idle, fed_since = False, None
                self.rescues += 1
                self.on_starved()
            elif not idle:
                fed_since = None if starved else (fed_since or now)
                if fed_since is not None and now - fed_since >= self.settle_s:
                    _set_all(os.SCHED_IDLE, skip=threading.get_native_id())
                    idle = True
