"""`attach`'s CPU priority on a real target: by default, once attached, every thread of the agent runs
under SCHED_IDLE (only on CPU the workload leaves) and the workload's threads are untouched;
`--cpu-priority normal` leaves the agent as it was started."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from llmobs.runtime import cpu_priority
from test_attach import Agent

from bench.held_workload import HeldWorkload

SCHED_POLICY_FIELD = 40  # /proc/PID/task/TID/stat, after the command's ")": field 41 is the policy


def policies(pid: int, guard: bool = False) -> dict[int, int]:
    """Each thread's scheduling policy (os.SCHED_*), from /proc; without the starvation guard's thread
    (at the agent's start priority by design) unless `guard`."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as file:
                stat = file.read()
        except FileNotFoundError:  # the thread ended
            continue
        if not guard and stat[stat.index("(") + 1 : stat.rindex(")")] == cpu_priority.GUARD_THREAD_NAME:
            continue
        found[int(tid)] = int(stat[stat.rindex(")") + 2 :].split()[SCHED_POLICY_FIELD - 2])
    return found


def enter_together(*workloads: HeldWorkload) -> None:
    """Starts the workloads at once and waits until each is ready (each loads torch and its model: ~7 s
    here, which they spend side by side instead of one after the other). If one fails to start, those
    that did are ended and its error is raised."""
    threads = []
    errors: list[BaseException | None] = [None] * len(workloads)

    def enter(index: int) -> None:
        try:
            workloads[index].__enter__()
        except BaseException as exc:  # re-raised below, in the test's thread
            errors[index] = exc

    for index in range(len(workloads)):
        threads.append(threading.Thread(target=enter, args=(index,)))
        threads[-1].start()
    for thread in threads:
        thread.join()
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        for started, failed in zip(workloads, errors, strict=True):
            if failed is None:
                started.__exit__(type(error), error, None)
        raise error


def exit_together(*workloads: HeldWorkload) -> None:
    """Ends the workloads at once (each takes ~1 s to exit: torch's teardown); raises the first error."""
    errors: list[BaseException] = []

    def end(workload: HeldWorkload) -> None:
        try:
            workload.__exit__(None, None, None)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=end, args=(workload,)) for workload in workloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


class CaseWorkload(HeldWorkload):
    """HeldWorkload that, ended without having generated, is killed: its --hold waits for a line after
    "done", which a generation nobody started never prints."""

    generated = False

    def generate(self) -> None:
        super().generate()
        self.generated = True

    def __exit__(self, *exc) -> None:
        if not self.generated and self.process.poll() is None:
            self.process.kill()
        super().__exit__(*exc)


CASES = [((), os.SCHED_IDLE), (("--cpu-priority", "normal"), os.SCHED_OTHER)]


@pytest.fixture(scope="module")
def case_workloads():
    """One held workload per case, started at once (each loads torch and its model: ~7 s of a case's
    ~9 s), in CASES order; each case takes its own, and they all end with the module."""
    args = ("--model", "tiny", "--requests", "1", "--max-new-tokens", "2", "--threads", "1")
    workloads = [CaseWorkload(*args) for _ in CASES]
    enter_together(*workloads)
    try:
        yield workloads
    finally:
        exit_together(*workloads)


@pytest.mark.parametrize(("flags", "expected"), CASES)
def test_the_agent_runs_under_sched_idle_once_attached_unless_told_normal(
    case_workloads, flags, expected, tmp_path
):
    workload = case_workloads[CASES.index((flags, expected))]
    # the status line every 0.2 s (its default off a TTY is 10 s): its first says the loop has started.
    # With a store, so that the agent runs threads of its own beside the loop (the store writer, the
    # correlate thread, the anomaly lane); without one it runs the loop alone.
    store = ("--db", str(tmp_path / "priority.duckdb"))
    agent = Agent("--pid", str(workload.pid), "--status-interval", "0.2", *store, *flags)
    agent.wait_for("attached in")
    agent.wait_for(" events/s | ")  # the status line: the loop has started, the policy is set
    threads, with_guard = policies(agent.pid), policies(agent.pid, guard=True)
    workload_threads = policies(workload.pid)
    workload.generate()  # under the agent, as ever
    agent.proc.send_signal(signal.SIGINT)
    code, text = agent.finish()
    assert code == 0, text
    assert len(threads) > 1  # the store's threads beside the loop
    assert set(threads.values()) == {expected}, threads
    # idle: exactly one more thread, the starvation guard, at the start priority; normal: no guard
    guards = set(with_guard) - set(threads)
    assert len(guards) == (1 if expected == os.SCHED_IDLE else 0), with_guard
    assert all(with_guard[tid] == os.SCHED_OTHER for tid in guards), with_guard
    assert set(workload_threads.values()) == {os.SCHED_OTHER}, workload_threads


