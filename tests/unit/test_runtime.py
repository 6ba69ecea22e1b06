"""The runtime's contract, without a kernel: one Agent drains, routes by pid, hands every target's sinks
and pipeline its own events, detaches a target that exits with its last events, and runs the caller's
tasks in the same loop. The real kernel path of the same Agent is the bpf tier (attach, demo, run).
CompositeSink: a failing sink is counted by name and never keeps a batch from the others."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from llmobs.bpf.records import EVENT_DTYPE
from llmobs.dataflow import CompositeSink, Sink, SinkResult
from llmobs.runtime import Agent, Task


def events_of(*pids: int) -> np.ndarray:
    events = np.zeros(len(pids), dtype=EVENT_DTYPE)
    events["pid"] = pids
    return events


class Ring:
    """A shared ring: each drain returns the next queued batch. It holds 16 records, so that one pending
    is more than the share a wake may leave undrained (bpf/ringbuf.py DrainPacer)."""

    data_bytes = 16 * EVENT_DTYPE.itemsize

    def __init__(self, *batches: np.ndarray):
        self.batches = list(batches)
        self.records = 0

    def pending_bytes(self) -> int:
        return len(self.batches[0]) * EVENT_DTYPE.itemsize if self.batches else 0

    def drain(self) -> np.ndarray:
        batch = self.batches.pop(0) if self.batches else events_of()
        self.records += len(batch)
        return batch


class Session:
    """An attach session's surface the runtime uses; `own` batches stand for its own ring."""

    def __init__(self, pid: int, *own: np.ndarray, final_events: np.ndarray | None = None):
        self.pid = pid
        self.own = list(own)
        self.alive = True
        self.closed = False
        self.final_events = events_of() if final_events is None else final_events
        self.stats = SimpleNamespace(user_drops=0, first_event_after_s=None)
        self.ring_records = 10_000
        self.handed: list[np.ndarray] = []

    def poll(self, events: np.ndarray | None = None) -> np.ndarray:
        if events is None:
            events = self.own.pop(0) if self.own else events_of()
        self.handed.append(events)
        return events

    def target_alive(self) -> bool:
        return self.alive

    def close(self):
        self.closed = True
        return self.final_events, {"totals": {}, "counters": {}, "problems": []}


class Collect:
    name = "collect"

    def __init__(self):
        self.pids: list[int] = []
        self.closed = False

    def submit(self, batch) -> None:
        self.pids.extend(batch["pid"].tolist())

    def close(self, timeout: float) -> SinkResult:
        self.closed = True
        return SinkResult(self.name, accepted=len(self.pids))


class Broken:
    name = "broken"

    def submit(self, batch) -> None:
        raise OSError("disk full")

    def close(self, timeout: float) -> SinkResult:
        return SinkResult(self.name, dropped={"queue_full": 3})


def agent(**options) -> Agent:
    return Agent(nvml=False, **options)


def test_the_sinks_the_runtime_uses_fit_the_sink_interface():
    from llmobs.bpf.output import ParquetEventWriter
    from llmobs.bpf.report import StatusLine
    from llmobs.store.writer import StoreWriter

    for sink in (Collect, ParquetEventWriter, StatusLine, StoreWriter, CompositeSink):
        assert callable(sink.submit) and callable(sink.close) and isinstance(sink.name, str)
    assert isinstance(Collect(), Sink) and isinstance(CompositeSink(), Sink)


def test_a_failing_sink_is_counted_by_name_and_the_others_still_get_every_batch():
    good, fanout = Collect(), CompositeSink()
    fanout.add(Broken())
    fanout.add(good)
    fanout.submit(events_of(1, 2))
    fanout.submit(events_of(3))
    assert good.pids == [1, 2, 3]
    assert fanout.failures == {"broken": 3}  # rows, like every other drop count
    result = fanout.close(1.0)
    assert good.closed
    assert result.accepted == 3
    assert result.dropped == {"broken.queue_full": 3, "broken.submit_failed": 3}
    assert "disk full" in result.error and not result.ok


def test_a_shared_ring_is_drained_once_and_routed_by_pid():
    a, b = Session(10), Session(20)
    ring = Ring(events_of(10, 20, 10, 99), events_of(20))
    runtime = agent(ring=ring, ring_records=1000)
    sinks = {10: Collect(), 20: Collect()}
    for session in (a, b):
        runtime.add(session, sinks=[sinks[session.pid]], shared=True)
    assert runtime.poll() == 4
    assert runtime.poll() == 1
    assert sinks[10].pids == [10, 10] and sinks[20].pids == [20, 20]
    assert runtime.unrouted == 1  # pid 99 is no target: counted, not handed to anyone
    assert runtime.targets[10].events == 2 and runtime.targets[20].events == 2


