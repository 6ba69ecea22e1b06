"""Fleet: the daemon's targets sharing ONE loaded BPF program, one ring and one DuckDB store.

Why one program: an uncached program takes ~1 s of a core to compile (bpf/loader.py), and every loaded
program holds its own maps (a 16 MiB ring, a 64 k-entry aggregates hash). The program keys its targets
by pid slot, its aggregates by (pid, probe, step), and every event carries its pid, so one program can
serve many processes: uprobes are attached per pid (a uprobe is per file offset and process), the
tracepoints of the host profile once for the whole fleet (a tracepoint sees every process; the program
ignores pids that are not targets). The runtime (llmobs.runtime.Agent) drains the fleet's ring once per
tick and hands each target's pipeline its own events; each target's AttachSession (Options.shared) owns
only its uprobes and its pid's totals. Each target has its own Pipeline (map reader, store writer
thread, correlator) on the one shared DuckDBStore, whose appends are serialised by the store's lock;
correlators use cursors. The fleet itself only builds: the program, its tracepoints, each target.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from llmobs.bpf.profiles import Probe, probes_of
from llmobs.bpf.program import Attached, ProbeProgram
from llmobs.bpf.records import RING_RECORD_DTYPE
from llmobs.bpf.ringbuf import RingConsumer
from llmobs.bpf.session import AttachSession, Options, tracepoint_available
from llmobs.daemon.discovery import Proc
from llmobs.diagnostics.detectors import DetectorConfig
from llmobs.errors import LlmobsError, MissingLibrary, NoSuchProcess
from llmobs.pipeline import Pipeline
from llmobs.pipeline.live import snapshot_path


class Fleet:
    def __init__(self, options: Options, store, run_dir: Path, log: Callable[[str], None] = lambda _: None,
                 detector: DetectorConfig | None = DetectorConfig(),  # noqa: B008 (frozen)
                 replay=None):  # fmt: skip
        self.options = replace(options, shared=True, require_pytorch=False)
        self.detector = detector  # every target's loss-anomaly detectors (the daemon's detector.* keys)
        self.replay = replay  # every target's automatic replays (replay.*: ReplayOptions, None off)
        self.store = store
        self.run_dir = run_dir
        self.log = log
        self.program: ProbeProgram | None = None
        self.ring: RingConsumer | None = None
        self.global_probes: list[Probe] = []  # the tracepoints, attached once
        self.skipped: dict[str, str] = {}  # probe -> why the fleet could not offer it
        self._global = Attached()

    # ---- program ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Compiles the program with every probe of the profiles this kernel offers, and attaches the
        tracepoints. Uprobes are compiled in even when no process has their library yet."""
        probes = []
        for probe in probes_of(self.options.profiles):
            missing = next(filter(None, (tracepoint_available(tp) for tp, _ in probe.tracepoints)), None)
            if missing:
                self.skipped[probe.name] = missing
            else:
                probes.append(probe)
        try:
            self.program = ProbeProgram(probes)
        except LlmobsError:
            raise  # the loader's own one-line errors (a compile or verifier refusal), said as they are
        except Exception as exc:  # anything else the kernel or the cache threw
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise MissingLibrary(f"cannot compile or load the BPF program: {first}") from exc
        self.program.reset_maps()
        self.program.set_sampling(self.options.sample_n, self.options.sample_mode, self.options.thin)
        self.ring = RingConsumer(self.program.map_fd("llmobs_events"), self.program.ring_bytes)
        for probe in probes:
            if probe.hook != "tracepoint":
                continue
            try:
                self.program.attach_tracepoints(probe, self._global)
                self.global_probes.append(probe)
            except Exception as exc:  # one tracepoint failing must not stop the daemon
                self.skipped[probe.name] = f"attach failed: {exc}"

    def program_ids(self) -> dict[str, int]:
        """BPF program name -> kernel program id of every loaded function (bpftool shows them)."""
        if self.program is None:
            return {}
        with contextlib.suppress(OSError):
            return self.program.prog_ids()
        return {}

    @property
    def ring_records(self) -> int:
        """How many events the shared ring holds when full."""
        return self.program.ring_bytes // RING_RECORD_DTYPE.itemsize if self.program else 0

    # ---- targets ----------------------------------------------------------------------------------
    def open_target(self, proc: Proc) -> tuple[AttachSession, Pipeline]:
        """Attaches proc's uprobes on the shared program and opens its pipeline. Raises the session's
        typed errors (NotTracked, NothingAttached, NoSuchProcess, ...) with nothing left attached."""
        session = AttachSession(proc.pid, self.options, program=self.program)
        session.start()
        try:
            if session.procfs.start_time_ticks(proc.pid) != proc.start_ticks:
                raise NoSuchProcess(f"pid {proc.pid} exited and was reused before it was attached")
            pipeline = Pipeline(
                self.store,
                proc.pid,
                session=session,
                sample_ratio=self.options.sample_n,
                thin=self.options.thin,
                snapshot=snapshot_path(proc.pid, self.run_dir),
                detector=self.detector,
                replay=self.replay,
            )
        except BaseException:
            session.close()
            raise
        session.attached_probes.extend(p for p in self.global_probes if p not in session.attached_probes)
        return session, pipeline

    def counters(self) -> dict[str, int]:
        """The program-wide kernel counters (ring drops, aggregate overflow, ...) and ours."""
        from llmobs.bpf.records import COUNTERS

        raw = self.program.counters() if self.program else {}
        named = {name: raw.get(i, 0) for i, name in enumerate(COUNTERS)}
        named["ring_records"] = self.ring.records if self.ring else 0
        return named

    def close(self) -> None:
        """Detaches the tracepoints and unloads the program (the runtime removed the targets first)."""
        if self.program is not None:
            problems = self.program.detach(self._global)
            for problem in problems:
                self.log(f"detach problem: {problem}")
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self.program is not None:
            self.program.close()
            self.program = None
