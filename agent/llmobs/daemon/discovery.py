"""ProcWatcher: finds the processes the daemon should attach to, and notices when they are gone.

A process qualifies when it publishes an llmobs map (/dev/shm/llmobs.<pid>) or has libtorch (libc10,
libtorch_cpu) or libcuda mapped, AND it matches the selectors (effective uid, cgroup path glob, command
line regex). A process is identified by (pid, start time), so a reused pid is a new process.

Why it is cheap: a host has hundreds of processes and a torch process's /proc/PID/maps is thousands of
lines. Each scan lists /proc and reads one `stat` per pid (the start time); only pids not seen before
are examined, cheapest test first (uid, cgroup, command line, then a stat of the map file, and only
then the maps text). A process that did not qualify is examined again only after `recheck_s`, since it
may load torch (or be moved to another cgroup) later.
"""

from __future__ import annotations

import fnmatch
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmobs.errors import LlmobsError
from llmobs.procfs import ProcFS
from llmobs.shm.layout import SHM_DIR

# the libraries that make a process worth attaching to, by basename (wheels may add a hash)
_TORCH_OR_CUDA = re.compile(r"/lib(c10|torch_cpu|torch|cuda)(-[0-9a-f]+)?\.so[^/\n]*$", re.M)

# a process younger than this that does not qualify is examined again at the next scan, not after
# recheck_s: a PyTorch program maps libtorch a second or more after it starts (the import)
YOUNG_S = 10.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Selectors:
    users: tuple[int, ...] = ()  # effective uids; empty: any
    cgroup: str = ""  # fnmatch glob over any of the process's cgroup paths; empty: any
    command: str = ""  # regex searched in the command line (arguments joined by spaces); empty: any

    @classmethod
    def of(cls, config) -> Selectors:
        return cls(tuple(config.users), config.cgroup, config.command)

    def describe(self) -> str:
        parts = [
            f"users {','.join(map(str, self.users))}" if self.users else "",
            f"cgroup {self.cgroup}" if self.cgroup else "",
            f"command /{self.command}/" if self.command else "",
        ]
        return "; ".join(p for p in parts if p) or "every process"

    def accepts_exited_uid(self, uid: int) -> bool:
        """Whether a process that is gone, known only by its map's owner, would have been selected: its
        command line and cgroup went with it, so with those selectors set its map is never ingested."""
        return not self.cgroup and not self.command and (not self.users or uid in self.users)


@dataclass(frozen=True)
class Proc:
    """One qualifying process, as found."""

    pid: int
    start_ticks: int
    uid: int
    cgroup: str
    command: str
    why: str  # "map", "libtorch" or "libcuda"

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start_ticks)


@dataclass
class WatchStats:
    scans: int = 0
    examined: int = 0  # processes looked at in detail (selectors read)
    maps_read: int = 0  # /proc/PID/maps texts read: the costly part
    rejected: int = 0


@dataclass
class _Rejected:
    start_ticks: int
    recheck_at: float
    reason: str


