"""Maps left at exit: when a workload's map outlives the workload, and how many may.

A workload that exits removes its map. If it removed it while token steps were still unread, a process
that lived shorter than the agent's look at it (attach's first poll, a discovery interval) would lose
every step. So at exit the writer keeps the file when all of these hold:

- it published token steps that no reader has caught up with (`control.reader_tail < steps_head`);
- an agent will read it: the reader advertising in the control block (`reader_pid`) is alive, or an
  agent has announced itself in the shm directory (llmobs.shm.presence) - with no agent on the host
  nobody would ever read the file, so it goes as always;
- the directory holds fewer than MAX_LEFT_MAPS maps of exited processes, with this one at most
  MAX_LEFT_BYTES in all: the maps are tmpfs memory (4.6 MiB each at the default capacities).

The agent reads such a map once, by path, and removes it (llmobs.pipeline.sources.ShmSource.drain for
its target, llmobs.pipeline.leftovers.ingest_stale_maps for the rest). Workload side: bounded work
(one scandir of the shm directory), never blocks, never raises.
"""

from __future__ import annotations

import os

from llmobs.shm import layout
from llmobs.shm.presence import reader_present

MAX_LEFT_MAPS = 8  # maps of exited processes a workload adds to; the 9th is removed at exit as before
MAX_LEFT_BYTES = 256 << 20  # and at most this much tmpfs in all (8 default maps are 37 MiB)


def keep_at_exit(path: str, size: int, steps_head: int, reader_pid: int, reader_tail: int,
                 proc_root: str = "/proc") -> bool:  # fmt: skip
    """True when the exiting writer of the map at `path` should leave it for an agent (see above)."""
    if steps_head == 0 or reader_tail >= steps_head:
        return False  # nothing published, or a reader has everything
    shm_dir = os.path.dirname(path)
    reader_alive = reader_pid not in (0, os.getpid()) and os.path.isdir(f"{proc_root}/{reader_pid}")
    if not reader_alive and not reader_present(shm_dir, proc_root):
        return False
    count, total = left_maps(shm_dir, proc_root)
    return count < MAX_LEFT_MAPS and total + size <= MAX_LEFT_BYTES


def left_maps(shm_dir: str = layout.SHM_DIR, proc_root: str = "/proc") -> tuple[int, int]:
    """(how many, how many bytes): the map files in `shm_dir` whose process is gone."""
    count = total = 0
    try:
        with os.scandir(shm_dir) as entries:
            for entry in entries:
                pid_text = entry.name[len(layout.FILE_PREFIX) :]
                if not entry.name.startswith(layout.FILE_PREFIX) or not pid_text.isdigit():
                    continue
                if os.path.isdir(f"{proc_root}/{pid_text}"):
                    continue
                try:
                    total += entry.stat(follow_symlinks=False).st_size
                    count += 1
                except OSError:
                    continue
    except OSError:
        pass
    return count, total
