"""The agent runtime: the one loop that drains the ring, feeds every target's pipeline, ticks the
governor and the self-telemetry, and detaches targets that exit.

Every command that attaches is this Agent: `attach` and `demo` give it one target whose AttachSession
owns its program and ring; `run` (the daemon) gives it the targets discovery finds, all sharing one
program whose ring the Agent drains once per tick and routes by pid (daemon/fleet.py builds them).
What a command adds on top — its status line, its progress, discovery and reload — it runs as periodic
tasks of `run()`, so there is one drain loop and one governor wiring for all of them.

Failure policy: the governor, the telemetry and the NVML source are bookkeeping: a failure in one is
logged once (by name) and never stops the data path. A pipeline that fails to close is reported in the
Detached it returns, and the other targets go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from llmobs.bpf.records import EVENT_DTYPE
from llmobs.bpf.ringbuf import DEFER_SHARE, DrainPacer
from llmobs.dataflow import CompositeSink, Sink
from llmobs.runtime import cpu_priority, startup_pages
from llmobs.stagecpu import STAGES

# The ring is submitted without wake-ups; the loop wakes every DRAIN_PERIOD_S[0] (20 ms) while events
# flow fast (a drain brought >= 1% of the ring), and while it is sparse as rarely as the ring allows:
# every (1 - DEFER_SHARE) x ring_records / MAX_EVENTS_PER_S seconds, the time the fastest probes take to
# fill the ring's free part (a wake leaves a ring holding less than DEFER_SHARE undrained, bpf/ringbuf.py
# DrainPacer: a burst that starts just after it cannot overflow the ring before the next), never more
# than DRAIN_PERIOD_S[1]. Each wake costs a fixed few hundred us (the map read, the detectors): at a
# slowly stepping target 20 wakes a second were ~8 ms of CPU a second (bench/step_cost). The default 16
# MiB ring (233,016 records) gives 94 ms. The loss-anomaly rows' latency does not grow with it: the map's
# steps are read at most every MAP_PERIOD_S (80 ms) anyway, on every sparse wake. The spike-to-row
# target (< 200 ms at p99, docs/diagnostics.md) is measured by bench/anomaly_latency.
DRAIN_PERIOD_S = (0.02, 0.1)
# The event rate the sparse period is sized for: the ingest target of issue 14 (the decoder's 2.4 M
# events/s on one core); the probes of a real workload stay far below it.
MAX_EVENTS_PER_S = 2_400_000
SLOW_TICK_S = 1.0  # target exits, the governor, the self-telemetry and NVML run once a second
CLOSE_TIMEOUT_S = 30.0

_NO_EVENTS = np.empty(0, dtype=EVENT_DTYPE)


def sparse_period(ring_records: int) -> float:
    """The wake period of a sparse ring of `ring_records` events: the time MAX_EVENTS_PER_S take to fill
    what a wake may leave free of it, within DRAIN_PERIOD_S (busy .. longest)."""
    busy, longest = DRAIN_PERIOD_S
    if ring_records <= 0:  # nothing to drain yet (a daemon with no target): the longest wait
        return longest
    return min(max(ring_records * (1 - DEFER_SHARE) / MAX_EVENTS_PER_S, busy), longest)


@dataclass
class Target:
    """One attached process: its probes (session), its store path (pipeline, None without a store) and
    any extra sinks of its raw events (attach --out's Parquet file, attach's status line)."""

    session: object  # llmobs.bpf.session.AttachSession
    pipeline: object | None = None  # llmobs.pipeline.Pipeline
    sinks: CompositeSink = field(default_factory=CompositeSink)
    shared: bool = False  # its events come from the Agent's shared ring, not its session's own
    key: object = None  # what the caller knows it by (the daemon: its discovery Proc)
    attached_at: float = field(default_factory=time.monotonic)
    events: int = 0  # sampled events routed to it

    @property
    def pid(self) -> int:
        return self.session.pid


@dataclass
class Detached:
    """What removing a target left: its last events, its final totals and the pipeline's summary."""

    target: Target
    events: np.ndarray
    final: dict
    summary: object | None  # llmobs.pipeline.PipelineSummary
    reason: str
    # the governor's last state of the target (estimate, mean, shed probes), taken before it forgot it
    governor_state: dict | None = None


@dataclass
class Swept:
    """What a sweep of maps left by exited processes did."""

    removed: int = 0  # maps removed
    steps: int = 0  # unread token steps stored from them first
    unselected: int = 0  # of the removed, maps of processes the selectors would not have observed

    def line(self) -> str:
        skipped = f" ({self.unselected} of processes not selected, removed unread)" if self.unselected else ""
        stored = f"{self.steps:,} unread token steps stored"
        return f"{self.removed} map(s) of exited processes removed, {stored}{skipped}"