class ProcWatcher:
    """Scans /proc (any root) and reports the qualifying processes that appeared and those now gone."""

    def __init__(
        self,
        selectors: Selectors,
        procfs: ProcFS | None = None,
        shm_dir: str = SHM_DIR,
        recheck_s: float = 30.0,
        young_s: float = YOUNG_S,
        exclude: tuple[int, ...] | None = None,
        now: Callable[[], float] = time.monotonic,
    ):
        self.selectors = selectors
        self.procfs = procfs or ProcFS()
        self.shm_dir = shm_dir
        self.recheck_s = recheck_s
        self.young_s = young_s
        self.exclude = set(exclude if exclude is not None else (os.getpid(),))
        self.now = now
        self.tracked: dict[int, Proc] = {}
        self.stats = WatchStats()
        self._rejected: dict[int, _Rejected] = {}
        self._recheck_tracked = False

    # ---- control ----------------------------------------------------------------------------------
    def set_selectors(self, selectors: Selectors, recheck_s: float | None = None) -> None:
        """New selectors (SIGHUP): tracked processes that no longer match are reported gone by the next
        scan, and every earlier refusal is examined again."""
        if recheck_s is not None:
            self.recheck_s = recheck_s
        if selectors != self.selectors:
            self.selectors = selectors
            self._rejected.clear()
            self._recheck_tracked = True

    def refuse(self, proc: Proc, reason: str) -> None:
        """The daemon could not attach: stop reporting it, look again after recheck_s."""
        self.tracked.pop(proc.pid, None)
        self._rejected[proc.pid] = _Rejected(proc.start_ticks, self.now() + self.recheck_s, reason)
        self.stats.rejected += 1

    def forget(self, pid: int) -> None:
        """Drop a tracked pid without reporting it gone (the daemon already detached it)."""
        self.tracked.pop(pid, None)

    def why_not(self, pid: int) -> str | None:
        """Why a pid was last refused (None when it was not)."""
        rejected = self._rejected.get(pid)
        return rejected.reason if rejected else None

    # ---- scanning ---------------------------------------------------------------------------------
    def pids(self) -> list[int]:
        try:
            return [int(name) for name in os.listdir(self.procfs.root) if name.isdigit()]
        except OSError:
            return []

    def scan(self) -> tuple[list[Proc], list[Proc]]:
        """(appeared, gone) since the last scan."""
        self.stats.scans += 1
        now = self.now()
        live: dict[int, int] = {}
        for pid in self.pids():
            if pid in self.exclude:
                continue
            try:
                live[pid] = self._start_ticks(pid)
            except (OSError, ValueError, IndexError):
                continue  # gone (or a kernel thread's odd stat) between the listing and the read
        gone = [p for pid, p in self.tracked.items() if live.get(pid) != p.start_ticks]
        if self._recheck_tracked:
            self._recheck_tracked = False
            gone += [p for p in self.tracked.values() if p not in gone and self._selected(p) is not None]
        for proc in gone:
            del self.tracked[proc.pid]
        for pid in [pid for pid, r in self._rejected.items() if live.get(pid) != r.start_ticks]:
            del self._rejected[pid]  # the rejected process exited (or its pid was reused)
        appeared = []
        for pid, start in live.items():
            if pid in self.tracked:
                continue
            rejected = self._rejected.get(pid)
            if rejected is not None and now < rejected.recheck_at:
                continue
            proc, reason = self._examine(pid, start)
            if proc is None:
                # a process only seconds old may still be importing torch: look again next scan
                later = 0.0 if self._age_s(start) < self.young_s else self.recheck_s
                self._rejected[pid] = _Rejected(start, now + later, reason)
                continue
            self._rejected.pop(pid, None)
            self.tracked[pid] = proc
            appeared.append(proc)
        return appeared, gone

    def _start_ticks(self, pid: int) -> int:
        """Field 22 of /proc/PID/stat with one read and no text decoding: this runs for every pid of the
        host on every scan (4x cheaper than ProcFS's general parse, measured by bench_discovery)."""
        fd = os.open(f"{self.procfs.root}/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.read(fd, 1024)
        finally:
            os.close(fd)
        # comm (field 2) may hold spaces and ')': the fields after the LAST ')' start at the state (3)
        return int(data[data.rindex(b")") + 2 :].split(None, 20)[19])

    def _age_s(self, start_ticks: int) -> float:
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / _CLK_TCK

    def _examine(self, pid: int, start: int) -> tuple[Proc | None, str]:
        """The process as a Proc when it qualifies, else (None, why not)."""
        self.stats.examined += 1
        try:
            command = " ".join(self.procfs.cmdline(pid))
            if not command:
                return None, "kernel thread or zombie (no command line)"
            uid = self.procfs.uids(pid)[1]
            cgroup = self._cgroup(pid)
            proc = Proc(pid, start, uid, cgroup, command, "")
            refused = self._selected(proc)
            if refused is not None:
                return None, refused
            why = self._why(pid)
        except (LlmobsError, OSError, ValueError) as exc:
            return None, f"unreadable: {exc}"
        if why is None:
            return None, "no llmobs map, no libtorch/libcuda mapped"
        return Proc(pid, start, uid, cgroup, command, why), ""

    def _selected(self, proc: Proc) -> str | None:
        """None when the process matches the selectors, else which selector refused it."""
        chosen = self.selectors
        if chosen.users and proc.uid not in chosen.users:
            return f"uid {proc.uid} is not selected"
        if chosen.cgroup and not any(
            fnmatch.fnmatchcase(path, chosen.cgroup) for path in proc.cgroup.split("\n") if path
        ):
            return f"cgroup {proc.cgroup.splitlines()[0] if proc.cgroup else '?'} does not match"
        if chosen.command and not re.search(chosen.command, proc.command):
            return "command line does not match"
        return None

    def _cgroup(self, pid: int) -> str:
        """The cgroup paths of the process, one per line ("0::/path" in cgroup v2: the path)."""
        try:
            text = (self.procfs.root / str(pid) / "cgroup").read_text()
        except FileNotFoundError:
            return ""
        paths = [line.split(":", 2)[2] for line in text.splitlines() if line.count(":") >= 2]
        return "\n".join(dict.fromkeys(paths))

    def _why(self, pid: int) -> str | None:
        if os.path.exists(os.path.join(self.shm_dir, f"llmobs.{pid}")):
            return "map"
        self.stats.maps_read += 1
        text = (self.procfs.root / str(pid) / "maps").read_text(errors="replace")
        found = {m.group(1) for m in _TORCH_OR_CUDA.finditer(text)}
        if "cuda" in found:
            return "libcuda"
        return "libtorch" if found else None
