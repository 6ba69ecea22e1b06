"""Finds a symbol in an ELF shared object and picks where on it a uprobe should sit.

Why not just the symbol address: the kernel emulates a few instructions under a uprobe (push, jmp,
call, jcc: ~1-2 us a hit) and single-steps the rest (endbr64, mov, ...: ~20 us a hit). Functions
built with CET start with endbr64, so a probe at the symbol is single-stepped; at sym+4 it sits on
the instruction after, usually an emulated push. The arguments are still in their registers there
and %rsp still points at the return address, so entry and return probes both work at sym+4.

The symbol tables are scanned with numpy (libtorch_cpu.so has ~75k dynamic symbols): the name is
found in the string table first, then its offset among the symbols' st_name column.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

ENDBR64 = b"\xf3\x0f\x1e\xfa"

_SYM_DTYPE = np.dtype(
    [
        ("st_name", "<u4"),
        ("st_info", "u1"),
        ("st_other", "u1"),
        ("st_shndx", "<u2"),
        ("st_value", "<u8"),
        ("st_size", "<u8"),
    ]
)
_SHT_SYMTAB = 2
_SHT_DYNSYM = 11
_PT_LOAD = 1
_STT_OBJECT = 1
_STT_FUNC = 2
_STT_GNU_IFUNC = 10


class ElfError(Exception):
    """The file is not an ELF64 little-endian object we can read."""


@dataclass(frozen=True)
class Symbol:
    name: str
    vaddr: int  # st_value: the address in the object's own address space
    size: int
    file_offset: int  # where its first byte lies in the file (what a uprobe's offset means)


@dataclass(frozen=True)
class Placement:
    """Where a probe goes on a function and what the kernel does with the instruction there."""

    offset: int  # bytes past the symbol
    emulated: bool  # the kernel emulates the probed instruction (cheap) rather than single-stepping it
    first_bytes: bytes  # the function's first bytes, for reports

    def describe(self) -> str:
        how = "emulated" if self.emulated else "single-stepped"
        return f"+{self.offset} ({how}; entry bytes {self.first_bytes[:8].hex(' ')})"


def _emulated_instruction(code: bytes) -> bool:
    """True for the x86-64 instructions the kernel's uprobe code emulates instead of single-stepping."""
    if not code:
        return False
    op = code[0]
    if 0x50 <= op <= 0x57:  # push %rax..%rdi
        return True
    if op == 0x41 and len(code) > 1 and 0x50 <= code[1] <= 0x57:  # push %r8..%r15
        return True
    if op in (0xE8, 0xE9, 0xEB, 0x90):  # call rel32, jmp rel32, jmp rel8, nop
        return True
    if 0x70 <= op <= 0x7F:  # jcc rel8
        return True
    return op == 0x0F and len(code) > 1 and 0x80 <= code[1] <= 0x8F  # jcc rel32


def choose_placement(code: bytes) -> Placement:
    """Probe at the first emulated instruction among {the entry, entry+4 past an endbr64}."""
    if code.startswith(ENDBR64) and _emulated_instruction(code[4:]):
        return Placement(offset=4, emulated=True, first_bytes=code)
    return Placement(offset=0, emulated=_emulated_instruction(code), first_bytes=code)


