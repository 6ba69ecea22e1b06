"""Reader presence: how a workload knows, at exit, that an agent on this host will still read its map.

An agent announces itself with a marker file `<shm dir>/llmobs-reader.<agent pid>` holding its start
time (/proc/PID/stat field 22, so a reused pid does not count). A workload that exits with token steps
no reader has caught up with leaves its map for the agent only while such a marker names a live agent;
with no agent on the host nobody would ever read the map, so it is removed at exit as always.

The marker is not part of the map's binary layout (docs/shm-abi.md, *Maps left at exit*). The workload
side only reads markers, with a bounded number of syscalls, and never raises.
"""

from __future__ import annotations

import contextlib
import os
import threading

from llmobs.shm import layout
from llmobs.shm.identity import process_start_ticks

MARKER_PREFIX = "llmobs-reader."  # not FILE_PREFIX ("llmobs."): a marker is never taken for a map
MARKER_MODE = 0o644  # workloads of every user read it; only its agent writes it


def marker_path(pid: int, shm_dir: str = layout.SHM_DIR) -> str:
    return os.path.join(shm_dir, f"{MARKER_PREFIX}{pid}")


def _live_marker(entry: os.DirEntry, trusted_uids: tuple[int, ...], proc_root: str) -> bool:
    pid_text = entry.name[len(MARKER_PREFIX) :]
    if not entry.name.startswith(MARKER_PREFIX) or not pid_text.isdigit():
        return False
    st = entry.stat(follow_symlinks=False)
    if not entry.is_file(follow_symlinks=False) or st.st_uid not in trusted_uids:
        return False  # another user's marker must not make our workload leave its map behind
    with open(entry.path, "rb") as f:
        recorded = f.read(32).strip()
    return recorded.isdigit() and int(recorded) == process_start_ticks(pid_text, proc_root)


def reader_present(shm_dir: str = layout.SHM_DIR, proc_root: str = "/proc") -> bool:
    """True when a live agent (root's, or this user's) has announced itself in `shm_dir`. Never raises."""
    trusted = (0, os.getuid())
    try:
        with os.scandir(shm_dir) as entries:
            for entry in entries:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    if _live_marker(entry, trusted, proc_root):
                        return True
    except OSError:
        pass
    return False


def remove_dead_markers(shm_dir: str = layout.SHM_DIR, proc_root: str = "/proc") -> list[str]:
    """Markers of agents that died without withdrawing them (SIGKILL); removes the ones we may."""
    removed = []
    with os.scandir(shm_dir) as entries:
        for entry in entries:
            pid_text = entry.name[len(MARKER_PREFIX) :]
            if not entry.name.startswith(MARKER_PREFIX) or not pid_text.isdigit():
                continue
            try:
                with open(entry.path, "rb") as f:
                    recorded = f.read(32).strip()
                alive = recorded.isdigit() and int(recorded) == process_start_ticks(pid_text, proc_root)
            except FileNotFoundError:
                alive = False  # no such process (or the marker went meanwhile)
            except (OSError, ValueError, IndexError):
                continue  # unreadable: not provably dead
            if not alive:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed.append(entry.path)
    return removed


class ReaderPresence:
    """This agent's marker in one shm directory, for as long as the agent reads maps there.

    `ReaderPresence.announce()` at agent start, before the first attach (a target that exits right after
    "attached in" must already see it); `close()` at agent exit. Announcements are counted per directory,
    so several holders in one process share one marker."""

    _lock = threading.Lock()
    _holders: dict[str, int] = {}

    def __init__(self, shm_dir: str):
        self.shm_dir = shm_dir
        self.path = marker_path(os.getpid(), shm_dir)
        self.closed = False

    @classmethod
    def announce(cls, shm_dir: str = layout.SHM_DIR) -> ReaderPresence:
        presence = cls(shm_dir)
        with cls._lock:
            if not cls._holders.get(shm_dir):
                with contextlib.suppress(OSError):  # not ours to clean: the announcement still counts
                    remove_dead_markers(shm_dir)
                presence._write()
            cls._holders[shm_dir] = cls._holders.get(shm_dir, 0) + 1
        return presence

    def _write(self) -> None:
        tmp = f"{self.path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, MARKER_MODE)
        try:
            os.fchmod(fd, MARKER_MODE)
            os.write(fd, b"%d\n" % process_start_ticks("self"))
        finally:
            os.close(fd)
        os.replace(tmp, self.path)  # a workload never reads a half-written marker

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            left = self._holders.get(self.shm_dir, 1) - 1
            self._holders[self.shm_dir] = left
            if left <= 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)

    def __enter__(self) -> ReaderPresence:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
