"""Hands back the library pages that only the agent's start-up touched (MADV_PAGEOUT, once settled),
and those that only a reopen of its store touched (runtime/agent.py calls `release` after each).

Why: after the imports and the attach, about half of the agent's resident set is read-only pages of
library files, faulted in once by initialisation (DuckDB's ~50 MB of code registering every function
it has, Arrow's, libpython's). The loop runs a small part of that code. Measured on an attached agent
(tiny workload, `--profile mem`): RssFile 117 MB; paged out, 35 MB; 5 s later what the loop uses had
faulted back, 71 MB, and stayed there (RSS 223 -> ~176 MB). A page used again costs a minor fault (the
kernel keeps it in the page cache as long as it likes), so this trades nothing the agent needs.

Only read-only mappings of files are advised: anonymous memory (the heap, DuckDB's buffers) has no
swap to go to, and the ring's mapping (anon_inode:bpf-map) is the kernel's. Pages another process maps
too are left alone by the kernel. A kernel without MADV_PAGEOUT (before 5.4) refuses it: nothing is
released and the agent goes on (the counter stays 0).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno

from llmobs.procfs import parse_maps

MADV_PAGEOUT = 21  # linux/mman.h (5.4+)
# The start-up is over this long after the runtime starts: attach's first map reads and drains (which
# fault in the loop's own code) are behind it; the daemon's configuration and discovery are too.
SETTLE_S = 5.0


def _read_only_file_mappings(maps_text: str) -> list[tuple[int, int]]:
    """(start, length) of every mapping of a file (a path) without write permission, from maps text."""
    return [
        (entry.start, entry.end - entry.start)
        for entry in parse_maps(maps_text)
        if entry.path.startswith("/") and "w" not in entry.perms
    ]


def release(maps_path: str = "/proc/self/maps") -> int:
    """Page out this process's read-only file mappings; the bytes advised (0 if the kernel refused)."""
    with open(maps_path) as handle:
        mappings = _read_only_file_mappings(handle.read())
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    advised = 0
    for start, length in mappings:
        if libc.madvise(start, length, MADV_PAGEOUT) == 0:
            advised += length
        elif ctypes.get_errno() == errno.EINVAL and not advised:
            return 0  # no MADV_PAGEOUT in this kernel: every mapping would say the same
        # else the mapping went away since maps was read (a library unloaded): the next one
    return advised