class ElfFile:
    """A read-only view of one ELF64 object's symbol tables and loadable segments."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        if self._map[:4] != b"\x7fELF" or self._map[4] != 2 or self._map[5] != 1:
            raise ElfError(f"{path}: not a little-endian ELF64 object")
        (self._phoff, self._shoff) = struct.unpack_from("<QQ", self._map, 0x20)
        (self._phentsize, self._phnum, self._shentsize, self._shnum) = struct.unpack_from(
            "<HHHH", self._map, 0x36
        )
        self._sections = [self._section(i) for i in range(self._shnum)]
        self._loads = self._load_segments()
        self._tables = [
            (self._symbols(sec), self._sections[sec["link"]])
            for sec in self._sections
            if sec["type"] in (_SHT_DYNSYM, _SHT_SYMTAB)
        ]

    def close(self) -> None:
        self._map.close()

    def _section(self, index: int) -> dict:
        base = self._shoff + index * self._shentsize
        _name, sh_type, _flags, _addr, offset, size, link = struct.unpack_from("<IIQQQQI", self._map, base)
        return {"type": sh_type, "offset": offset, "size": size, "link": link}

    def _load_segments(self) -> list[tuple[int, int, int]]:
        loads = []
        for i in range(self._phnum):
            base = self._phoff + i * self._phentsize
            p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from(
                "<IIQQQQ", self._map, base
            )
            if p_type == _PT_LOAD:
                loads.append((p_vaddr, p_filesz, p_offset))
        return loads

    def _symbols(self, sec: dict) -> np.ndarray:
        count = sec["size"] // _SYM_DTYPE.itemsize
        return np.frombuffer(self._map, dtype=_SYM_DTYPE, count=count, offset=sec["offset"])

    def vaddr_to_offset(self, vaddr: int) -> int | None:
        for seg_vaddr, filesz, offset in self._loads:
            if seg_vaddr <= vaddr < seg_vaddr + filesz:
                return vaddr - seg_vaddr + offset
        return None

    def find(self, name: str) -> Symbol | None:
        """The defined function symbol `name` (.dynsym first, then .symtab), or None."""
        wanted = name.encode() + b"\0"
        for symbols, strtab in self._tables:
            start, end = strtab["offset"], strtab["offset"] + strtab["size"]
            candidates = []
            pos = self._map.find(wanted, start, end)
            while pos >= 0:  # every place the name ends a string (tail-merged strings share bytes)
                candidates.append(pos - start)
                pos = self._map.find(wanted, pos + 1, end)
            if not candidates:
                continue
            kinds = symbols["st_info"] & 0xF
            hits = np.flatnonzero(
                np.isin(symbols["st_name"], candidates)
                & (symbols["st_shndx"] != 0)
                & ((kinds == _STT_FUNC) | (kinds == _STT_GNU_IFUNC))
            )
            for index in hits:
                sym = symbols[index]
                file_offset = self.vaddr_to_offset(int(sym["st_value"]))
                if file_offset is not None:
                    return Symbol(name, int(sym["st_value"]), int(sym["st_size"]), file_offset)
        return None

    def data_address(self, name: str) -> int | None:
        """st_value of the defined data object `name` (STT_OBJECT, .dynsym first), or None: where a
        global variable lies relative to the object's load address."""
        wanted = name.encode() + b"\0"
        for symbols, strtab in self._tables:
            start, end = strtab["offset"], strtab["offset"] + strtab["size"]
            pos, candidates = self._map.find(wanted, start, end), []
            while pos >= 0:
                candidates.append(pos - start)
                pos = self._map.find(wanted, pos + 1, end)
            hits = np.flatnonzero(
                np.isin(symbols["st_name"], candidates)
                & (symbols["st_shndx"] != 0)
                & ((symbols["st_info"] & 0xF) == _STT_OBJECT)
            )
            if len(hits):
                return int(symbols[hits[0]]["st_value"])
        return None

    def first_load_vaddr(self) -> int:
        """The lowest PT_LOAD address (0 for a shared object linked the usual way)."""
        return min((vaddr for vaddr, _size, _offset in self._loads), default=0)

    def code_at(self, symbol: Symbol, length: int = 16) -> bytes:
        return bytes(self._map[symbol.file_offset : symbol.file_offset + length])


_ELF_CACHE: dict[tuple[int, int, int, int], ElfFile] = {}
_ELF_CACHE_SIZE = 16  # distinct library files (versions) kept mapped; each holds one fd and one mapping


def open_elf(path: str) -> ElfFile:
    """An ElfFile, cached per file identity (device, inode, size, mtime) so repeated attaches skip
    re-reading. Keyed by identity, not path: each target reaches the same libc10.so through its own
    /proc/PID/root/... path, and a path key made one new mapping (and fd) per target process, so an
    agent serving targets that come and go held up to 64 of them per library."""
    import os

    st = os.stat(path)
    identity = (st.st_dev, st.st_ino, st.st_size, int(st.st_mtime_ns))
    elf = _ELF_CACHE.pop(identity, None) or ElfFile(path)
    _ELF_CACHE[identity] = elf  # most recently used last
    while len(_ELF_CACHE) > _ELF_CACHE_SIZE:
        _ELF_CACHE.pop(next(iter(_ELF_CACHE))).close()
    return elf
