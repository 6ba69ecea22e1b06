"""Loads a cached compiled program into the kernel with the bpf(2) syscall: no bcc, no LLVM.

`load(source, cflags)` is the whole path: a cache hit creates the maps from their specs, writes their
fds into the instructions and loads every function (milliseconds); a miss first compiles in a child
process (llmobs.bpf.compile) and loads what it wrote. An entry the kernel refuses (a verifier error,
an entry made for another kernel that hashed the same) or a corrupt file is removed and compiled
once more; a second failure is a MissingLibrary error.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from dataclasses import dataclass, field

from llmobs.bpf import syscall
from llmobs.bpf.cache import Cache, Entry, MapSpec, cache_key
from llmobs.errors import MissingLibrary


@dataclass
class LoadStats:
    cache_hit: bool = False
    compile_s: float = 0.0  # the child's wall time on a miss (interpreter start, bcc import, compile)
    load_s: float = 0.0  # maps created and programs verified and loaded
    recompiled: str = ""  # why a cached entry was thrown away, if one was


@dataclass
class LoadedProgram:
    """The maps and programs of one entry, owned by this process; close() releases them all."""

    entry: Entry
    map_fds: dict[str, int] = field(default_factory=dict)
    specs: dict[str, MapSpec] = field(default_factory=dict)
    prog_fds: dict[str, int] = field(default_factory=dict)

    def close(self) -> None:
        for fd in list(self.prog_fds.values()) + list(self.map_fds.values()):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.prog_fds.clear()
        self.map_fds.clear()


def instantiate(entry: Entry) -> LoadedProgram:
    """Creates the entry's maps and loads every function; on any failure closes what it made and raises."""
    loaded = LoadedProgram(entry)
    try:
        fds = []
        for spec in entry.maps:
            fd = syscall.map_create(
                spec.type, spec.key_size, spec.value_size, spec.max_entries, spec.flags, spec.name
            )
            fds.append(fd)
            loaded.map_fds[spec.name] = fd
            loaded.specs[spec.name] = spec
        licence = entry.license.encode()
        for name, function in entry.functions.items():
            insns = bytearray(function.insns)
            for index, map_index in function.map_refs:
                struct.pack_into("<i", insns, index * 8 + 4, fds[map_index])
            loaded.prog_fds[name] = syscall.prog_load(
                function.prog_type, bytes(insns), name, licence, entry.kern_version
            )
    except BaseException:
        loaded.close()
        raise
    return loaded


def load(source: str, cflags: list[str], cache: Cache | None = None) -> tuple[LoadedProgram, LoadStats]:
    from llmobs.bpf.compile import compile_entry

    cache = cache or Cache()
    key = cache_key(source, cflags)
    stats = LoadStats()
    entry = cache.read(key)
    stats.cache_hit = entry is not None
    for attempt in range(2):
        if entry is None:
            stats.compile_s += compile_entry(source, cflags, key, cache)
            entry = cache.read(key)
            if entry is None:
                raise MissingLibrary(f"the BPF compiler wrote no usable cache entry in {cache.directory}")
            fresh = True
        else:
            fresh = attempt > 0
        began = time.perf_counter()
        try:
            loaded = instantiate(entry)
        except OSError as exc:
            if fresh:  # compiled just now and still refused: compiling again cannot help
                first = str(exc).splitlines()[0]
                raise MissingLibrary(
                    f"cannot load the BPF program: {first}",
                    hint="run `llmobs-agent doctor`; `attach --ebpf` prints the C unit that was compiled",
                ) from None
            cache.remove(key)  # refused from the cache: compile it again, once
            stats.recompiled = str(exc).splitlines()[0]
            entry = None
            continue
        stats.load_s = time.perf_counter() - began
        return loaded, stats
    raise MissingLibrary("cannot load the BPF program")  # not reached: the second attempt is fresh
