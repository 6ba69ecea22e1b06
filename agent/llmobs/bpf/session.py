"""One attach session: checks the target, resolves and attaches the probes, drains the ring, keeps
the exact totals, watches the target, and detaches everything it attached.

The caller drives it: `start()`, then `poll()` every ~20 ms (returns the decoded sample batch), then
`close()` (idempotent) which detaches first and reads the final totals after.

With `Options.shared` the session is one target of a daemon's fleet (llmobs.daemon.fleet): the program,
its ring and the global tracepoints belong to the fleet, which drains the ring once for all targets and
hands each session its own events (`poll(events)`); the session attaches only its pid's uprobes and
harvests only its pid's totals.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
import time
from dataclasses import dataclass, field

import numpy as np

from llmobs.bpf import aggregates
from llmobs.bpf.cleanup import remove_stale_uprobes
from llmobs.bpf.libraries import ResolvedProbe, Skipped, mapped_libraries, resolve
from llmobs.bpf.profiles import Probe, probes_of
from llmobs.bpf.program import Attached, ProbeProgram, ctx_offset
from llmobs.bpf.records import COUNTERS, DEFAULT_THIN, EVENT_DTYPE, RING_RECORD_DTYPE
from llmobs.bpf.ringbuf import DrainPacer, RingConsumer
from llmobs.bpf.thread_records import find_thread_registry
from llmobs.errors import AccessDenied, NothingAttached, NotTracked
from llmobs.procfs import MapEntry, ProcFS
from llmobs.rerun import as_root_hint
from llmobs.shm.layout import FILE_MODE

TRACEFS = "/sys/kernel/tracing"
_CAP_SYS_ADMIN, _CAP_PERFMON, _CAP_BPF = 21, 38, 39
REFRESH_S = 1.0  # how often the watched fds and the aggregate harvest are refreshed
# /proc/PID/maps of a torch process is thousands of lines: re-read every second only until the map
# is found, then every 10 s (to notice a re-created map)
MAPS_REFRESH_S = (1.0, 10.0)
# One BPF_MAP_LOOKUP_BATCH of the per-CPU aggregates map walks all its buckets: ~1-2 ms, whatever it
# holds. The harvest, the governor, the self-telemetry and the status line each want it once a second:
# they share one reading this fresh (live_totals at close always reads anew).
AGGREGATES_FRESH_S = 0.5
_NO_EVENTS = np.empty(0, dtype=EVENT_DTYPE)  # a wake that left a sparse ring undrained


def _own_age_s(procfs: ProcFS) -> float:
    """Seconds since this (the agent's) process started: attach latency counts from there."""
    try:
        started = procfs.start_time_ticks(os.getpid()) / os.sysconf("SC_CLK_TCK")
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 0.0)
    except Exception:
        return 0.0


def bpf_capable(procfs: ProcFS) -> bool:
    """Whether this process's effective set can load and attach: CAP_SYS_ADMIN, or CAP_BPF + CAP_PERFMON."""
    caps = procfs.effective_caps("self")
    return bool(caps & (1 << _CAP_SYS_ADMIN) or (caps & (1 << _CAP_BPF) and caps & (1 << _CAP_PERFMON)))


def require_privileges(procfs: ProcFS) -> None:
    """Root, or CAP_BPF + CAP_PERFMON (or CAP_SYS_ADMIN), else AccessDenied."""
    if os.geteuid() == 0 or bpf_capable(procfs):
        return
    raise AccessDenied("attaching eBPF probes needs root (or CAP_BPF and CAP_PERFMON)", hint=as_root_hint())


def _llmobs_map_entry(pid: int, entries: list[MapEntry]) -> MapEntry | None:
    """The mapping of the process's llmobs map (None when it publishes none)."""
    own = [e for e in entries if e.path == f"/dev/shm/llmobs.{pid}" and e.offset == 0]
    if not own:
        own = [e for e in entries if re.fullmatch(r"/dev/shm/llmobs\.\d+", e.path) and e.offset == 0]
        if len(own) != 1:
            return None
    return own[0]