@dataclass
class Task:
    """Work a command runs inside the loop every `period_s` (0: every iteration)."""

    period_s: float | Callable[[], float]
    run: Callable[[float], None]
    next_at: float = 0.0

    def due(self, now: float) -> bool:
        if now < self.next_at:
            return False
        period = self.period_s() if callable(self.period_s) else self.period_s
        self.next_at = now + period
        return True


class Agent:
    """One runtime for a set of targets. Drive it with `run(stop, tasks)`, or `poll()` yourself; end it
    with `close()`, which detaches every target with its final totals, finishes the exporter and
    closes the store when the Agent owns it."""

    def __init__(
        self,
        *,
        store=None,
        owns_store: bool = False,
        ring=None,
        ring_records: int = 0,
        exporter=None,
        budget: float | None = None,
        cost_scale: float | None = None,
        log: Callable[[str], None] = lambda _line: None,
        on_detach: Callable[[Detached], None] | None = None,
        presence=None,
        nvml: bool = True,
        cpu_priority: str = "normal",
    ):
        self.store = store
        self.owns_store = owns_store
        self.ring = ring  # a shared RingConsumer (the daemon's fleet), or None: each session drains its own
        self.ring_records = ring_records  # how many events the shared ring holds when full
        self._drains = DrainPacer()  # the shared ring's: a sparse one drained about once a second
        self.exporter = exporter
        self.log = log
        self.on_detach = on_detach
        # the marker that tells a workload exiting with unread steps to leave its map for us
        # (llmobs.shm.presence): announced by the command before its first attach, withdrawn at close
        self.presence = presence
        self.targets: dict[int, Target] = {}
        self.unrouted = 0  # shared-ring events of a pid that is no longer a target
        self.hook_errors: dict[str, str] = {}  # bookkeeping that failed, by name (status shows it)
        self.last_sample: dict | None = None  # the self-telemetry's last reading
        self.cost_scale = cost_scale
        # idle: the threads go under SCHED_IDLE when the loop starts (runtime/cpu_priority.py); the
        # commands pass their setting (default idle), a runtime built in-process (demo, tests) stays normal
        self.cpu_priority = cpu_priority
        self._idle_scheduled: tuple[int, int] | None = None  # the policy before the loop's start
        self._starvation_guard = None  # cpu_priority.StarvationGuard while idle-scheduled
        self._last_turn = time.monotonic()  # the loop's last turn, which the guard watches
        self.exporter_counters = None  # what the exporter's finish() reported at close
        self.store_error: str | None = None  # the store's close failure, if any
        self.governor = None
        self.telemetry = None
        self._next_slow = 0.0
        self._closed = False
        # Library pages only the start-up touched are handed back SETTLE_S after the runtime starts
        # (startup_pages), and again at the first slow tick after each reopen of the store
        # (DuckDBStore.recycle, counted once it is over), whose open code the loop never runs otherwise:
        # `bench.soak` saw the file-backed RSS rise 57 -> 66 MB at the first reopen and stay there. Not
        # after a later target's attach: that runs code the loop runs anyway, and releasing again would
        # just fault the loop's own pages back in.
        self.startup_pages_released = 0  # bytes advised, every release together
        self.startup_pages_releases = 0
        self._release_pages_at: float | None = time.monotonic() + startup_pages.SETTLE_S
        self._store_reopens_seen = self._store_reopens()
        self._start_overhead_hooks(budget)
        self.nvml = self._start_nvml() if nvml else None
        self.stage_cpu: dict | None = None  # the CPU account by stage while attached, taken at close
        STAGES.mark()  # the account starts with the runtime: attach's compile and start-up are not in it

    # ---- the governor, the self-telemetry and NVML: bookkeeping, never in the data path's way --------
    def _start_overhead_hooks(self, budget: float | None) -> None:
        """budget None: this command runs no governor (demo); 0: the user turned it off (said once)."""
        from llmobs.governor import SelfTelemetry

        self.governor = self.guard("governor", self._new_governor, budget) if budget else None
        if budget == 0:
            self.log("governor: off (overhead.budget = 0): no probe is ever shed")
        self.telemetry = self.guard("telemetry", SelfTelemetry, self.governor)
        if self.telemetry is not None and self.exporter is not None:
            self.telemetry.track_exporter(self.exporter)

    def _new_governor(self, budget: float):
        from llmobs.governor import Governor

        scale = {} if self.cost_scale is None else {"cost_scale": self.cost_scale}
        return Governor(budget, log=self.log, **scale)

    def set_budget(self, budget: float) -> None:
        """A new overhead budget: the governor re-budgeted, turned off (its shed probes re-attached) or
        on (tracking every current target)."""
        if self.governor is not None and budget > 0:
            self.guard("governor", self.governor.set_budget, budget)
            return
        if self.governor is not None:
            self.guard("governor", self.governor.release_all)
            self.governor = None
            self.log("governor: off (overhead.budget = 0): every shed probe re-attached")
        elif budget > 0:
            self.governor = self.guard("governor", self._new_governor, budget)
            for target in self.targets.values() if self.governor is not None else ():
                self.guard("governor", self.governor.track, target.session)
        if self.telemetry is not None:
            self.telemetry.governor = self.governor

    def set_cost_scale(self, cost_scale: float) -> None:
        self.cost_scale = cost_scale
        if self.governor is not None:
            self.governor.cost_scale = cost_scale

    def _start_nvml(self):
        """The NVML source (GPU utilisation and memory of each target, once a second). A host without a
        GPU says so in one line and the source stays quiet."""
        try:
            from llmobs.gpu.nvml_source import NvmlSource
        except ImportError as exc:
            self.hook_errors["nvml"] = f"not available in this build ({exc})"
            return None
        return self.guard("nvml", lambda: NvmlSource(say=self.log))  # it says each status line once

    def guard(self, name: str, call: Callable, *args):
        """Calls into bookkeeping; a failure is logged once per name and never stops the agent."""
        try:
            return call(*args)
        except Exception as exc:
            if name not in self.hook_errors:
                self.log(f"{name}: {type(exc).__name__}: {exc}")
            self.hook_errors[name] = str(exc)
            return None

    def use_ring(self, ring, ring_records: int) -> None:
        """A new shared ring (the daemon rebuilt its program on a reload); the targets were removed."""
        self.ring, self.ring_records = ring, ring_records

    def sweep_maps(self, accept_uid: Callable[[int], bool] | None = None) -> Swept:
        """Maps left in /dev/shm by processes that are gone. With a store and `accept_uid` (whose maps
        this agent would have observed: the daemon's selectors), their unread token steps are stored
        first (a process may exit before it was ever attached); then each map is removed. Never raises."""
        from llmobs.shm.reader import remove_stale_maps

        skip = set(self.targets)  # their own pipelines drain and remove their maps
        try:
            if self.store is None or accept_uid is None:
                return Swept(removed=len(remove_stale_maps(skip_pids=skip)))
            # imported here: it imports the pipeline (DuckDB, pyarrow: ~0.15 s and ~40 MB), which an
            # agent without a store (attach with no --db) never loads otherwise
            from llmobs.pipeline.leftovers import ingest_stale_maps

            left = ingest_stale_maps(self.store, skip_pids=skip, accept_uid=accept_uid)
        except OSError:  # no /dev/shm, or not ours to list: nothing to tidy
            return Swept()
        unselected = sum(1 for m in left if m.error and m.error.startswith("not selected"))
        return Swept(len(left), sum(m.steps for m in left), unselected)

    # ---- targets ----------------------------------------------------------------------------------
    def add(
        self, session, pipeline=None, *, sinks: Iterable[Sink] = (), shared: bool = False, key=None
    ) -> Target:
        """Takes a started session (and its pipeline) into the loop: governed, measured, drained."""
        target = Target(session, pipeline, CompositeSink(sinks), shared=shared, key=key)
        self.targets[target.pid] = target
        if self.governor is not None:
            self.guard("governor", self.governor.track, session)
        if self.telemetry is not None:
            self.guard("telemetry", self.telemetry.track_session, session)
            if pipeline is not None:
                self.guard("telemetry", self.telemetry.track_pipeline, pipeline)
        if self.nvml is not None and pipeline is not None:
            self.guard("nvml", self.nvml.track, target.pid)
        return target

    def remove(self, pid: int, reason: str) -> Detached:
        """Detaches pid's probes, hands its sinks and pipeline the last events and the exact final totals,
        commits and correlates its data. The other targets keep running."""
        target = self.targets.pop(pid)
        governor_state = None
        if self.governor is not None:  # its state read first: untrack forgets it (the detach summary)
            governor_state = self.guard("governor", self.governor.target_state, pid)
            self.guard("governor", self.governor.untrack, target.session)
        events, final = target.session.close()  # detach first: nothing of pid enters the ring after this
        if target.shared:  # the shared ring may still hold pid's last events, and the others'
            routed = self._route(self.ring.drain() if self.ring is not None else _NO_EVENTS, also=pid)
            for other_pid, other in self.targets.items():
                if other_pid in routed:
                    self._hand(other, routed[other_pid])
            events = routed.get(pid, _NO_EVENTS)
        target.events += len(events)
        if len(events):
            target.sinks.submit(events)
        sinks = target.sinks.close(CLOSE_TIMEOUT_S)
        user_drops = sum(sinks.dropped.values())
        if user_drops:  # events a sink of ours could not keep count as the agent's own drops
            target.session.stats.user_drops += user_drops
            final.setdefault("counters", {})["user_drops"] = target.session.stats.user_drops
        summary = None
        if target.pipeline is not None:
            try:
                summary = target.pipeline.close(events, final)
            except Exception as exc:  # one pipeline's failure must not take the others down
                final.setdefault("problems", []).append(f"pipeline close: {exc}")
        if self.telemetry is not None:
            self.guard("telemetry", self.telemetry.untrack_session, target.session, final)
            if target.pipeline is not None:
                self.guard("telemetry", self.telemetry.untrack_pipeline, target.pipeline)
        if self.nvml is not None:
            self.guard("nvml", self.nvml.untrack, pid)
        detached = Detached(target, events, final, summary, reason, governor_state)
        if self.on_detach is not None:
            self.on_detach(detached)
        return detached

    # ---- the loop ---------------------------------------------------------------------------------
    @property
    def busy_events(self) -> int:
        """A drain of 1% of the ring or more: events flow fast, drain again after the short period."""
        if self.ring is not None:
            return max(self.ring_records // 100, 1)
        records = [t.session.ring_records for t in self.targets.values()]
        return max(min(records) // 100, 1) if records else 1

    @property
    def ring_capacity(self) -> int:
        """Events the smallest ring drained here holds (0: no ring yet)."""
        if self.ring is not None:
            return self.ring_records
        return min((t.session.ring_records for t in self.targets.values()), default=0)

    def period(self, drained: int) -> float:
        """The wait before the next drain: short while events flow, else the sparse period."""
        if drained >= self.busy_events:
            return DRAIN_PERIOD_S[0]
        return sparse_period(self.ring_capacity)

    def poll(self) -> int:
        """Drains once: every target's events to its sinks and pipeline, its map's steps into the
        store; once a second the slow tick. Returns the number of events drained."""
        drained = 0
        routed: dict[int, np.ndarray] = {}
        began = STAGES.now()
        ring = self.ring
        if ring is not None and self._drains.due(ring, time.monotonic(), eager=self._awaiting_first_event()):
            events = self.ring.drain()
            drained += len(events)
            routed = self._route(events)
        for target in list(self.targets.values()):
            if target.shared:
                mine = target.session.poll(routed.get(target.pid, _NO_EVENTS))
            else:
                mine = target.session.poll()
                drained += len(mine)
            STAGES.charge("ring_drain", began)  # the session's poll: the ring, its harvest of totals
            self._hand(target, mine)
            began = STAGES.now()
        now = time.monotonic()
        if now >= self._next_slow:
            self._next_slow = now + SLOW_TICK_S
            self._slow_tick(now)
        return drained

    def _awaiting_first_event(self) -> bool:
        """A target of the shared ring has seen no event yet (a daemon's newly found one): its first
        event is not kept waiting for a sparse drain (the attach-to-first-event latency)."""
        return any(t.session.stats.first_event_after_s is None for t in self.targets.values())

    def _hand(self, target: Target, events: np.ndarray) -> None:
        target.events += len(events)
        if len(events):
            began = STAGES.now()
            target.sinks.submit(events)
            STAGES.charge("event_sinks", began)
        if target.pipeline is not None:
            target.pipeline.poll(events)

    def _route(self, events: np.ndarray, also: int | None = None) -> dict[int, np.ndarray]:
        if not len(events):
            return {}
        pids = events["pid"]
        routed = {}
        for pid in [*self.targets, *([also] if also is not None else [])]:
            mask = pids == pid
            if mask.any():
                routed[pid] = events[mask]
        self.unrouted += len(events) - sum(len(v) for v in routed.values())
        return routed

    def _slow_tick(self, now: float) -> None:
        for pid, target in list(self.targets.items()):
            if not target.session.target_alive():
                self.remove(pid, "target exited")
        began = STAGES.now()
        if self.governor is not None:
            self.guard("governor", self.governor.tick, now)
            began = STAGES.charge("governor", began)
        if self.telemetry is not None:
            self.last_sample = self.guard("telemetry", self.telemetry.sample)
        if self.last_sample is not None:
            self._publish_sample(self.last_sample)
        began = STAGES.charge("telemetry", began)
        if self.nvml is not None and any(t.pipeline is not None for t in self.targets.values()):
            self.guard("nvml", self._poll_nvml)  # samples go to a store: none without one
            STAGES.charge("nvml", began)
        reopens = self._store_reopens()
        if reopens != self._store_reopens_seen:
            self._store_reopens_seen = reopens
            if self._release_pages_at is None:
                self._release_pages_at = now
        if self._release_pages_at is not None and now >= self._release_pages_at:
            self._release_pages_at = None
            self.startup_pages_released += self.guard("startup pages", startup_pages.release) or 0
            self.startup_pages_releases += 1

    def _store_reopens(self) -> int:
        return getattr(self.store, "recycles", 0)  # a DuckDBStore's reopens; 0 without a store

    def _publish_sample(self, sample: dict) -> None:
        """The agent's own numbers to `top` (each target's snapshot) and to OTLP (llmobs.agent.*)."""
        from llmobs.governor.telemetry import agent_metrics, top_fields

        for pid, target in self.targets.items():
            if target.pipeline is None:
                continue
            state = self.guard("governor", self.governor.target_state, pid) if self.governor else None
            target.pipeline.live.agent = self.guard("telemetry", top_fields, sample, state)
        if self.exporter is not None:
            self.guard("telemetry", self.exporter.metrics.set_agent_metrics, agent_metrics(sample))

    def _poll_nvml(self) -> None:
        from llmobs.gpu.nvml_source import split_by_pid

        batch = self.nvml.poll()  # "no GPU" is a status line (said once by the source), not an error
        if batch is None:
            return
        for pid, rows in split_by_pid(batch).items():
            target = self.targets.get(pid)
            if target is not None and target.pipeline is not None:
                target.pipeline.add_gpu_samples(rows)

    def run(self, stop: Callable[[], object], tasks: Iterable[Task] = (), wait=time.sleep) -> None:
        """The loop: the due tasks, one drain, then a wait of the drain period, until `stop()` is truthy.
        `wait(seconds)` may return early (the daemon's signal pipe wakes it)."""
        tasks = list(tasks)
        self._apply_cpu_priority()
        while not stop():
            now = self._last_turn = time.monotonic()
            for task in tasks:
                if task.due(now):
                    task.run(now)
                    if stop():
                        return
            drained = self.poll()
            if stop():
                return
            wait(self.period(drained))

    def _apply_cpu_priority(self) -> None:
        """Once, when the loop starts: attached, its threads started (later ones inherit the policy)."""
        if self.cpu_priority == cpu_priority.NORMAL or self._idle_scheduled is not None or self._closed:
            return
        self._idle_scheduled = cpu_priority.started_with()
        self._last_turn = time.monotonic()
        failed = cpu_priority.apply(self.cpu_priority)
        self._starvation_guard = cpu_priority.StarvationGuard(
            self._idle_scheduled, lambda: self._last_turn, lambda: STAGES.count("cpu_starved")
        )
        self._starvation_guard.start()
        if failed:
            self.log(f"warning: cpu priority {self.cpu_priority} not set on every thread ({failed}); "
                     "the agent runs at the priority it was started with there")  # fmt: skip

    def close(self, reason: str = "agent stopping") -> list[Detached]:
        """Removes every target (final totals, commit, correlate), then finishes the exporter while the
        store is still open, then closes the store if it is ours. Idempotent."""
        if self._closed:
            return []
        self._closed = True
        if self._idle_scheduled is not None:  # the final harvest, commit, correlate: not on idle CPU
            self._starvation_guard.stop()
            failed = cpu_priority.restore(self._idle_scheduled)
            self._idle_scheduled = None
            if failed:
                self.log(f"warning: the agent's normal priority not restored on every thread ({failed})")
        self.stage_cpu = STAGES.snapshot()  # the steady state, before the detach's final work
        detached = [self.remove(pid, reason) for pid in list(self.targets)]
        if self.exporter is not None:
            self.exporter_counters = self.guard("otlp", self.exporter.finish)
        if self.nvml is not None:
            self.guard("nvml", self.nvml.close)
        if self.presence is not None:
            self.guard("presence", self.presence.close)
        if self.store is not None and self.owns_store:
            result = self.store.shutdown(CLOSE_TIMEOUT_S)
            if not result.ok:
                self.log(f"store close: {result.error}")
                self.store_error = result.error
        return detached

    def counters(self) -> dict[str, int]:
        return {
            "unrouted": self.unrouted,
            "targets": len(self.targets),
            "startup_pages_released": self.startup_pages_released,
            "startup_pages_releases": self.startup_pages_releases,
        }
