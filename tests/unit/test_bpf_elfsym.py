"""Probe placement from instruction bytes, and symbol lookup in real shared objects."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llmobs.bpf.elfsym import ElfError, ElfFile, choose_placement, open_elf

TORCH_LIB = Path(torch.__file__).parent / "lib"


@pytest.mark.parametrize(
    ("code", "offset", "emulated"),
    [
        (bytes.fromhex("f30f1efa554157"), 4, True),  # endbr64; push %rbp -> past endbr64
        (bytes.fromhex("f30f1efa4157"), 4, True),  # endbr64; push %r15
        (bytes.fromhex("f30f1efa4889e5"), 0, False),  # endbr64; mov: both single-stepped, stay at entry
        (bytes.fromhex("554889e5"), 0, True),  # push %rbp at entry
        (bytes.fromhex("e92bcef9ff"), 0, True),  # tail jmp (c10::free_cpu)
        (bytes.fromhex("4883ec08"), 0, False),  # sub $8,%rsp: single-stepped
        (b"", 0, False),
    ],
)
def test_choose_placement(code, offset, emulated):
    placement = choose_placement(code)
    assert (placement.offset, placement.emulated) == (offset, emulated)


def test_finds_c10_allocator_symbols():
    elf = ElfFile(str(TORCH_LIB / "libc10.so"))
    alloc = elf.find("_ZN3c109alloc_cpuEm")
    free = elf.find("_ZN3c108free_cpuEPv")
    assert alloc is not None and free is not None
    assert alloc.vaddr != free.vaddr and alloc.size > 0
    assert elf.vaddr_to_offset(alloc.vaddr) == alloc.file_offset
    assert elf.find("_ZN3c109alloc_cpu") is None  # a prefix of a real name is not a match
    assert elf.find("no_such_symbol_anywhere") is None


def test_sgemm_sits_past_endbr64_in_libtorch_cpu():
    elf = open_elf(str(TORCH_LIB / "libtorch_cpu.so"))
    sgemm = elf.find("sgemm_")
    assert sgemm is not None
    placement = choose_placement(elf.code_at(sgemm))
    assert placement.first_bytes.startswith(b"\xf3\x0f\x1e\xfa")
    assert placement.offset == 4 and placement.emulated


def test_not_an_elf(tmp_path):
    bogus = tmp_path / "libfake.so"
    bogus.write_bytes(b"not an elf at all" * 10)
    with pytest.raises(ElfError):
        ElfFile(str(bogus))
