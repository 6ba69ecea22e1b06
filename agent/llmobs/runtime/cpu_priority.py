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
that priority when its loop has not turned for MAX_STARVED_S, and idle again as soon as the loop has
made one whole turn since (the catch-up turn: the ring, the map and the store's hand-off of the backlog),
watched every RESCUED_CHECK_S meanwhile. On a saturated host the agent then runs a catch-up turn at
normal priority every ~MAX_STARVED_S and the rest of its work idle. Each rescue is counted
(`cpu_starved`, said at detach).

Why one turn, not a settling period: until session 18 the agent stayed at normal priority until its loop
had turned SETTLE_S (5 s) without a gap. SmolLM2's teacher-forced passes at 2 threads fill both cores:
the idle agent (`attach --db`) was rescued twice in 13 s, each rescue holding normal priority for 6 s or
more, so it ran most of the time where its wake-ups preempt the intra-op threads (the 0.942x above).
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
# While rescued, the guard looks this often for the loop's catch-up turn to have ended.
RESCUED_CHECK_S = 0.05
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
    when `last_turn()` (the loop's monotonic time of the start of its last turn) is older than
    MAX_STARVED_S, and idle again once a turn that started after the rescue has ended (the next one has
    started). `on_starved()` is called at each rescue."""

    def __init__(
        self,
        previous: tuple[int, int],
        last_turn: Callable[[], float],
        on_starved: Callable[[], None],
        *,
        max_starved_s: float = MAX_STARVED_S,
        check_s: float = 1.0,
        rescued_check_s: float = RESCUED_CHECK_S,
    ):
        self.previous = previous
        self.max_starved_s, self.check_s, self.rescued_check_s = max_starved_s, check_s, rescued_check_s
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
        rescued_at = caught_up_turn = None  # None: idle-scheduled
        while not self._stop.wait(self.check_s if rescued_at is None else self.rescued_check_s):
            now, turn = time.monotonic(), self.last_turn()
            if rescued_at is None:
                if now - turn > self.max_starved_s:
                    _set_all(*self.previous)
                    rescued_at, caught_up_turn = now, None
                    self.rescues += 1
                    self.on_starved()
            elif caught_up_turn is None:
                if turn >= rescued_at:  # the catch-up turn has started
                    caught_up_turn = turn
            elif turn > caught_up_turn:  # ... and ended: the next one started
                _set_all(os.SCHED_IDLE, skip=threading.get_native_id())
                rescued_at = None
