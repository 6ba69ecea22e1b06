"""Maps of processes that are gone, ingested into the store once and then removed.

A workload that exits before an agent has read all its token steps leaves its map behind
(llmobs.shm.leftover), and a killed workload always does. `ingest_stale_maps(store)` reads each such map
through the same Pipeline an attach uses - so its steps land in token_steps, are correlated and scored
like any others - and removes the file. The store's newest step of the pid is where reading resumes
(Pipeline sets ShmSource.resume_after), so a map partly stored already is not stored twice. Where no
store is open, llmobs.shm.reader.remove_stale_maps removes them unread, as before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

from llmobs.pipeline.core import Pipeline
from llmobs.pipeline.sources import ShmSource
from llmobs.shm import layout
from llmobs.shm.reader import stale_maps


@dataclass
class LeftMap:
    """One stale map the sweep handled: where it was, whose it was, and how many steps it stored."""

    path: str
    pid: int
    steps: int  # token steps stored from it (0: it held none we had not stored, or none could be read)
    error: str | None = None  # why nothing could be read (a malformed map is removed all the same)


def ingest_stale_maps(
    store,
    *,
    skip_pids=(),
    accept_uid: Callable[[int], bool] = lambda _uid: True,
    shm_dir: str = layout.SHM_DIR,
    proc_root: str = "/proc",
) -> list[LeftMap]:
    """Store the unread token steps of every stale map in `shm_dir`, then remove the map.

    `skip_pids`: the caller's own targets, whose pipelines drain their maps themselves. `accept_uid`: whether
    the caller would have observed a process of that uid (the map file's owner; the daemon's selectors),
    else the map is removed unread. A map whose pid now belongs to a later process is removed without
    being read: its pid's rows in the store (the processes table) would describe the wrong process."""
    handled = []
    for path in stale_maps(shm_dir, proc_root, skip_pids):
        pid = int(path[len(os.path.join(shm_dir, layout.FILE_PREFIX)) :])
        left = LeftMap(path, pid, 0)
        reused = os.path.isdir(f"{proc_root}/{pid}")
        try:
            wanted = accept_uid(os.stat(path, follow_symlinks=False).st_uid)
        except OSError:  # removed meanwhile
            continue
        if not wanted:
            left.error = "not selected (its owner's uid)"
        elif not reused:
            shm = ShmSource(pid, shm_dir, proc_root)
            summary = Pipeline(store, pid, snapshot=False, shm=shm).close()  # its drain removes the map
            left.steps, left.error = summary.steps_read, shm.error
        # what the drain did not remove (unreadable, or a reused pid's), unless a new process took the pid
        if reused or not wanted or not os.path.isdir(f"{proc_root}/{pid}"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        handled.append(left)
    return handled
