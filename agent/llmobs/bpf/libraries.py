"""Resolves a probe's library and symbol in one process, through /proc/PID/maps.

Wheels ship their own copies of libcudart, libnccl and libc10, so the copy to probe is the one the
process has mapped, not whatever the linker would find. A missing library or symbol is a reason
to skip that probe, reported to the user, never an exception.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from llmobs.bpf.elfsym import ElfError, Placement, Symbol, choose_placement, open_elf
from llmobs.bpf.profiles import Probe
from llmobs.procfs import MapEntry, ProcFS


@dataclass(frozen=True)
class ResolvedProbe:
    probe: Probe
    path: str  # the library as reachable from the agent (through /proc/PID/root)
    symbol: Symbol
    placement: Placement

    @property
    def address(self) -> int:
        """The vaddr handed to bcc (which turns it into the file offset the kernel wants)."""
        return self.symbol.vaddr + self.placement.offset


@dataclass(frozen=True)
class Skipped:
    probe: Probe
    reason: str


def mapped_libraries(entries: list[MapEntry]) -> list[str]:
    """Distinct file-backed paths of the process's mappings, in first-seen order, deleted ones dropped."""
    seen: dict[str, None] = {}
    for entry in entries:
        if entry.path.startswith("/") and not entry.deleted:
            seen.setdefault(entry.path, None)
    return list(seen)


def find_libraries(paths: list[str], pattern: str) -> list[str]:
    regex = re.compile(pattern)
    return [path for path in paths if regex.search(os.path.basename(path))]


def resolve(probe: Probe, pid: int, paths: list[str], procfs: ProcFS) -> ResolvedProbe | Skipped:
    """The first mapped library matching the probe's pattern that defines its symbol."""
    libraries = find_libraries(paths, probe.library)
    if not libraries:
        return Skipped(probe, f"no library matching {probe.library} in /proc/{pid}/maps")
    for library in libraries:
        reachable = procfs.root_path(pid, library)
        if not os.path.exists(reachable):
            reachable = library
        try:
            elf = open_elf(reachable)
        except (OSError, ElfError):
            continue
        symbol = elf.find(probe.symbol)
        if symbol is not None:
            return ResolvedProbe(probe, reachable, symbol, choose_placement(elf.code_at(symbol)))
    names = ", ".join(os.path.basename(lib) for lib in libraries)
    return Skipped(probe, f"symbol {probe.symbol} not found in {names}")