def map_file_refusal(pid: int, entry: MapEntry, proc_root: str = "/proc") -> str | None:
    """Why the mapped llmobs file must not be trusted for tagging events (None: it may be).

    The map reader's checks (llmobs.shm.reader.ShmReader): a regular file, mode 0600, owned by the
    process's uid - else another user could have written it, and the trace ids the handlers copy from its
    context cell would be theirs. The file is stat'ed through /proc/PID/map_files (the very inode mapped,
    whatever the process's mount namespace), else through /proc/PID/root.
    """
    try:
        owner = os.stat(f"{proc_root}/{pid}").st_uid
    except OSError:
        return f"process {pid} exited"
    for where in (
        f"{proc_root}/{pid}/map_files/{entry.start:x}-{entry.end:x}",
        f"{proc_root}/{pid}/root{entry.path}",
    ):
        try:
            st = os.stat(where)
            break
        except OSError:
            continue
    else:
        return f"cannot check {entry.path} (no access to /proc/{pid}/map_files or /proc/{pid}/root)"
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISREG(st.st_mode):
        return f"{entry.path} is not a regular file"
    if mode != FILE_MODE:
        return f"{entry.path} has mode {mode:04o}, a map must be 0600"
    if st.st_uid != owner:
        return f"{entry.path} is owned by uid {st.st_uid} but process {pid} runs as uid {owner}"
    return None


def context_cell_refusal(pid: int, entries: list[MapEntry], proc_root: str = "/proc") -> str | None:
    """Why the process's llmobs map was not used to tag events (None: it was, or there is none)."""
    entry = _llmobs_map_entry(pid, entries)
    return None if entry is None else map_file_refusal(pid, entry, proc_root)


def find_context_cell(pid: int, entries: list[MapEntry], offset: int, proc_root: str = "/proc") -> int:
    """Address of the current-context cell in the target (0 when the process publishes no map, or one that
    fails the map reader's owner/mode checks: its events are then untracked, see context_cell_refusal).

    The writer maps /dev/shm/llmobs.<pid> whole from offset 0; inside a pid namespace <pid> is the
    process's own pid, so a single llmobs map under another number is accepted too.
    """
    entry = _llmobs_map_entry(pid, entries)
    if entry is None or entry.end - entry.start <= offset or map_file_refusal(pid, entry, proc_root):
        return 0
    return entry.start + offset


def tracepoint_available(tracepoint: str) -> str | None:
    """None when the tracepoint exists, else why not."""
    category, name = tracepoint.split(":")
    if not os.path.isdir(os.path.join(TRACEFS, "events")):
        return f"tracefs is not mounted at {TRACEFS} (mount -t tracefs nodev {TRACEFS})"
    if not os.path.isdir(os.path.join(TRACEFS, "events", category, name)):
        return f"this kernel has no tracepoint {tracepoint}"
    return None


@dataclass
class Options:
    profiles: tuple[str, ...] = ("cpu", "host")
    sample_n: int = 1
    sample_mode: str = "trace"
    thin: int = DEFAULT_THIN  # probes.thin: the thinned probes ship 1 in this many tagged events
    ioctl_paths: str = "/dev/nvidia*"  # glob of the device files whose ioctls the host profile times
    require_pytorch: bool = True
    gemm_durations: bool = False  # time the probes whose duration is optional (sgemm): ~2x their cost
    # one target of a fleet: the ring, the maps' reset, the sampling knobs and the tracepoints are the
    # fleet's (a tracepoint sees every process, so it is attached once for all targets)
    shared: bool = False
    # measure each uprobe's per-hit cost before attaching (llmobs.bpf.calibrate; ~0.1 s, once per
    # agent process): what the overhead governor weighs hit rates with
    calibrate: bool = False


@dataclass
class Stats:
    started_at: float = field(default_factory=time.monotonic)
    attached_after_s: float | None = None
    first_event_after_s: float | None = None
    sampled: int = 0
    user_drops: int = 0
    polls: int = 0
    decode_seconds: float = 0.0


