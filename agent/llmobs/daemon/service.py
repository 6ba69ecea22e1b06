"""The daemon's main loop: discover, attach and detach, drain, export, keep the store, answer signals.

One thread does it all, in the runtime's loop (llmobs.runtime.Agent, the same as `attach`'s): the
fleet's ring is drained every 20 ms while events flow (50 ms when quiet); targets are checked for exit
and the governor ticks once a second. The daemon adds its own tasks to that loop: /proc is scanned
every discovery interval, the status file is rewritten once a second, retention runs every 10 minutes.
Signals only set flags and wake the loop through a self-pipe (signal.set_wakeup_fd), so a handler never
runs in the middle of a drain: SIGHUP reloads the config (a bad new config is logged and the old one
kept), SIGTERM/SIGINT drain (final harvest of every target, commit, correlate, OTLP finish) and exit 0.
systemd hears READY=1 once the program is loaded, WATCHDOG=1 every half WatchdogSec, and STOPPING=1.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import faulthandler
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from llmobs import clock
from llmobs.bpf.session import Options, context_cell_refusal, require_privileges
from llmobs.daemon.config import SETTINGS, DaemonConfig
from llmobs.daemon.discovery import Proc, ProcWatcher, Selectors
from llmobs.daemon.fleet import Fleet
from llmobs.daemon.notify import Notifier
from llmobs.errors import AccessDenied, LlmobsError, MissingLibrary
from llmobs.logtext import one_line
from llmobs.pipeline.live import remove_snapshot, write_snapshot
from llmobs.procfs import ProcFS
from llmobs.runtime import Agent, Detached, Target, Task
from llmobs.shm.presence import ReaderPresence

STATUS_EVERY_S = 1.0  # the status file and systemd's STATUS= line
SWEEP_EVERY_S = 1.0  # maps left by exited processes are looked for at most this often
RETENTION_EVERY_S = 600.0
STATUS_FILE = "daemon.json"
# probes.* keys change what the program is compiled with or how rows are weighted: the fleet is rebuilt
FLEET_KEYS = ("probes.profiles", "probes.sample_n", "probes.sample_mode", "probes.thin", "probes.ioctl_paths")
SELECT_KEYS = ("select.users", "select.cgroup", "select.command", "discovery.recheck_s")


def stderr_log(line: str) -> None:
    print(f"llmobs-agent: {line}", file=sys.stderr, flush=True)


class Service:
    def __init__(
        self,
        config: DaemonConfig,
        *,
        loader: Callable[[], DaemonConfig] | None = None,
        log: Callable[[str], None] = stderr_log,
        notifier: Notifier | None = None,
        procfs: ProcFS | None = None,
    ):
        self.config = config
        self.loader = loader
        # every line escaped at the sink too: a skip reason or an error may quote a target's comm
        self.log = lambda line: log(one_line(line))
        self.notifier = notifier or Notifier()
        self.procfs = procfs or ProcFS()
        self.started_ns = clock.monotonic_ns()
        self.store = None
        self.fleet: Fleet | None = None
        self.agent: Agent | None = None  # the runtime: drain, governor, telemetry, targets, exporter
        self.exporter = None
        self.watcher: ProcWatcher | None = None
        self.reloads = 0
        self.reload_errors = 0
        self.last_reload_error: str | None = None
        self.detached_total = 0
        self.hook_errors: dict[str, str] = {}  # the daemon's own bookkeeping failures (the status file)
        self._flags = {"stop": None, "reload": False}
        self._logged_refusals: set[tuple[int, int]] = set()
        self._wake_r = self._wake_w = -1

    # ---- start ------------------------------------------------------------------------------------
    def _open(self) -> None:
        require_privileges(self.procfs)
        import importlib.util

        # found, not imported: bcc compiles in a child process (llmobs.bpf.compile); libbcc never loads here
        if importlib.util.find_spec("bcc") is None:
            raise MissingLibrary("bcc (python3-bpfcc) is not importable: no module named 'bcc'")
        from llmobs.store.sink import agent_store

        config = self.config
        try:
            config.run_dir.mkdir(parents=True, exist_ok=True)
        except PermissionError as exc:
            raise AccessDenied(f"cannot create the run dir {config.run_dir}: {exc.strerror}") from None
        except OSError as exc:
            raise LlmobsError(f"cannot create the run dir {config.run_dir}: {exc.strerror}") from None
        # DuckDB's default is 80% of the host's RAM, far above the unit's MemoryMax: the store's working
        # memory is capped as for attach (32MB or $LLMOBS_DUCKDB_MEMORY_LIMIT); it spills beyond.
        self.store = agent_store(config.store_path)
        if config.retention_bytes:
            self._retention(by_size=True)
        self.fleet = self._new_fleet(config)
        self.watcher = ProcWatcher(Selectors.of(config), self.procfs, recheck_s=config.recheck_s)
        if config.otlp is not None:
            from llmobs.otlp import start_exporter

            self.exporter = start_exporter(self.store, config.otlp)
        self.agent = new_agent(config, self.fleet, self.store, self.exporter, self.log, self._on_detach)
        # from now on a workload that exits with unread steps leaves its map for the next sweep
        self.agent.presence = ReaderPresence.announce()

    def _new_fleet(self, config: DaemonConfig) -> Fleet:
        options = Options(
            profiles=config.profiles,
            sample_n=config.sample_n,
            sample_mode=config.sample_mode,
            thin=config.thin,
            ioctl_paths=config.ioctl_paths,
            # per-hit cost of each uprobe, measured once per agent process: what the governor weighs
            calibrate=True,
        )
        fleet = Fleet(options, self.store, config.run_dir, log=self.log, detector=config.detector_config(),
                      replay=config.replay_options())  # fmt: skip
        fleet.start()
        _release_heap()
        offered = [p.name for p in fleet.program.probes]
        skipped = "".join(f"; {name} unavailable: {why}" for name, why in fleet.skipped.items())
        self.log(f"program loaded: profiles {','.join(config.profiles)}: {', '.join(offered)}{skipped}")
        return fleet

    # ---- signals ----------------------------------------------------------------------------------
    def _install_signals(self) -> dict:
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

        def on_stop(signum, _frame):
            self._flags["stop"] = signal.Signals(signum).name

        def on_hup(_signum, _frame):
            self._flags["reload"] = True

        previous = {
            signal.SIGTERM: signal.signal(signal.SIGTERM, on_stop),
            signal.SIGINT: signal.signal(signal.SIGINT, on_stop),
            signal.SIGHUP: signal.signal(signal.SIGHUP, on_hup),
        }
        self._previous_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        # SIGUSR1 prints every thread's stack to stderr (the journal): how to see where a stuck agent is
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
        return previous

    def _restore_signals(self, previous: dict) -> None:
        faulthandler.unregister(signal.SIGUSR1)
        signal.set_wakeup_fd(self._previous_wakeup)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _wait(self, seconds: float) -> None:
        """Sleeps up to `seconds`, woken at once by a signal."""
        if self._flags["stop"] or self._flags["reload"]:
            return
        readable, _, _ = select.select([self._wake_r], [], [], max(seconds, 0.0))
        if readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 512):
                    pass

    # ---- run --------------------------------------------------------------------------------------
    def run(self) -> int:
        previous = self._install_signals()  # before opening: a SIGTERM during start still drains
        try:
            self._open()
            self.log(
                f"running: store {self.config.store_path}, selecting {Selectors.of(self.config).describe()}, "
                f"discovery every {self.config.discovery_interval_s:g} s"
                + (f", otlp {self.config.otlp.resolved_endpoint()}" if self.config.otlp else "")
            )
            self.notifier.ready(self._status_text())
            self._loop()
        finally:
            self.notifier.stopping()
            self._shutdown()
            self._restore_signals(previous)
        self.log(
            f"stopped ({self._flags['stop'] or 'exit'}); {self.detached_total} target(s) detached in all"
        )
        return 0

    def _loop(self) -> None:
        def reload(_now: float) -> None:
            if self._flags["reload"]:
                self._flags["reload"] = False
                self._reload()
                discover.next_at = 0.0  # a changed selector is applied at once

        discover = Task(lambda: self.config.discovery_interval_s, lambda _now: self._discover())
        tasks = [
            Task(0.0, reload),
            discover,
            Task(STATUS_EVERY_S, lambda _now: self._report_status()),
            # not every scan: a left map waits for the agent (bounded, llmobs.shm.leftover), so a
            # sweep a second keeps the loop's /dev/shm reads off a short discovery interval
            Task(lambda: max(self.config.discovery_interval_s, SWEEP_EVERY_S), lambda _now: self._sweep()),
        ]
        if self.notifier.watchdog_s:
            tasks.append(Task(self.notifier.watchdog_s, lambda _now: self.notifier.watchdog()))
        if self.config.retention_age_s:
            retain = Task(RETENTION_EVERY_S, lambda _now: self._retention(by_size=False))
            retain.next_at = time.monotonic() + RETENTION_EVERY_S  # the first run after one period
            tasks.append(retain)
        self.agent.run(lambda: self._flags["stop"], tasks, wait=self._wait)

    def _sweep(self) -> None:
        """The maps of processes already gone (some lived shorter than a scan interval), stored once."""
        swept = self.agent.sweep_maps(Selectors.of(self.config).accepts_exited_uid)
        if swept.removed:
            self.log(f"stale maps: {swept.line()}")

    def _discover(self) -> None:
        appeared, gone = self.watcher.scan()
        for proc in gone:
            target = self.agent.targets.get(proc.pid)
            if target is not None and target.key.key == proc.key:
                alive = target.session.target_alive()
                self._detach(proc.pid, "no longer selected" if alive else "exited")
        for proc in appeared:
            self._attach(proc)

    def _attach(self, proc: Proc) -> None:
        if len(self.agent.targets) >= self.config.max_targets:
            self._refuse(proc, f"daemon.max_targets = {self.config.max_targets} reached")
            return
        try:
            session, pipeline = self.fleet.open_target(proc)
        except LlmobsError as exc:
            self._refuse(proc, str(exc))
            return
        except Exception as exc:  # a bug or a kernel refusal: one line, the daemon goes on
            self._refuse(proc, f"{type(exc).__name__}: {exc}")
            return
        self.agent.add(session, pipeline, shared=True, key=proc)
        probes = ",".join(p.name for p in session.attached_probes)
        skipped = "".join(f"; skipped {s.probe.name}: {s.reason}" for s in session.skipped)
        tag = "map" if session.cell_address else "no map yet: events untagged until it appears"
        refused = None if session.cell_address else self.agent.guard("map check", _map_refusal, session)
        if refused:  # a map that fails the reader's owner/mode checks: never used to tag events
            tag = f"map refused, events untagged: {refused}"
        self._write_status()  # before the line: whoever reads the line finds the status current
        self.log(
            f"attach pid {proc.pid} ({_short(proc.command)}) [{proc.why}, {tag}]: {probes}"
            f" in {session.stats.attached_after_s:.2f} s{skipped}"
        )

    def _refuse(self, proc: Proc, reason: str) -> None:
        self.watcher.refuse(proc, reason)
        if proc.key not in self._logged_refusals:  # once per process, not every recheck
            self._logged_refusals.add(proc.key)
            self.log(f"skip pid {proc.pid} ({_short(proc.command)}): {reason}")

    def _detach(self, pid: int, reason: str) -> Detached | None:
        if pid not in self.agent.targets:
            return None
        return self.agent.remove(pid, reason)  # the runtime calls _on_detach

    def _on_detach(self, detached: Detached) -> None:
        """A target left the runtime (it exited, was deselected, or the daemon stops)."""
        # a process still selected (probes reconfigured) is found again by the next scan
        self.watcher.forget(detached.target.pid)
        self.detached_total += 1
        self._write_status()
        self._log_detach(detached)

    def _log_detach(self, detached: Detached) -> None:
        target, summary = detached.target, detached.summary
        steps = summary.steps_read if summary else 0
        problems = detached.final.get("problems") or []
        stored = f"{summary.committed_rows:,} rows committed" if summary else "pipeline failed"
        reason = "exited" if detached.reason == "target exited" else detached.reason
        self.log(
            f"detach pid {target.pid} ({_short(target.key.command)}): {reason}; "
            f"{target.events:,} events, {steps:,} token steps, {stored}"
            + (f"; problems: {'; '.join(problems)}" if problems else "")
        )

    def _report_status(self) -> None:
        self._write_status()
        self.notifier.status(self._status_text())

    # ---- status -----------------------------------------------------------------------------------
    def _status_text(self) -> str:
        targets = self.agent.targets if self.agent else {}
        return f"{len(targets)} target(s): " + (" ".join(str(pid) for pid in targets) or "waiting")

    def status(self) -> dict:
        """The daemon-wide status (written to RUN_DIR/daemon.json once a second)."""
        fleet, agent = self.fleet, self.agent
        data = {
            "agent_pid": os.getpid(),
            "updated_ns": clock.monotonic_ns(),
            "started_ns": self.started_ns,
            "config_file": str(self.config.file) if self.config.file else None,
            "store": str(self.config.store_path),
            "selectors": Selectors.of(self.config).describe(),
            "program": {
                "probes": [p.name for p in fleet.program.probes] if fleet and fleet.program else [],
                "ids": fleet.program_ids() if fleet else {},
                "tracepoints": [p.name for p in fleet.global_probes] if fleet else [],
                "skipped": dict(fleet.skipped) if fleet else {},
            },
            "targets": [_target_row(t) for t in agent.targets.values()] if agent else [],
            "counters": {**(fleet.counters() if fleet else {}), "unrouted": agent.unrouted if agent else 0},
            "discovery": dataclasses.asdict(self.watcher.stats) if self.watcher else {},
            "reloads": self.reloads,
            "reload_errors": self.reload_errors,
            "last_reload_error": self.last_reload_error,
            "detached": self.detached_total,
            "hooks_missing_or_failed": {**(agent.hook_errors if agent else {}), **self.hook_errors},
        }
        if agent is not None and agent.governor is not None:
            data["governor"] = agent.guard("governor", agent.governor.snapshot)
        if agent is not None and agent.last_sample is not None:
            data["telemetry"] = agent.last_sample
        if self.exporter is not None:
            data["otlp"] = self.exporter.counters.as_dict()
        return data

    def status_path(self) -> Path:
        return self.config.run_dir / STATUS_FILE

    def _write_status(self) -> None:
        try:
            write_snapshot(self.status_path(), self.status())
        except (OSError, TypeError, ValueError) as exc:
            if "status" not in self.hook_errors:
                self.log(f"status file {self.status_path()}: {exc}")
            self.hook_errors["status"] = str(exc)

    # ---- reload -----------------------------------------------------------------------------------
    def _reload(self) -> None:
        self.notifier.reloading()
        self.reloads += 1
        try:
            if self.loader is None:
                raise LlmobsError("no config loader: nothing to reload")
            new = self.loader()
        except LlmobsError as exc:
            self.reload_errors += 1
            self.last_reload_error = str(exc)
            self.log(f"reload failed, keeping the running config: {exc}")
            self.notifier.ready(self._status_text())
            return
        old = self.config
        changed = old.changed_keys(new)
        kept = {s.attr: getattr(old, s.attr) for s in SETTINGS if not s.live and s.key in changed}
        if "otlp" in changed:
            kept["otlp"] = old.otlp
        for key in [k for k in changed if k == "otlp" or not _setting(k).live]:
            self.log(f"reload: {key} changed; it takes effect at the next start")
        new = dataclasses.replace(new, **kept)
        live = [k for k in changed if k != "otlp" and _setting(k).live]
        self.config = new
        self.log(f"reload: {', '.join(live) if live else 'nothing changed'}")
        if any(k in FLEET_KEYS for k in live):  # recompile: detach all; the next scan attaches again
            for pid in list(self.agent.targets):
                self._detach(pid, "probes reconfigured")
            self.fleet.close()
            self.fleet = self._new_fleet(new)
            self.agent.use_ring(self.fleet.ring, self.fleet.ring_records)
            self.watcher.tracked.clear()
        if any(k in SELECT_KEYS for k in live):
            self.watcher.set_selectors(Selectors.of(new), new.recheck_s)
            self._logged_refusals.clear()
        if "overhead.budget" in live:
            self.agent.set_budget(new.overhead_budget)
        if "overhead.cost_scale" in live:
            self.agent.set_cost_scale(new.cost_scale)
        self.notifier.ready(self._status_text())

    # ---- retention and stop -----------------------------------------------------------------------
    def _retention(self, by_size: bool) -> None:
        from llmobs.store import retention

        try:
            if by_size:
                report = retention.retain_size(self.store, self.config.retention_bytes)
            else:
                report = retention.retain_age(self.store, int(self.config.retention_age_s * 1e9))
        except Exception as exc:  # counted in the log; the data path goes on
            self.log(f"retention failed: {str(exc).splitlines()[0]}")
            return
        deleted = sum(report.deleted.values())
        if deleted or report.compacted:
            self.log(
                f"retention: {deleted:,} rows deleted; "
                f"store {report.size_before:,} -> {report.size_after:,} bytes"
            )

    def _shutdown(self) -> None:
        """Every target detached with its final totals committed, the exporter finished, the store closed."""
        # every target detached first, then the exporter finished while the store is still open
        if self.agent is not None:
            self.agent.close(f"agent stopping ({self._flags['stop'] or 'error'})")
        if self.fleet is not None:
            self.fleet.close()
        counters = self.agent.exporter_counters if self.agent is not None else None
        if counters is not None:
            self.log(
                f"otlp: {counters.spans_sent:,} spans sent, {counters.attempts_failed} failed attempts"
                + (f"; last error: {counters.last_error}" if counters.last_error else "")
            )
        if self.store is not None:
            result = self.store.shutdown(30.0)
            if not result.ok:
                self.log(f"store close: {result.error}")
        remove_snapshot(self.status_path())


def _release_heap() -> None:
    """Gives the compiler's freed heap back to the system: bcc's LLVM leaves ~30 MB of free arenas after
    a compile (measured: 232 -> 203 MB RSS), which would otherwise count against MemoryMax for good."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _setting(key: str):
    return next(s for s in SETTINGS if s.key == key)