def test_apply_sets_every_thread_later_threads_inherit_and_restore_puts_back_the_start(tmp_path):
    # In a child process: SCHED_IDLE is not undone inside the test process.
    import subprocess
    import sys

    code = """
import os, threading
from llmobs.runtime import cpu_priority
started = threading.Event(); done = threading.Event()
before = threading.Thread(target=lambda: (started.set(), done.wait())); before.start(); started.wait()
assert cpu_priority.apply("normal") is None and cpu_priority.current() == "normal"
assert cpu_priority.apply("idle") is None
seen = {}
after = threading.Thread(target=lambda: seen.update(policy=cpu_priority.current()))
after.start(); after.join()
print(cpu_priority.current(), cpu_priority.current(before.native_id), seen["policy"])
done.set(); before.join()
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["idle", "idle", "idle"]
    restored = """
import os, threading
from llmobs.runtime import cpu_priority
started = threading.Event(); done = threading.Event()
other = threading.Thread(target=lambda: (started.set(), done.wait())); other.start(); started.wait()
os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # as a unit's CPUSchedulingPolicy=batch
previous = cpu_priority.started_with()
cpu_priority.apply("idle")
print(cpu_priority.current(other.native_id))
assert cpu_priority.restore(previous) is None
print(os.sched_getscheduler(0) == os.SCHED_BATCH, os.sched_getscheduler(other.native_id) == os.SCHED_BATCH)
done.set(); other.join()
"""
    result = subprocess.run([sys.executable, "-c", restored], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["idle", "True", "True"]
    with pytest.raises(ValueError, match="idle, normal"):
        cpu_priority.apply("realtime")


def test_the_runtime_is_idle_while_its_loop_runs_and_back_to_its_start_when_it_closes():
    # The detach's final harvest, commit and correlate must not wait for CPU a saturated host never
    # leaves (measured: an idle-scheduled detach not done 120 s after SIGINT under three busy loops).
    import subprocess
    import sys

    code = """
from llmobs.runtime import Agent, cpu_priority
agent = Agent(cpu_priority="idle", nvml=False)
seen = []
agent.run(lambda: seen.append(cpu_priority.current()) or True)
agent.close()
print(seen[0], cpu_priority.current())
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["idle", "normal"]


def test_a_starved_agent_gets_its_start_priority_back_and_goes_idle_again_once_fed():
    # The loop has not turned for max_starved_s: the guard puts every thread back at its start priority
    # (counted), keeps it while the catch-up turn runs (one turn started since the rescue, none after),
    # and makes it idle again once that turn has ended (the next one started). In a child process.
    import subprocess
    import sys

    code = """
import os, threading, time
from llmobs.runtime import cpu_priority
previous = cpu_priority.started_with()
cpu_priority.apply("idle")
turn = {"at": time.monotonic() - 60}  # starved since long ago
rescues = []
guard = cpu_priority.StarvationGuard(previous, lambda: turn["at"], lambda: rescues.append(1),
                                     max_starved_s=0.2, check_s=0.02, rescued_check_s=0.01)
guard.start()
deadline = time.monotonic() + 10.0
while cpu_priority.current() != "normal":
    assert time.monotonic() < deadline
    time.sleep(0.01)
print(len(rescues), cpu_priority.current(guard._thread.native_id))
turn["at"] = time.monotonic()  # the catch-up turn starts ...
held = time.monotonic() + 0.3  # ... and runs 30 of the guard's rescued checks: it stays at normal
while time.monotonic() < held:
    assert cpu_priority.current() == "normal"
    time.sleep(0.01)
turn["at"] = time.monotonic()  # ... and ends: the next turn starts
while cpu_priority.current() != "idle":
    assert time.monotonic() < deadline + 10.0
    time.sleep(0.01)
print(len(rescues), cpu_priority.current(guard._thread.native_id))
guard.stop()
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "normal", "1", "normal"]  # one rescue; the guard stays normal
