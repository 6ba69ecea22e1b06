"""Pipeline: one attached process's sources fanned out to queued sinks, correlated as data lands.

The runtime (llmobs.runtime.Agent) calls `poll(events)` every ~20 ms with the ring batch it drained;
the pipeline
adds the token steps its ShmSource reads, hands the exact totals the session harvested (once a second)
and fans everything out to its sinks through one CompositeSink (StoreWriter first, the journal; any
llmobs.dataflow.Sink may be added).
A background thread runs the incremental correlate every few seconds on its own DuckDB cursor, so the
drain loop never waits on the disk or on SQL. `close(events, final)` hands the last batches, stops the
correlator, commits everything, runs one last correlate over the session's steps, and returns what
went where.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from llmobs import clock
from llmobs.bpf.profiles import PROBES
from llmobs.dataflow import CompositeSink
from llmobs.diagnostics.detectors import DetectorConfig
from llmobs.diagnostics.live import LiveAnomalies
from llmobs.diagnostics.training import TrainingMonitor, artifacts_dir_for
from llmobs.pipeline.correlate import CorrelateStats, correlate
from llmobs.pipeline.live import LiveStats, remove_snapshot, snapshot_path, write_snapshot
from llmobs.pipeline.sources import AggregateSource, ShmSource, joined_columns
from llmobs.procfs import ProcFS
from llmobs.stagecpu import STAGES
from llmobs.store.ingest import EventDecoder
from llmobs.store.sink import DuckDBStore, agent_store
from llmobs.store.writer import MAX_HOLD_S, StoreWriter

CORRELATE_EVERY_S = 2.0
# A correlate run costs a fixed ~20-40 ms of SQL however few steps it rolls up: every 2 s that alone
# was 1-2% of a core at a slowly stepping target. The next run waits until the last one's CPU is at
# most this share of a core (so correlation runs less often when it is dear, never more than
# CORRELATE_MAX_S apart); each stretched interval is counted (`correlate_stretched`).
CORRELATE_CPU_SHARE = 0.004
CORRELATE_MAX_S = 15.0
# ... and that is while something waits for the rollups: an OTLP exporter (a step's span waits for its
# pass's rollup) or an anomaly flagged since the last run (its evidence comes from the rollups). While
# nothing does, a due run is put off (counted, `correlate_put_off`) until CORRELATE_UNAWAITED_S after the
# last one: at a 20 steps/s target the 15 s runs were ~0.4% of a core, a fifth of the agent's CPU there.
# A reader of the store (`query`, `explain`) sees rollups at most this old; the run at detach covers all.
CORRELATE_UNAWAITED_S = 60.0
# Only where runs are dear per step: once this many token steps wait for a run, it is not put off (at
# ~650 steps/s one run over a 60 s window cost more than the shorter runs it replaced: 6 -> 17 us a step).
PUT_OFF_MAX_STEPS = 2_000
# Events and exact totals of a step reach the store up to ~5 s after the step (the session harvests
# finished steps once a second; the writer commits within 1 s, or holds a small commit up to
# MAX_HOLD_S): an incremental correlate re-rolls the steps that started this long before its previous
# run, so late arrivals are counted.
LATE_NS = int((1.0 + MAX_HOLD_S + 1.0) * 1e9)
SLOW_PERIOD_S = 1.0  # aggregate deltas, the live snapshot and the process row are refreshed this often
# The map is read (and what it and the ring brought handed on: store, live stats, detectors, training)
# at most this often, not on every drain: each hand-off costs a fixed few hundred us (to_arrow, numpy
# setup of the detectors, the writer's wake-up), which at a slowly stepping target was the agent's
# whole cost. With the runtime's 50 ms drain it falls on every other drain, so a step waits <= 100 ms
# before it is scored (the < 200 ms spike-to-row target, docs/diagnostics.md), and the map's ring
# (32,768 steps by default) is read before it laps up to ~300k steps/s.
MAP_PERIOD_S = 0.08
# ... or as soon as the ring has brought this many events (a bounded hold: 64 B each, 8 MiB at most).
HOLD_EVENTS = 131_072
# What a read brings is scored at once (the detectors and the training monitor: the spike-to-row
# latency), but handed to the store and to `top`'s live stats with the ring's events only once a second
# (the slow tick, just before the snapshot that shows them), once HAND_STEPS steps are held, or at once
# when the detectors flag a token: each hand-off costs a fixed ~0.2 ms on this VM (the writer's queue,
# the step ring's copies), ~2 ms a second at a 20 steps/s target read ten times a second. A flagged
# token's held steps go to the writer before its anomaly row goes to the anomaly lane, as before (an
# automatic replay flushes the writer for that step). A busy target's reads each bring more than
# HAND_STEPS and are handed as they come.
HAND_STEPS = 256
# Served requests' events (ends, prefill chunks) are read this often (~0.7 ms a read, even empty): the
# map's ring of 1,024 holds 4,096 a second of them, far above a server's request rate.
REQUEST_EVENTS_PERIOD_S = 0.25
CLOSE_TIMEOUT_S = 30.0
IDLE_FLUSH_TIMEOUT_S = 5.0  # the writer's last small commit of a target gone idle


@dataclass
class PipelineSummary:
    db: str
    pid: int
    rows_by_table: dict[str, int] = field(default_factory=dict)
    steps_read: int = 0
    steps_lost: int = 0
    steps_corrupt: int = 0
    steps_already_stored: int = 0  # re-read from the map after a restart, skipped: the store had them
    map_error: str | None = None
    submitted_rows: int = 0
    committed_rows: int = 0
    dropped_rows: int = 0
    failed_rows: int = 0
    store_error: str | None = None
    correlate_runs: int = 0
    correlate_errors: int = 0
    final_correlate: CorrelateStats | None = None
    correlate_seconds: float = 0.0
    anomalies: str | None = None  # the live loss-anomaly detectors' one-line account

    def print(self, stream: TextIO = sys.stderr) -> None:
        tables = ", ".join(f"{t} {n:,}" for t, n in sorted(self.rows_by_table.items()) if n)
        print(f"store {self.db}: {tables or 'nothing written'}", file=stream)
        print(
            f"token steps from the map: {self.steps_read:,} read, {self.steps_lost:,} lost (ring lapped), "
            f"{self.steps_corrupt:,} rejected"
            + (f", {self.steps_already_stored:,} already stored" if self.steps_already_stored else "")
            + (f"; map: {self.map_error}" if self.map_error else ""),
            file=stream,
        )
        print(
            f"store writer: {self.committed_rows:,} of {self.submitted_rows:,} rows committed, "
            f"{self.dropped_rows:,} dropped (queue full), {self.failed_rows:,} failed"
            + (f" ({self.store_error})" if self.store_error else ""),
            file=stream,
        )
        final = self.final_correlate
        if final is not None:
            print(
                f"correlate: {self.correlate_runs} incremental run(s) while attached, then {final.passes:,} "
                f"forward passes rolled up ({final.tagged_events:,} events joined by tag, "
                f"{final.windowed_events:,} by time window, {final.orphan_events:,} without a step), "
                f"{final.requests:,} requests in {self.correlate_seconds:.2f} s"
                + _failed(self.correlate_errors, self.store_error),
                file=stream,
            )
        elif self.correlate_errors:
            print(f"correlate: failed ({self.store_error})", file=stream)
        if self.anomalies:
            print(self.anomalies, file=stream)


def _failed(errors: int, error: str | None) -> str:
    return f"; {errors} run(s) failed ({error})" if errors else ""


def _last_stored_step(store: DuckDBStore, pid: int) -> tuple[int, int, int] | None:
    """The newest token-step key of `pid` in the store (None: none), where a restarted agent resumes."""
    table = store.query(
        "SELECT t_start_ns, step_seq, batch_row FROM token_steps WHERE pid = ? "
        "ORDER BY t_start_ns DESC, step_seq DESC, batch_row DESC LIMIT 1",
        [pid],
    )
    return tuple(int(table.column(i)[0].as_py()) for i in range(3)) if table.num_rows else None


class Pipeline:
    """Sources of one pid -> StoreWriter (+ extra sinks) -> periodic correlate."""

    def __init__(
        self,
        store: DuckDBStore,
        pid: int,
        *,
        session=None,
        sample_ratio: int = 1,
        thin: int = 1,  # probes.thin of the program the events come from (bpf/records.py sample_ratios)
        correlate_every_s: float = CORRELATE_EVERY_S,
        extra_sinks: tuple = (),
        snapshot: Path | None | bool = True,
        owns_store: bool = False,
        shm: ShmSource | None = None,
        detector: DetectorConfig | None = DetectorConfig(),  # noqa: B008 (frozen: one shared default is fine)
        replay=None,  # llmobs.pipeline.auto_replay.ReplayOptions: replay flagged tokens (None: off)
    ):
        self.store = store
        self.pid = pid
        self.owns_store = owns_store
        decoder = EventDecoder([p.name for p in PROBES], sample_ratio=sample_ratio, thin=thin)
        self.writer = StoreWriter(store, decoder)
        # the journal first, then whatever else wants the batches; one fan-out, itself a sink
        self.sinks = CompositeSink([self.writer, *extra_sinks])
        self.shm = shm or ShmSource(pid)
        self.bpf = AggregateSource(session) if session is not None else None
        self.started_ns = clock.monotonic_ns()
        # built after the session attached (attach, demo): steps from here on were seen whole
        self.live = LiveStats(pid, attached_ns=self.started_ns if session is not None else None)
        self.first_step_ns: int | None = None
        self.correlate_runs = 0
        self.correlate_errors = 0
        self.last_error: str | None = None
        self._since_lock = threading.Lock()
        self._pending_since: int | None = None  # oldest step start submitted since the last correlate
        self._unrolled_since: int | None = None  # start of the oldest window a failed correlate left
        self._last_rolled_ns: int | None = None  # when the last successful incremental correlate began
        self._next_slow = 0.0
        self._next_map = 0.0  # the first poll reads the map at once
        self._next_requests = 0.0
        self._held: list[np.ndarray] = []  # ring batches held until the next hand-off (HAND_STEPS)
        self._held_events = 0
        self._held_steps: list[dict] = []  # token-step batches read and scored, not yet handed on
        self._held_step_count = 0
        self._handed_ns = 0  # thread CPU of a hand-off inside the detectors' call (_hand_before_rows)
        self._fresh = False  # rows were submitted since the last correlate began
        self._arrived = threading.Event()  # set with _fresh: wakes a correlate thread that found nothing
        self.correlate_idle = 0  # correlate runs skipped: nothing new was submitted (an idle target)
        self.correlate_stretched = 0  # runs put off past correlate_every_s because they cost too much
        self.correlate_put_off = 0  # due runs put off because nothing waited for the rollups
        self._anomaly_rows_seen = 0  # the anomaly lane's row count when the correlate thread last looked
        self._awaited_runs = 0  # runs still owed to anomalies flagged lately (their evidence)
        self._steps_unrolled = 0  # token steps read since the last correlate run began
        self._closed = False
        self._snapshot = snapshot_path(pid) if snapshot is True else (snapshot or None)
        self._snapshot_ok = self._snapshot is not None
        self._process = self._process_row()
        self._stop = threading.Event()
        self._correlator = threading.Thread(
            target=self._correlate_loop, args=(correlate_every_s,), name="llmobs-correlate", daemon=True
        )
        try:
            store.record_clock_fit("wall", clock.WallClock.measure())
            store.upsert_process(pid, self._process["start_ns"], **self._process["columns"])
            self.shm.resume_after = _last_stored_step(store, pid)
        except Exception as exc:  # bookkeeping rows must not stop the data path
            self.last_error = str(exc)
        # token-loss anomalies: scored as steps arrive, committed at once (None: detectors off)
        self.anomalies = LiveAnomalies(store, detector) if detector is not None else None
        # training-step loss spikes and their dL/dE heatmaps: rows on the anomaly lane, as incidents
        submit = self.anomalies.submit if self.anomalies is not None else store.export
        self.training = TrainingMonitor(pid, submit, artifacts_dir_for(store.path), self.shm.shm_dir)
        if self.anomalies is not None:
            self.anomalies.pass_progress = self.training.scored_through
        self.replays = None  # automatic replays of flagged tokens (--replay-on-anomaly)
        if replay is not None and self.anomalies is not None:
            from llmobs.pipeline.auto_replay import AutoReplayer

            self.replays = AutoReplayer(store, pid, replay, self.shm.shm_dir, flush=self.writer.flush)
            self.anomalies.on_committed = self.replays.on_rows
        self._correlator.start()

    @classmethod
    def open(cls, db: str | Path, pid: int, **options) -> Pipeline:
        """A pipeline owning the agent's store it opens at `db` (closed by `close`; sink.agent_store)."""
        store = agent_store(db)
        return cls(store, pid, owns_store=True, **options)

    # ---- running ----------------------------------------------------------------------------------
    def _process_row(self) -> dict:
        procfs = ProcFS()
        columns: dict[str, object] = {"first_seen_ns": clock.monotonic_ns()}
        start_ns = 0
        try:
            start_ns = procfs.start_time_ticks(self.pid) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
            columns["exe"] = procfs.exe(self.pid)
            columns["cmdline"] = " ".join(procfs.cmdline(self.pid))
        except Exception:
            pass  # a process gone before we looked: the row keeps what we have
        return {"start_ns": start_ns, "columns": columns}

    def _fan_out(self, item) -> None:
        self._fresh = True  # something new for the next correlate
        if not self._arrived.is_set():
            self._arrived.set()
        self.sinks.submit(item)  # never raises: a failing sink is counted by name

    def _hand_held(self) -> None:
        """What was held since the last hand-off to the sinks: the ring's batches as one batch, then the
        token steps (live stats and the store)."""
        began = STAGES.now()
        if self._held:
            held = self._held[0] if len(self._held) == 1 else np.concatenate(self._held)
            self._held, self._held_events = [], 0
            self._fan_out(held)
        STAGES.charge("store_submit", began)
        if self._held_steps:
            steps = joined_columns(self._held_steps)
            self._held_steps, self._held_step_count = [], 0
            self._hand_steps(steps)

    def poll(self, events: np.ndarray | None = None) -> int:
        """Take one drained ring batch (may be empty); at most every MAP_PERIOD_S (or once HOLD_EVENTS
        are held) read the map and score its steps; hand what is held on when it is due (HAND_STEPS).
        Returns the steps read."""
        if events is not None and len(events):
            self._held.append(events)
            self._held_events += len(events)
        now = time.monotonic()
        if now < self._next_map and self._held_events < HOLD_EVENTS:
            STAGES.count("map_reads_deferred")
            return 0
        self._next_map = now + MAP_PERIOD_S
        began = STAGES.now()
        steps = self.shm.poll()
        STAGES.charge("map_read", began)
        count = 0
        if steps is not None:
            count = len(steps["step_seq"])
            self._held_steps.append(steps)
            self._held_step_count += count
            self._score(steps, before_rows=self._hand_before_rows)
        slow = now >= self._next_slow
        if slow or self._held_step_count >= HAND_STEPS or self._held_events >= HOLD_EVENTS:
            self._hand_held()
        elif self._held_step_count or self._held:  # something waits: counted (an idle read holds nothing)
            STAGES.count("hand_offs_deferred")
        began = STAGES.now()
        self._add_layers(self.shm.poll_layers())
        if now >= self._next_requests:
            self._next_requests = now + REQUEST_EVENTS_PERIOD_S
            self._add_request_events(self.shm.poll_request_events())
        began = STAGES.charge("layers", began)
        if slow:
            self._next_slow = time.monotonic() + SLOW_PERIOD_S
            self._hand_aggregates()
            began = STAGES.charge("aggregates", began)
            self._write_snapshot()
            STAGES.charge("snapshot", began)
        return count

    def _add_steps(self, steps: dict | None) -> int:
        """Steps handed on at once (close, another source's batch): to the store and live stats, then
        scored."""
        if steps is None:
            return 0
        self._hand_steps(steps)
        self._score(steps)
        return len(steps["step_seq"])

    def _hand_steps(self, steps: dict) -> None:
        oldest = int(np.min(steps["t_start_ns"]))
        if self.first_step_ns is None or oldest < self.first_step_ns:
            self.first_step_ns = oldest
        with self._since_lock:
            if self._pending_since is None or oldest < self._pending_since:
                self._pending_since = oldest
        began = STAGES.now()
        self.live.add_steps(steps)
        began = STAGES.charge("live_stats", began)
        self._fan_out({"token_steps": steps})
        STAGES.charge("store_submit", began)
        n = len(steps["step_seq"])
        self._steps_unrolled += n
        STAGES.count("token_steps", n)

    def _score(self, steps: dict, before_rows: Callable[[], None] | None = None) -> None:
        """The training monitor's and the detectors' turn at a batch of steps; `before_rows` runs before
        the detectors' anomaly rows (if any) are queued."""
        began = STAGES.now()
        self.training.add_steps(steps)
        began = STAGES.charge("training", began)
        if self.anomalies is not None:
            self._handed_ns = 0
            self.anomalies.add(steps, before_rows=before_rows)
            STAGES.charge("detectors", began + self._handed_ns)  # less the hand-off's own stages

    def _hand_before_rows(self) -> None:
        """What is held, handed on ahead of a flagged token's row: inside the detectors' call, so its
        time (charged to its own stages) is kept out of theirs."""
        began = STAGES.now()
        self._hand_held()
        self._handed_ns += STAGES.now() - began

    def _add_request_events(self, events: dict | None) -> None:
        if events is not None:  # served requests' ends and prefill chunks (map ABI v3)
            self.live.add_request_events(events)  # chunks share their passes in top's per-tenant rates
            self._fan_out({"request_events": events})
        facts = self.shm.poll_request_facts()  # ended requests' labels and intents, new model factors
        if facts is not None:
            self._fan_out(facts)

    def _add_layers(self, layers: dict | None) -> None:
        if layers is not None:
            batch = {"layer_streams": layers}
            modules = self.shm.poll_modules()  # module names come just before their first records
            if modules is not None:
                batch["layer_modules"] = modules
            self._fan_out(batch)

    def _hand_aggregates(self, batch: dict | None = None) -> None:
        if batch is None and self.bpf is not None:
            batch = self.bpf.poll()
        if batch is not None and batch["probe_aggregates"].num_rows:
            self.live.add_aggregates(batch["probe_aggregates"])
            self._fan_out(batch)

    def drops(self) -> dict[str, int]:
        """Every place data can be lost, by name (kernel ring, map ring, writer queue, store)."""
        not_lost = ("steps", "already_stored")  # read, or skipped because the store has them
        out = {f"map_{k}": v for k, v in self.shm.stats().items() if k not in not_lost}
        if self.bpf is not None:
            try:
                counters = self.bpf.session.counters()
            except Exception:
                counters = {}
            out["ring_drops"] = counters.get("ring_drops", 0)
            out["agg_overflow"] = counters.get("agg_overflow", 0)
        out["store_dropped"] = self.writer.counters.dropped_rows
        out["store_failed"] = self.writer.counters.failed_rows
        for name, failed in self.sinks.failures.items():
            out[f"sink_{name}_failed"] = failed
        return out

    def _write_snapshot(self) -> None:
        if not self._snapshot_ok:
            return
        data = {
            "agent_pid": os.getpid(),
            "pid": self.pid,
            "db": str(self.store.path),
            "map": self.shm.map_path,
            "updated_ns": clock.monotonic_ns(),
            "stats": self.live.row(),
            "drops": self.drops(),
            # the store's progress: a small commit may be held up to MAX_HOLD_S (store/writer.py)
            "store": {
                "commits": self.writer.counters.commits,
                "committed_rows": self.writer.counters.committed_rows,
            },
            "attached": [p.name for p in self.bpf.session.attached_probes] if self.bpf else [],
        }
        try:
            write_snapshot(self._snapshot, data)  # makes the run directory when it is missing
        except OSError as exc:  # no /run/llmobs (not root): `top` falls back to reading the map
            self._snapshot_ok = False
            self.last_error = f"snapshot {self._snapshot}: {exc.strerror}"

    # ---- correlate --------------------------------------------------------------------------------
    def _take_since(self, previous_run_ns: int | None) -> int:
        with self._since_lock:
            pending, self._pending_since = self._pending_since, None
        candidates = [c for c in (pending, previous_run_ns and previous_run_ns - LATE_NS) if c]
        return max(min(candidates), 0) if candidates else clock.monotonic_ns() - LATE_NS

    def _correlate_loop(self, every_s: float) -> None:
        # its own cursor: never contends with the writer's lock; given back after every run, so that the
        # store can reopen its database between runs (DuckDBStore.recycle)
        conn = self.store.cursor()
        previous: int | None = None
        quiet = 0  # runs in a row with nothing submitted before them
        interval = every_s
        try:
            while not self._stop.wait(interval):
                if self._put_off(previous):
                    continue
                # An idle target: nothing submitted since the run before the last, whose small last
                # commit the writer may still hold (MAX_HOLD_S): flushed, and this run rolls it up.
                # After that, with no failed window to retry, the same SQL would roll up the same rows
                # again: skipped, counted, and the thread sleeps until rows arrive (no wake-ups of an
                # idle agent); the final correlate at close covers everything anyway.
                self._arrived.clear()  # before _fresh is read: a submit in between sets it again
                quiet = 0 if self._fresh else quiet + 1
                self._fresh = False
                if quiet == 2:
                    self.writer.flush(IDLE_FLUSH_TIMEOUT_S)
                elif quiet > 2 and previous is not None and self._unrolled_since is None:
                    self.correlate_idle += 1
                    STAGES.count("correlate_skipped_idle")
                    self._arrived.wait()  # set by the next submit, or by close
                    interval = every_s
                    continue
                since = self._take_since(previous)
                with self._since_lock:  # a failed run's window is retried from its start
                    if self._unrolled_since is not None:
                        since = min(since, self._unrolled_since)
                previous = clock.monotonic_ns()
                # No writer.flush() here: with a source submitting every 20 ms the writer is never
                # idle, so a flush would wait forever. Committed data is at most 1 s old, and the next
                # run re-rolls the last LATE_NS, so what lands late is counted then.
                began = run_began = STAGES.now()
                try:
                    correlate(conn, since_ns=since, pid=self.pid, run=self.store.with_headroom)
                    self.correlate_runs += 1
                    with self._since_lock:
                        self._unrolled_since, self._last_rolled_ns = None, previous
                    self.store.rollups_committed()  # an exporter waiting for these rollups goes now
                    began = STAGES.charge("correlate", began)
                    if self.anomalies is not None:  # anomalies of steps rolled up now get their evidence
                        self.anomalies.refresh_evidence(conn, self.pid, since)
                        STAGES.charge("evidence", began)
                except Exception as exc:  # counted; retried by the next run and by the final one at close
                    self.correlate_errors += 1
                    self.last_error = f"correlate: {str(exc).splitlines()[0]}"
                    with self._since_lock:
                        if self._unrolled_since is None or since < self._unrolled_since:
                            self._unrolled_since = since
                interval = self._next_interval(every_s, (STAGES.now() - run_began) / 1e9)
                conn.idle()
        finally:
            conn.idle()

    def _put_off(self, previous_ns: int | None) -> bool:
        """A due run put off: nothing waits for its rollups, the last run is under CORRELATE_UNAWAITED_S
        old and fewer than PUT_OFF_MAX_STEPS steps wait (its window, `_pending_since`, keeps until the
        run). Newly flagged anomalies are owed two runs: their step may still sit in the writer's held
        commit at the first. `_steps_unrolled` is counted by the drain loop and reset here without a
        lock: a step lost in that race only shifts when a busy target's run goes, never what it rolls."""
        rows = self.anomalies.counters.rows if self.anomalies is not None else 0
        if rows != self._anomaly_rows_seen:
            self._anomaly_rows_seen, self._awaited_runs = rows, 2
        young = previous_ns is not None and clock.monotonic_ns() - previous_ns < CORRELATE_UNAWAITED_S * 1e9
        few = self._steps_unrolled < PUT_OFF_MAX_STEPS
        if young and few and not self._awaited_runs and not self.store.rollups_followed:
            STAGES.count("correlate_put_off")
            self.correlate_put_off += 1
            return True
        self._awaited_runs = max(self._awaited_runs - 1, 0)
        self._steps_unrolled = 0  # the run goes now
        return False

    def _next_interval(self, every_s: float, run_cpu_s: float) -> float:
        """The wait before the next run: `every_s`, stretched so that runs cost at most
        CORRELATE_CPU_SHARE of a core (visibly: counted), never beyond CORRELATE_MAX_S."""
        wanted = run_cpu_s / CORRELATE_CPU_SHARE
        if wanted <= every_s:
            return every_s
        STAGES.count("correlate_stretched")
        self.correlate_stretched += 1
        return min(wanted, max(CORRELATE_MAX_S, every_s))

    def _final_since(self, session_since: int) -> int:
        """Where the last correlate at close starts: only what the incremental runs may not have rolled
        up whole (steps submitted since the last run, a failed run's window, the last LATE_NS before
        the last good run), never the whole session again: that re-scan took 114 s over 90 M events."""
        with self._since_lock:
            if self._last_rolled_ns is None:  # no incremental run succeeded: the whole session
                return session_since
            candidates = [self._last_rolled_ns - LATE_NS, self._pending_since, self._unrolled_since]
        return max(min(c for c in candidates if c is not None), session_since)

    # ---- stop -------------------------------------------------------------------------------------
    def close(
        self,
        events: np.ndarray | None = None,
        final: dict | None = None,
        before_store_close: Callable[[], None] | None = None,
    ) -> PipelineSummary:
        """Hand the last batches (the session's final drain and totals), commit all, correlate once.

        `before_store_close` runs after the last commit and correlate, while the store is still open
        (`attach --otlp` flushes its exporter there)."""
        if self._closed:
            raise RuntimeError("pipeline closed twice")
        self._closed = True
        if events is not None and len(events):
            self._held.append(events)
        self._hand_held()
        # The map's last steps (the reader's fd outlives the unlink of an exited process's map), looked
        # for even if no poll ran yet: a Ctrl-C right after attaching must not lose what the map holds.
        self._add_steps(self.shm.drain())
        self._add_layers(self.shm.drain_layers())
        self._add_request_events(self.shm.poll_request_events(refresh=True))
        self.training.close(CLOSE_TIMEOUT_S)  # the last step scored, pending heatmaps done (bounded)
        if self.bpf is not None and final is not None:
            self._hand_aggregates(self.bpf.final(final))
        self._stop.set()
        self._arrived.set()  # a correlate thread asleep until rows arrive wakes, sees the stop, ends
        self._correlator.join(CLOSE_TIMEOUT_S)
        if self.replays is not None:  # before the writer closes: a replay's ingest flushes it first
            self.replays.close(CLOSE_TIMEOUT_S)
        closed = self.sinks.close(CLOSE_TIMEOUT_S)
        if self.sinks.last_error or not closed:
            self.last_error = self.sinks.last_error or "a sink did not finish within its close timeout"
        if self.anomalies is not None:
            self.anomalies.close(CLOSE_TIMEOUT_S)
        summary = self._summary()
        began = time.perf_counter()
        conn = None
        try:
            session_since = max((self.first_step_ns or self.started_ns) - LATE_NS, 0)
            # its own cursor: in a daemon other pipelines' writers share the store's connection
            conn = self.store.cursor()
            # re-roll only the tail the incremental runs may have missed; report the whole session
            since = self._final_since(session_since)
            summary.final_correlate = correlate(
                conn,
                since_ns=since,
                pid=self.pid,
                report_since_ns=session_since,
                run=self.store.with_headroom,
            )
        except Exception as exc:
            self.correlate_errors += 1
            summary.store_error = f"correlate: {str(exc).splitlines()[0]}"
        finally:
            if conn is not None:
                conn.close()
        summary.correlate_seconds = time.perf_counter() - began
        if self.anomalies is not None:
            self._final_evidence(summary)
        summary.correlate_errors = self.correlate_errors
        try:
            columns = {"last_seen_ns": clock.monotonic_ns(), "map_path": self.shm.map_path or None}
            if not os.path.exists(f"/proc/{self.pid}"):
                columns["exit_ns"] = columns["last_seen_ns"]
            self.store.upsert_process(self.pid, self._process["start_ns"], **columns)
        except Exception as exc:
            summary.store_error = summary.store_error or str(exc)
        if before_store_close is not None:
            try:
                before_store_close()
            except Exception as exc:
                summary.store_error = summary.store_error or f"before close: {exc}"
        self.shm.close()
        if self._snapshot is not None:
            remove_snapshot(self._snapshot)
        if self.owns_store:
            result = self.store.shutdown(CLOSE_TIMEOUT_S)
            if not result.ok:
                summary.store_error = summary.store_error or result.error
        return summary

    def _final_evidence(self, summary: PipelineSummary) -> None:
        """Evidence for every anomaly of the session whose step is rolled up, after the last correlate."""
        with self.store.cursor() as conn:
            since = max((self.first_step_ns or self.started_ns) - LATE_NS, 0)
            self.anomalies.refresh_evidence(conn, self.pid, since, pages=None)
        summary.anomalies = self.anomalies.summary()
        if self.replays is not None:
            summary.anomalies += "\n" + self.replays.summary()

    def _summary(self) -> PipelineSummary:
        counters = self.writer.counters
        shm = self.shm.stats()
        return PipelineSummary(
            db=str(self.store.path),
            pid=self.pid,
            rows_by_table=dict(self.store.counters.rows_by_table),
            steps_read=shm["steps"],
            steps_lost=shm["lost"],
            steps_corrupt=shm["corrupt"],
            steps_already_stored=shm["already_stored"],
            map_error=self.shm.error or (None if self.shm.reader or self.shm.steps else self.shm.waiting),
            submitted_rows=counters.submitted_rows,
            committed_rows=counters.committed_rows,
            dropped_rows=counters.dropped_rows,
            failed_rows=counters.failed_rows,
            store_error=self.store.counters.last_error or self.last_error or self.sinks.last_error,
            correlate_runs=self.correlate_runs,
            correlate_errors=self.correlate_errors,
        )

    # ---- batches of sources the pipeline does not poll itself (a CUPTI trace, NVML) ----------------
    def add_batch(self, batch: dict) -> None:
        """One {table: columns} batch of another Source: token steps go the way the map's do (live
        stats, detectors, the correlate window), gpu_samples as `add_gpu_samples`, every other table
        to the sinks; the correlate window then reaches back to their oldest ts_ns, so the steps they
        belong to are rolled up again (a trace's gpu_ops give those steps their gpu_ns)."""
        rest = dict(batch)
        steps = rest.pop("token_steps", None)
        if steps is not None and len(steps["step_seq"]):
            self._add_steps(steps)
        samples = rest.pop("gpu_samples", None)
        if samples is not None:
            self.add_gpu_samples(samples)
        oldest = _oldest_ts(rest)
        if oldest is not None:
            self.first_step_ns = oldest if self.first_step_ns is None else min(self.first_step_ns, oldest)
            with self._since_lock:
                pending = self._pending_since
                self._pending_since = oldest if pending is None else min(pending, oldest)
        if rest:
            self._fan_out(rest)

    def add_gpu_samples(self, columns: dict) -> None:
        """This pid's NVML samples (gpu_samples columns, llmobs.gpu.nvml_source): to the sinks, and the
        latest into LiveStats so `top` shows the process's GPU utilisation and memory."""
        if not len(columns["ts_ns"]):
            return
        self.live.add_gpu_samples(columns)
        self._fan_out({"gpu_samples": columns})


def _oldest_ts(batch: dict) -> int | None:
    """The smallest ts_ns in a {table: columns} batch (None: no table with timed rows)."""
    times = [np.asarray(c["ts_ns"]) for c in batch.values() if isinstance(c, dict) and "ts_ns" in c]
    return min((int(t.min()) for t in times if len(t)), default=None)