def test_a_sparse_shared_ring_waits_only_once_every_target_has_seen_an_event():
    a, b = Session(10), Session(20)
    ring = Ring(events_of(10), events_of(10), events_of(20))
    ring.data_bytes = 1 << 20  # one pending event is far below the share a wake may leave undrained
    runtime = agent(ring=ring, ring_records=1000)
    for session in (a, b):
        runtime.add(session, shared=True)
    a.stats.first_event_after_s = 0.1  # a has seen its first event, b (just found) has not
    assert runtime.poll() == 1  # drained: b's first event must not wait for a sparse drain
    assert runtime.poll() == 1
    b.stats.first_event_after_s = 0.2
    assert runtime.poll() == 0  # every target has seen one: the sparse ring waits (DEFER_MAX_S)
    assert len(ring.batches) == 1


def test_a_session_with_its_own_ring_is_drained_through_its_poll():
    session = Session(7, events_of(7, 7, 7))
    runtime = agent()
    sink = Collect()
    runtime.add(session, sinks=[sink])
    assert runtime.poll() == 3
    assert sink.pids == [7, 7, 7]
    assert runtime.period(3) == runtime.period(0)  # 3 of a 10,000-event ring is quiet: the long period


def test_an_exited_target_is_detached_with_its_last_events_and_the_others_go_on():
    gone, stays = Session(1, final_events=events_of(1, 1)), Session(2)
    detached = []
    runtime = agent(on_detach=detached.append)
    sink = Collect()
    runtime.add(gone, sinks=[sink])
    runtime.add(stays)
    runtime.poll()  # the first poll runs the slow tick: both alive
    gone.alive = False
    runtime._next_slow = 0.0  # the next second has come
    runtime.poll()
    assert [d.target.pid for d in detached] == [1] and detached[0].reason == "target exited"
    assert gone.closed and not stays.closed
    assert sink.pids == [1, 1] and sink.closed  # the session's final drain reached its sinks
    assert list(runtime.targets) == [2]
    runtime.close("done")
    assert stays.closed and [d.target.pid for d in detached] == [1, 2]
    assert runtime.close("again") == []  # idempotent


def test_a_removed_shared_target_gets_its_events_still_in_the_ring_and_the_others_theirs():
    a, b = Session(1), Session(2)
    ring = Ring(events_of(1, 2, 1))  # still in the ring when pid 1 is detached
    runtime = agent(ring=ring, ring_records=1000)
    sinks = {1: Collect(), 2: Collect()}
    runtime.add(a, sinks=[sinks[1]], shared=True)
    runtime.add(b, sinks=[sinks[2]], shared=True)
    gone = runtime.remove(1, "no longer selected")
    assert gone.events["pid"].tolist() == [1, 1]
    assert sinks[1].pids == [1, 1] and sinks[2].pids == [2]


def test_drops_of_a_targets_sinks_count_as_the_agents_own():
    session = Session(5)
    runtime = agent()
    runtime.add(session, sinks=[Broken()])
    gone = runtime.remove(5, "stopping")
    assert gone.final["counters"]["user_drops"] == 3 == session.stats.user_drops


def test_tasks_run_in_the_loop_at_their_period_until_stop():
    runtime = agent()
    session = Session(3)
    runtime.add(session)
    ticks: list[float] = []
    every_time: list[float] = []
    waits: list[float] = []

    def stop() -> bool:
        return len(every_time) >= 5

    runtime.run(stop, [Task(3600.0, ticks.append), Task(0.0, every_time.append)], wait=waits.append)
    assert len(ticks) == 1  # due at once, then not for an hour
    assert len(every_time) == 5
    assert len(session.handed) == 4 == len(waits)  # a drain and a wait per iteration, none after stop
    assert set(waits) <= {0.02, 0.05}


def test_a_governor_failure_is_logged_once_and_never_stops_the_loop():
    lines: list[str] = []
    runtime = agent(log=lines.append)

    def broken():
        raise RuntimeError("boom")

    assert runtime.guard("governor", broken) is None
    assert runtime.guard("governor", broken) is None
    assert lines == ["governor: RuntimeError: boom"]
    assert runtime.hook_errors == {"governor": "boom"}