class AttachSession:
    def __init__(
        self, pid: int, options: Options, program: ProbeProgram | None = None, procfs: ProcFS | None = None
    ):
        self.pid = pid
        self.options = options
        self.procfs = procfs or ProcFS()
        self.program = program
        self._owns_program = program is None
        self.attached = Attached()
        self.resolved: list[ResolvedProbe] = []
        self.attached_probes: list[Probe] = []
        self.skipped: list[Skipped] = []
        self.notes: list[str] = []
        self.stats = Stats()
        self.cell_address = 0
        self.threads_address = 0  # the thread-context registry (bpf/thread_records.py), 0: none
        self.totals = aggregates.Totals()
        self._start_ticks = 0
        self._ring: RingConsumer | None = None
        self._drains = DrainPacer()  # a sparse ring is drained about once a second (bpf/ringbuf.py)
        self._next_refresh = 0.0
        self._next_maps = 0.0
        self._ncpus = 1
        self._live: tuple[float, np.ndarray, np.ndarray] | None = None  # (read at, keys, values)
        self._counters: tuple[float, dict[int, int]] | None = None  # (read at, the kernel's counters)
        self._closed = False
        self._final: dict | None = None
        self.process_age_at_start_s = _own_age_s(self.procfs)
        self.calibration: dict = {}  # probe name -> llmobs.bpf.calibrate.ProbeCost
        self._uprobe_events: dict[str, list] = {}  # probe name -> its uprobe events, for shedding
        self.shed: dict[str, float] = {}  # probe name -> monotonic time the governor detached it

    # ---- start ------------------------------------------------------------------------------------------
    def check_target(self) -> list[MapEntry]:
        self.procfs.require(self.pid)
        require_privileges(self.procfs)
        entries = self.procfs.maps(self.pid)
        if self.options.require_pytorch and not any(
            re.match(r"libc10(-[0-9a-f]+)?\.so", os.path.basename(e.path)) for e in entries
        ):
            comm = self.procfs.comm(self.pid)
            raise NotTracked(
                f"pid {self.pid} ({comm}) is not a PyTorch process: no libc10 in /proc/{self.pid}/maps"
            )
        self._start_ticks = self.procfs.start_time_ticks(self.pid)
        return entries

    def plan(self, entries: list[MapEntry]) -> list[Probe]:
        """Resolves the profiles' probes into self.resolved / self.skipped; returns the loadable ones."""
        paths = mapped_libraries(entries)
        loadable = []
        for probe in probes_of(self.options.profiles):
            if probe.hook == "uprobe":
                result = resolve(probe, self.pid, paths, self.procfs)
                if isinstance(result, Skipped):
                    self.skipped.append(result)
                    continue
                self.resolved.append(result)
            else:
                missing = next(filter(None, (tracepoint_available(tp) for tp, _ in probe.tracepoints)), None)
                if missing:
                    self.skipped.append(Skipped(probe, missing))
                    continue
            loadable.append(probe)
        return loadable

    def start(self) -> None:
        entries = self.check_target()
        loadable = self.plan(entries)
        if not loadable:
            raise NothingAttached(self._nothing_message())
        removed = remove_stale_uprobes()
        if removed:
            self.notes.append(f"removed {len(removed)} uprobe event(s) a killed agent left in tracefs")
        if self.program is None:
            self.program = ProbeProgram(loadable)
        program = self.program
        available = {probe.name for probe in program.probes}
        if not self.options.shared:  # the fleet set its program's; calibration measures under them
            program.set_sampling(self.options.sample_n, self.options.sample_mode, self.options.thin)
        if self.options.calibrate:  # before the reset and drain below, which discard its own events
            self._calibrate(program, available)
        if not self.options.shared:
            program.reset_maps()
            self._ring = RingConsumer(program.map_fd("llmobs_events"), program.ring_bytes)
            self._ring.drain()  # leftovers of a previous session of a reused program
        self.cell_address = find_context_cell(self.pid, entries, ctx_offset())
        self.threads_address = find_thread_registry(self.pid, entries) if self.cell_address else 0
        program.set_target(self.pid, self.cell_address, self.threads_address)
        self._ncpus = program.maps["llmobs_aggs"].ncpus  # 1: a plain hash (bpf/c/llmobs_events.h)
        try:
            by_name = {r.probe.name: r for r in self.resolved}
            for probe in loadable:
                if probe.name not in available:
                    self.skipped.append(Skipped(probe, "not compiled into the reused program"))
                    continue
                try:
                    if probe.hook == "uprobe":
                        before = len(self.attached.uprobe_events)
                        try:
                            program.attach_uprobe(
                                by_name[probe.name], self.pid, self.attached, self.options.gemm_durations
                            )
                        finally:
                            self._uprobe_events[probe.name] = self.attached.uprobe_events[before:]
                    elif self.options.shared:
                        pass  # attached once by the fleet; it sees this pid once set_target ran
                    else:
                        program.attach_tracepoints(probe, self.attached)
                    self.attached_probes.append(probe)
                except Exception as exc:  # one probe failing must not stop the others
                    self.skipped.append(Skipped(probe, f"attach failed: {exc}"))
            if not self.attached_probes:
                raise NothingAttached(self._nothing_message())
            self._refresh(force=True)
        except BaseException:
            self.close()
            raise
        self.stats.attached_after_s = time.monotonic() - self.stats.started_at

    def _calibrate(self, program: ProbeProgram, available: set[str]) -> None:
        from llmobs.bpf.calibrate import calibrate

        uprobes = [r for r in self.resolved if r.probe.name in available]
        try:
            self.calibration = calibrate(program, uprobes, self.options.gemm_durations)
        except Exception as exc:  # the governor then estimates with documented defaults
            self.notes.append(f"probe cost calibration failed: {exc}")

    def _nothing_message(self) -> str:
        reasons = "; ".join(f"{s.probe.name}: {s.reason}" for s in self.skipped[:4])
        return (
            f"no probe of profile(s) {','.join(self.options.profiles)} attached to pid {self.pid} ({reasons})"
        )

    # ---- running ----------------------------------------------------------------------------------------
    @property
    def ring_records(self) -> int:
        """How many events the ring holds when full."""
        return self.program.ring_bytes // RING_RECORD_DTYPE.itemsize if self.program else 0

    def target_alive(self) -> bool:
        try:
            self.procfs.require(self.pid)
            return self.procfs.start_time_ticks(self.pid) == self._start_ticks
        except Exception:
            return False

    def poll(self, events: np.ndarray | None = None) -> np.ndarray:
        """Drains the ring (one numpy batch) when its drain is due (DrainPacer: a sparse ring about once a
        second), and refreshes slow-moving state once a second. A shared session is handed its events (the
        fleet drained the ring) and returns them."""
        if events is None:
            assert self._ring is not None
            if self._drains.due(self._ring, time.monotonic(), eager=self.stats.first_event_after_s is None):
                began = time.perf_counter()
                events = self._ring.drain()
                self.stats.decode_seconds += time.perf_counter() - began
            else:
                events = _NO_EVENTS
        self.stats.polls += 1
        if len(events):
            self.stats.sampled += len(events)
            if self.stats.first_event_after_s is None:
                self.stats.first_event_after_s = time.monotonic() - self.stats.started_at
        self._refresh()
        return events

    def _refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_refresh:
            return
        self._next_refresh = now + REFRESH_S
        try:
            if force or now >= self._next_maps:
                self._next_maps = now + MAPS_REFRESH_S[bool(self.cell_address)]
                # the map (/dev/shm/llmobs.N) and the thread-context library (libllmobs_...) are all
                # these look for
                entries = self.procfs.maps(self.pid, containing="llmobs")
                address = find_context_cell(self.pid, entries, ctx_offset())
                threads = find_thread_registry(self.pid, entries) if address else 0
                # the map or the thread-context library appeared (or changed) after we attached
                if address != self.cell_address or threads != self.threads_address:
                    self.cell_address, self.threads_address = address, threads
                    self.program.set_target(self.pid, address, threads)
            if any(p.name == "ioctl" for p in self.attached_probes):
                pattern = self.options.ioctl_paths
                fds = self.procfs.fds(self.pid)
                self.program.set_watched_fds(
                    self.pid, {fd for fd, path in fds.items() if fnmatch.fnmatch(path, pattern)}
                )
        except Exception:
            return  # the target is going away; the caller notices through target_alive()
        self._harvest()

    def _harvest(self) -> None:
        """Moves the totals of finished steps out of the bounded kernel map."""
        keys, values = self._read_aggregates()
        done = aggregates.finished(keys)
        if done.any():
            self.totals.add(keys[done], values[done])
            aggregates.delete_keys(None, self.program.map_fd("llmobs_aggs"), keys[done])
            if self._live is not None:  # the shared reading less what moved into the totals
                self._live = (self._live[0], keys[~done], values[~done])

    def _recent_aggregates(self) -> tuple[np.ndarray, np.ndarray]:
        """The live aggregates, read at most every AGGREGATES_FRESH_S (the once-a-second readers)."""
        now = time.monotonic()
        if self._live is None or now - self._live[0] >= AGGREGATES_FRESH_S:
            keys, values = self._read_aggregates()
            self._live = (now, keys, values)
        return self._live[1], self._live[2]

    def _read_aggregates(self) -> tuple[np.ndarray, np.ndarray]:
        keys, values = aggregates.read_totals(
            self.program.map_fd("llmobs_aggs"), self.program.agg_entries, self._ncpus
        )
        if self.options.shared:  # the map holds every target's totals: take only this pid's
            mine = keys["pid"] == self.pid
            keys, values = keys[mine], values[mine]
        self._live = (time.monotonic(), keys, values)
        return keys, values

    def counters(self) -> dict[str, int]:
        """The kernel's counters (drops, overflows), from a reading at most AGGREGATES_FRESH_S old: the
        once-a-second readers (the snapshot's drops, the self-telemetry, the status line) share one
        bpf syscall a second instead of one each (~0.3 ms each on this VM). Close reads them anew."""
        now = time.monotonic()
        if self._counters is None or now - self._counters[0] >= AGGREGATES_FRESH_S:
            self._counters = (now, self.program.counters() if self.program else {})
        return self._named_counters(self._counters[1])

    def _named_counters(self, raw: dict[int, int]) -> dict[str, int]:
        named = {name: raw.get(i, 0) for i, name in enumerate(COUNTERS)}
        named["user_drops"] = self.stats.user_drops
        return named

    def live_totals(self) -> dict[tuple[int, int, int], list[int]]:
        keys, values = self._read_aggregates()
        return self.totals.merged(keys, values)

    def probe_counts(self) -> dict[tuple[int, int], int]:
        """(pid, probe) -> events counted so far (harvested + live): live_totals summed over steps, in
        O(probes + live keys) (the once-a-second readers: the governor, the self-telemetry), from a
        reading at most AGGREGATES_FRESH_S old."""
        keys, values = self._recent_aggregates()
        return self.totals.counts(keys, values)

    def totals_overview(self) -> tuple[int, int, int]:
        """(events, distinct steps, newest step) so far, without merging every step (the status line)."""
        keys, values = self._recent_aggregates()
        return self.totals.overview(keys, values)

    # ---- the overhead governor: one uprobe off and on again ---------------------------------------------
    def shed_probe(self, name: str) -> bool:
        """Detaches the uprobe(s) of probe `name` for this pid, leaving every other probe attached. What it
        counted so far stays in the exact totals. False when `name` is not an attached uprobe."""
        events = self._uprobe_events.get(name)
        if not events or name in self.shed or self._closed:
            return False
        problems = self.program.detach(Attached(uprobe_events=list(events)))
        self.attached.uprobe_events = [ev for ev in self.attached.uprobe_events if ev not in events]
        self._uprobe_events[name] = []
        self.notes.extend(f"shedding {name}: {problem}" for problem in problems)
        self.shed[name] = time.monotonic()
        return True

    def restore_probe(self, name: str) -> bool:
        """Re-attaches a probe `shed_probe` detached, at the same site. False when it was not shed."""
        if name not in self.shed or self._closed:
            return False
        resolved = next(r for r in self.resolved if r.probe.name == name)
        attached = Attached()
        try:
            self.program.attach_uprobe(resolved, self.pid, attached, self.options.gemm_durations)
        finally:  # whatever did attach is recorded, so close() or a later shed removes it
            self.attached.uprobe_events.extend(attached.uprobe_events)
            self._uprobe_events[name] = list(attached.uprobe_events)
        del self.shed[name]
        return True

    # ---- stop -------------------------------------------------------------------------------------------
    def _forget_pid(self) -> None:
        """Deletes this pid's keys from the shared aggregates map and its watched ioctl fds."""
        try:
            keys, _values = self._read_aggregates()
            aggregates.delete_keys(None, self.program.map_fd("llmobs_aggs"), keys)
            self.program.set_watched_fds(self.pid, set())
        except Exception as exc:  # best effort: a stale key is bounded and harmless
            self.notes.append(f"could not clear pid {self.pid}'s map entries: {exc}")

    def close(self) -> tuple[np.ndarray, dict]:
        """Detaches everything, drains the rest, reads the final totals. Returns (last events, final)."""
        if self._closed:
            return np.empty(0), self._final or {}
        self._closed = True
        problems = self.program.detach(self.attached) if self.program else []
        events = self._ring.drain() if self._ring else np.empty(0)
        self.stats.sampled += len(events)
        if len(events) and self.stats.first_event_after_s is None:
            self.stats.first_event_after_s = time.monotonic() - self.stats.started_at
        final = {"problems": problems, "totals": {}, "counters": {}}
        if self.program is not None and (self._ring is not None or self.options.shared):
            final["totals"] = self.live_totals()
            final["counters"] = self._named_counters(self.program.counters())
            self.program.remove_target(self.pid)
            if self.options.shared:  # the program lives on: leave none of this pid's state in its maps
                self._forget_pid()
        if self._ring:
            self._ring.close()
        if self._owns_program and self.program is not None:
            self.program.close()
        self._final = final
        return events, final
