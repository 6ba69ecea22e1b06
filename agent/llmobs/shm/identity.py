"""Who a process is, beyond its pid: its start time (field 22 of /proc/PID/stat, in clock ticks since
boot) and its uid. A pid is reused; (pid, start time) is not. The map header records the writer's
start time, so a map can be told from one written by an earlier process with the same pid, also after
the process has exited."""

from __future__ import annotations

import os
from dataclasses import dataclass


def process_start_ticks(pid: int | str = "self", proc_root: str = "/proc") -> int:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot): with the pid, a unique id."""
    with open(f"{proc_root}/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rindex(b")") + 2 :].split()[19])


@dataclass(frozen=True)
class ProcessIdentity:
    """A live process as the agent saw it: what its map's file owner and header must match later."""

    pid: int
    uid: int
    start_ticks: int

    @classmethod
    def of(cls, pid: int, proc_root: str = "/proc") -> ProcessIdentity | None:
        """The identity of the live process `pid` (None when it is gone or unreadable)."""
        try:
            uid = os.stat(f"{proc_root}/{pid}").st_uid
            return cls(pid, uid, process_start_ticks(pid, proc_root))
        except (OSError, ValueError, IndexError):
            return None
