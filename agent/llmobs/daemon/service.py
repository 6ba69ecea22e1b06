"""The daemon's main loop: discover, attach and detach, drain, export, keep the store, answer signals.

One thread does it all, in ticks: the fleet's ring is drained every 20 ms while events flow (100 ms
when quiet, as `attach` does); /proc is scanned every discovery interval; targets are checked for exit,
the governor ticks and the status file is rewritten once a second; retention runs every 10 minutes.
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
from llmobs.bpf.records import RING_RECORD_DTYPE
from llmobs.bpf.session import Options, context_cell_refusal, require_privileges
from llmobs.daemon.config import SETTINGS, DaemonConfig
from llmobs.daemon.discovery import Proc, ProcWatcher, Selectors
from llmobs.daemon.fleet import Detached, Fleet, Target
from llmobs.daemon.notify import Notifier
from llmobs.errors import AccessDenied, LlmobsError, MissingLibrary
from llmobs.logtext import one_line
from llmobs.pipeline.live import remove_snapshot, write_snapshot
from llmobs.procfs import ProcFS

DRAIN_PERIOD_S = (0.02, 0.05)  # as `attach`: 20 ms while events flow, 50 ms when quiet (anomaly latency)
SLOW_TICK_S = 1.0  # target exits, governor, status file
RETENTION_EVERY_S = 600.0
STATUS_FILE = "daemon.json"
# probes.* keys change what the program is compiled with or how rows are weighted: the fleet is rebuilt
FLEET_KEYS = ("probes.profiles", "probes.sample_n", "probes.sample_mode", "probes.ioctl_paths")
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
        self.exporter = None
        self.governor = None
        self.telemetry = None
        self.watcher: ProcWatcher | None = None
        self.reloads = 0
        self.reload_errors = 0
        self.last_reload_error: str | None = None
        self.detached_total = 0
        self.hook_errors: dict[str, str] = {}
        self.last_sample: dict | None = None  # the self-telemetry's last reading
        self._flags = {"stop": None, "reload": False}
        self._logged_refusals: set[tuple[int, int]] = set()
        self._wake_r = self._wake_w = -1

    # ---- start ------------------------------------------------------------------------------------
    def _open(self) -> None:
        require_privileges(self.procfs)
        try:
            import bcc  # noqa: F401
        except ImportError as exc:
            raise MissingLibrary(f"bcc (python3-bpfcc) is not importable: {exc}") from exc
        from llmobs.store import DuckDBStore
        from llmobs.store.sink import agent_memory_limit

        config = self.config
        try:
            config.run_dir.mkdir(parents=True, exist_ok=True)
        except PermissionError as exc:
            raise AccessDenied(f"cannot create the run dir {config.run_dir}: {exc.strerror}") from None
        except OSError as exc:
            raise LlmobsError(f"cannot create the run dir {config.run_dir}: {exc.strerror}") from None
        # DuckDB's default is 80% of the host's RAM, far above the unit's MemoryMax: the store's working
        # memory is capped as for attach (256MB or $LLMOBS_DUCKDB_MEMORY_LIMIT); it spills beyond.
        self.store = DuckDBStore(config.store_path, memory_limit=agent_memory_limit())
        if config.retention_bytes:  # before any cursor exists: compaction swaps the file
            self._retention(by_size=True)
        self.fleet = self._new_fleet(config)
        self.watcher = ProcWatcher(Selectors.of(config), self.procfs, recheck_s=config.recheck_s)
        if config.otlp is not None:
            from llmobs.otlp import start_exporter

            self.exporter = start_exporter(self.store, config.otlp)
        self.governor, self.telemetry = self._overhead_hooks(config.overhead_budget)

    @property
    def _busy_events(self) -> int:
        """A drain of 1% of the ring or more: events flow fast, drain again after the short period."""
        return max(self.fleet.program.ring_bytes // RING_RECORD_DTYPE.itemsize // 100, 1)

    def _new_fleet(self, config: DaemonConfig) -> Fleet:
        options = Options(
            profiles=config.profiles,
            sample_n=config.sample_n,
            sample_mode=config.sample_mode,
            ioctl_paths=config.ioctl_paths,
            # per-hit cost of each uprobe, measured once per agent process: what the governor weighs
            calibrate=True,
        )
        fleet = Fleet(options, self.store, config.run_dir, log=self.log)
        fleet.start()
        _release_heap()
        offered = [p.name for p in fleet.program.probes]
        skipped = "".join(f"; {name} unavailable: {why}" for name, why in fleet.skipped.items())
        self.log(f"program loaded: profiles {','.join(config.profiles)}: {', '.join(offered)}{skipped}")
        return fleet

    def _overhead_hooks(self, budget: float):
        """The overhead governor (it logs its own decisions through self.log) and the self-telemetry of
        llmobs.governor; a build without them runs without, and says so once."""
        try:
            from llmobs.governor import SelfTelemetry
        except ImportError as exc:
            self.hook_errors["governor"] = f"llmobs.governor is not available in this build ({exc})"
            self.log(f"governor: {self.hook_errors['governor']}; running without it")
            return None, None
        governor = telemetry = None
        try:
            governor = self._new_governor(budget)
        except Exception as exc:
            self.hook_errors["governor"] = f"could not start: {exc}"
            self.log(f"governor: could not start ({exc}); running without it")
        try:
            telemetry = SelfTelemetry(governor)
            if self.exporter is not None:
                telemetry.track_exporter(self.exporter)
        except Exception as exc:
            self.hook_errors["telemetry"] = f"could not start: {exc}"
            self.log(f"telemetry: could not start ({exc}); running without it")
        return governor, telemetry

    def _new_governor(self, budget: float):
        """A Governor for `budget`, or None when the budget is 0: the governor is off, probes never shed."""
        from llmobs.governor import Governor

        if budget == 0:
            self.log("governor: off (overhead.budget = 0): no probe is ever shed")
            return None
        return Governor(budget, log=self.log, cost_scale=self.config.cost_scale)

    def _set_budget(self, budget: float) -> None:
        """A reloaded overhead.budget: a new budget, or the governor turned off (its shed probes
        re-attached) or on (tracking every current target)."""
        if self.governor is not None and budget > 0:
            self._hook("governor", self.governor.set_budget, budget)
            return
        if self.governor is not None:
            self._hook("governor", self.governor.release_all)
            self.governor = None
            self.log("governor: off (overhead.budget = 0): every shed probe re-attached")
        elif budget > 0 and "llmobs.governor is not available" not in self.hook_errors.get("governor", ""):
            self.governor = self._hook("governor", self._new_governor, budget)
            for target in self.fleet.targets.values() if self.governor is not None else ():
                self._hook("governor", self.governor.track, target.session)
        if self.telemetry is not None:
            self.telemetry.governor = self.governor

    def _govern(self, now: float) -> None:
        """One governor tick (it logs each shed/restore decision) and one self-telemetry sample, handed to
        `top` through every target's snapshot and to OTLP as the llmobs.agent.* metrics."""
        if self.governor is not None:
            self._hook("governor", self.governor.tick, now)
        if self.telemetry is None:
            return
        self.last_sample = self._hook("telemetry", self.telemetry.sample)
        if self.last_sample is None:
            return
        from llmobs.governor.telemetry import agent_metrics, top_fields

        for pid, target in self.fleet.targets.items():
            state = self._hook("governor", self.governor.target_state, pid) if self.governor else None
            target.pipeline.live.agent = self._hook("telemetry", top_fields, self.last_sample, state)
        if self.exporter is not None:
            self._hook("telemetry", self.exporter.metrics.set_agent_metrics, agent_metrics(self.last_sample))

    def _hook(self, name: str, call: Callable, *args):
        """Calls into the governor/telemetry; a failure is logged once and never stops the daemon."""
        try:
            return call(*args)
        except Exception as exc:
            if name not in self.hook_errors:
                self.log(f"{name}: {type(exc).__name__}: {exc}")
            self.hook_errors[name] = str(exc)
            return None

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
        now = time.monotonic()
        next_scan = next_slow = now
        next_retention = now + RETENTION_EVERY_S
        next_watchdog = now
        while self._flags["stop"] is None:
            if self._flags["reload"]:
                self._flags["reload"] = False
                self._reload()
                next_scan = 0.0
            now = time.monotonic()
            if now >= next_scan:
                next_scan = now + self.config.discovery_interval_s
                self._discover()
            drained = self.fleet.poll()
            now = time.monotonic()
            if now >= next_slow:
                next_slow = now + SLOW_TICK_S
                self._slow_tick(now)
            if self.notifier.watchdog_s and now >= next_watchdog:
                next_watchdog = now + self.notifier.watchdog_s
                self.notifier.watchdog()
            if self.config.retention_age_s and now >= next_retention:
                next_retention = now + RETENTION_EVERY_S
                self._retention(by_size=False)
            busy = drained >= self._busy_events
            self._wait(DRAIN_PERIOD_S[not busy])

    def _discover(self) -> None:
        appeared, gone = self.watcher.scan()
        for proc in gone:
            target = self.fleet.targets.get(proc.pid)
            if target is not None and target.proc.key == proc.key:
                alive = target.session.target_alive()
                self._detach(proc.pid, "no longer selected" if alive else "exited")
        for proc in appeared:
            self._attach(proc)

    def _attach(self, proc: Proc) -> None:
        if len(self.fleet.targets) >= self.config.max_targets:
            self._refuse(proc, f"daemon.max_targets = {self.config.max_targets} reached")
            return
        try:
            target = self.fleet.add(proc)
        except LlmobsError as exc:
            self._refuse(proc, str(exc))
            return
        except Exception as exc:  # a bug or a kernel refusal: one line, the daemon goes on
            self._refuse(proc, f"{type(exc).__name__}: {exc}")
            return
        session = target.session
        probes = ",".join(p.name for p in session.attached_probes)
        skipped = "".join(f"; skipped {s.probe.name}: {s.reason}" for s in session.skipped)
        tag = "map" if session.cell_address else "no map yet: events untagged until it appears"
        refused = None if session.cell_address else self._hook("map check", _map_refusal, session)
        if refused:  # a map that fails the reader's owner/mode checks: never used to tag events
            tag = f"map refused, events untagged: {refused}"
        self._write_status()  # before the line: whoever reads the line finds the status current
        self.log(
            f"attach pid {proc.pid} ({_short(proc.command)}) [{proc.why}, {tag}]: {probes}"
            f" in {session.stats.attached_after_s:.2f} s{skipped}"
        )
        if self.governor is not None:
            self._hook("governor", self.governor.track, session)
        if self.telemetry is not None:
            self._hook("telemetry", self.telemetry.track_session, session)
            self._hook("telemetry", self.telemetry.track_pipeline, target.pipeline)

    def _refuse(self, proc: Proc, reason: str) -> None:
        self.watcher.refuse(proc, reason)
        if proc.key not in self._logged_refusals:  # once per process, not every recheck
            self._logged_refusals.add(proc.key)
            self.log(f"skip pid {proc.pid} ({_short(proc.command)}): {reason}")

    def _detach(self, pid: int, reason: str) -> Detached | None:
        target = self.fleet.targets.get(pid)
        if target is None:
            return None
        if self.governor is not None:
            self._hook("governor", self.governor.untrack, target.session)
        detached = self.fleet.remove(pid, reason)
        if self.telemetry is not None:
            self._hook("telemetry", self.telemetry.untrack_session, target.session, detached.final)
            self._hook("telemetry", self.telemetry.untrack_pipeline, target.pipeline)
        self.watcher.forget(pid)  # a process still selected (probes reconfigured) is found again
        self.detached_total += 1
        self._write_status()
        self._log_detach(detached)
        return detached

    def _log_detach(self, detached: Detached) -> None:
        target, summary = detached.target, detached.summary
        steps = summary.steps_read if summary else 0
        problems = detached.final.get("problems") or []
        stored = f"{summary.committed_rows:,} rows committed" if summary else "pipeline failed"
        self.log(
            f"detach pid {target.proc.pid} ({_short(target.proc.command)}): {detached.reason}; "
            f"{target.events:,} events, {steps:,} token steps, {stored}"
            + (f"; problems: {'; '.join(problems)}" if problems else "")
        )

    def _slow_tick(self, now: float) -> None:
        for pid, target in list(self.fleet.targets.items()):
            if not target.session.target_alive():
                self._detach(pid, "exited")
        self._govern(now)
        self._write_status()
        self.notifier.status(self._status_text())

    # ---- status -----------------------------------------------------------------------------------
    def _status_text(self) -> str:
        targets = self.fleet.targets if self.fleet else {}
        return f"{len(targets)} target(s): " + (" ".join(str(pid) for pid in targets) or "waiting")

    def status(self) -> dict:
        """The daemon-wide status (written to RUN_DIR/daemon.json once a second)."""
        fleet = self.fleet
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
            "targets": [_target_row(t) for t in fleet.targets.values()] if fleet else [],
            "counters": fleet.counters() if fleet else {},
            "discovery": dataclasses.asdict(self.watcher.stats) if self.watcher else {},
            "reloads": self.reloads,
            "reload_errors": self.reload_errors,
            "last_reload_error": self.last_reload_error,
            "detached": self.detached_total,
            "hooks_missing_or_failed": dict(self.hook_errors),
        }
        if self.governor is not None:
            data["governor"] = self._hook("governor", self.governor.snapshot)
        if self.last_sample is not None:
            data["telemetry"] = self.last_sample
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
            for pid in list(self.fleet.targets):
                self._detach(pid, "probes reconfigured")
            self.fleet.close()
            self.fleet = self._new_fleet(new)
            self.watcher.tracked.clear()
        if any(k in SELECT_KEYS for k in live):
            self.watcher.set_selectors(Selectors.of(new), new.recheck_s)
            self._logged_refusals.clear()
        if "overhead.budget" in live:
            self._set_budget(new.overhead_budget)
        if "overhead.cost_scale" in live and self.governor is not None:
            self.governor.cost_scale = new.cost_scale
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
        if self.fleet is not None:
            for pid in list(self.fleet.targets):
                self._detach(pid, f"agent stopping ({self._flags['stop'] or 'error'})")
            self.fleet.close()
        if self.exporter is not None:
            counters = self.exporter.finish()
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
    session, pipeline = target.session, target.pipeline
    return {
        "pid": target.proc.pid,
        "start_ticks": target.proc.start_ticks,
        "command": target.proc.command,
        "why": target.proc.why,
        "uid": target.proc.uid,
        "probes": [p.name for p in session.attached_probes],
        "uprobe_events": len(session.attached.uprobe_events),
        "tagged": bool(session.cell_address),
        "attached_s": round(time.monotonic() - target.attached_at, 3),
        "events": target.events,
        "token_steps": pipeline.shm.steps,
        "drops": pipeline.drops(),
    }
