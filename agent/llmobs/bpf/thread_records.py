"""Where a target's per-thread OTEP 4947 records are, for the probes' per-thread tags.

The workload's thread-context library (agent/llmobs/shm/c/otel_thread_ctx.c) keeps a registry,
`llmobs_thread_ctx_registry`: slot tid % 1024 = (tid, address of that thread's record). The probes
(bpf/c/llmobs_events.h, llmobs_read_thread_tag) read the current thread's slot and record; this
module finds the registry's address in the target: the library's mapping in /proc/PID/maps (its load
address) plus the symbol's value in the library's .dynsym.
"""

from __future__ import annotations

import os

from llmobs.bpf.elfsym import ElfError, open_elf
from llmobs.procfs import MapEntry

LIBRARY_NAME = "libllmobs_otel_thread_ctx.so"
REGISTRY_SYMBOL = "llmobs_thread_ctx_registry"
PAGE = 4096


def find_thread_registry(pid: int, entries: list[MapEntry], proc_root: str = "/proc") -> int:
    """The registry's address in `pid`, or 0 when the process has not loaded the library."""
    mine = [e for e in entries if os.path.basename(e.path.removesuffix(" (deleted)")) == LIBRARY_NAME]
    first = min((e for e in mine if e.offset == 0), key=lambda e: e.start, default=None)
    if first is None:
        return 0
    try:
        elf = open_elf(f"{proc_root}/{pid}/root{first.path.removesuffix(' (deleted)')}")
        value = elf.data_address(REGISTRY_SYMBOL)
        base = first.start - (elf.first_load_vaddr() & ~(PAGE - 1))
    except (OSError, ElfError):
        return 0
    return base + value if value is not None else 0