def _map_refusal(session) -> str | None:
    """Why the target's llmobs map was not used to tag its events (None: it was, or there is none)."""
    return context_cell_refusal(session.pid, session.procfs.maps(session.pid))


def _short(command: str, limit: int = 80) -> str:
    """A target's command line for a log line: control characters escaped (one event, one line), cut."""
    command = one_line(command)
    return command if len(command) <= limit else command[: limit - 3] + "..."


def _target_row(target: Target) -> dict:
    session, pipeline, proc = target.session, target.pipeline, target.key
    return {
        "pid": proc.pid,
        "start_ticks": proc.start_ticks,
        "command": proc.command,
        "why": proc.why,
        "uid": proc.uid,
        "probes": [p.name for p in session.attached_probes],
        "uprobe_events": len(session.attached.uprobe_events),
        "tagged": bool(session.cell_address),
        "attached_s": round(time.monotonic() - target.attached_at, 3),
        "events": target.events,
        "token_steps": pipeline.shm.steps,
        "drops": pipeline.drops(),
    }


def new_agent(config: DaemonConfig, fleet: Fleet, store, exporter, log, on_detach) -> Agent:
    """The runtime for the daemon's fleet: the shared ring, the overhead budget, the exporter."""
    return Agent(
        store=store, ring=fleet.ring, ring_records=fleet.ring_records, exporter=exporter,
        budget=config.overhead_budget, cost_scale=config.cost_scale, log=log, on_detach=on_detach,
        cpu_priority=config.cpu_priority,
    )  # fmt: skip