@pytest.mark.parametrize(("budget", "said"), [(None, []), (0, ["governor: off"])])
def test_no_budget_runs_no_governor_and_zero_says_so(budget, said):
    lines: list[str] = []
    runtime = agent(budget=budget, log=lines.append)
    assert runtime.governor is None
    assert [line.split(" (")[0] for line in lines] == said


def test_nvml_samples_reach_each_targets_pipeline_once_a_second():
    from fake_nvml import FakeNvml
    from llmobs.gpu.nvml_source import NvmlSource

    class Pipeline:
        def __init__(self):
            self.gpu_rows: list = []
            self.live = SimpleNamespace(agent=None)

        def poll(self, events) -> None:
            pass

        def add_gpu_samples(self, rows) -> None:
            self.gpu_rows.append(rows)

    fake = FakeNvml()
    runtime = Agent(nvml=False)
    runtime.nvml = NvmlSource(load=lambda: fake, say=lambda line: None)
    gpu_process, cpu_process = Pipeline(), Pipeline()
    runtime.add(Session(100), gpu_process)  # fake_nvml: process 100 runs kernels on device 0
    runtime.add(Session(200), cpu_process)
    runtime.poll()
    assert cpu_process.gpu_rows == []
    assert len(gpu_process.gpu_rows) == 1
    rows = gpu_process.gpu_rows[0]
    assert set(np.asarray(rows["pid"]).tolist()) == {100}


def test_a_detached_target_keeps_the_governors_last_state_of_it_for_the_summary():
    # attach's detach summary prints the estimate and its mean; the governor forgets the target at
    # remove(), so the runtime reads the state first (it printed "0.00%" with no mean before)
    runtime = agent(budget=0.01)
    runtime.add(Session(5))
    tracked = runtime.governor.targets[5]
    tracked.estimate, tracked.estimate_sum, tracked.estimate_weight = 0.012, 0.03, 2.0
    detached = runtime.remove(5, "target exited")
    assert runtime.governor.target_state(5) is None  # forgotten by the governor...
    assert detached.governor_state["estimate"] == 0.012  # ...but kept for the summary
    assert detached.governor_state["mean_estimate"] == pytest.approx(0.015)
    import io

    from llmobs.commands.attach import _print_governor

    out = io.StringIO()
    _print_governor(runtime.governor, Session(5), detached.governor_state, out)
    assert "estimated slowdown at detach 1.20%, mean 1.50%" in out.getvalue()


def test_the_detach_summary_says_in_one_line_where_the_agent_degraded():
    import io

    from llmobs.commands.attach import _print_degrades

    out = io.StringIO()
    counts = {"correlate_stretched": 2, "map_reads_deferred": 1_500, "hand_offs_deferred": 7,
              "token_steps": 9}  # fmt: skip
    _print_degrades(counts, out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "correlate runs put off 2 time(s)" in lines[0]
    assert "map reads deferred 1,500 time(s)" in lines[0]
    assert "token steps held for the store 7 time(s)" in lines[0]
    quiet = io.StringIO()
    _print_degrades({"token_steps": 9}, quiet)
    assert quiet.getvalue() == ""
    store = io.StringIO()
    _print_degrades({"store_headroom_retries": 2, "store_cap_restores_deferred": 1}, store)
    assert store.getvalue().splitlines() == [
        "store: 2 statement(s) ran out of the DuckDB memory cap and were run again with more"
        " (store/sink.py HEADROOM_MEMORY_LIMIT); the cap was put back later 1 time(s) (memory still in use)"
    ]


def test_an_agent_without_a_store_never_loads_duckdb_or_pyarrow() -> None:
    """`attach` without --db: what it imports, the runtime and the stale-map sweep it runs on every
    attach; the sweep's store path (which imports the pipeline: ~40 MB and ~0.15 s on the way to the
    first event) is imported only where there is a store to ingest into."""
    code = (
        "import json, sys\n"
        "from llmobs.bpf import output, report, session\n"
        "from llmobs.runtime import Agent\n"
        "agent = Agent(budget=0)\n"
        "swept = agent.sweep_maps()\n"
        "agent.close()\n"
        "print(json.dumps(sorted({'duckdb', 'pyarrow', 'llmobs.pipeline'} & set(sys.modules))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
