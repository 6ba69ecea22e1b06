"""Library resolution through a (fake) /proc/PID/maps pointing at real shared objects."""

from __future__ import annotations

from pathlib import Path

import torch
from llmobs.bpf.libraries import Skipped, find_libraries, mapped_libraries, resolve
from llmobs.bpf.profiles import LIB_CUDART, PROBES
from llmobs.bpf.session import find_context_cell
from llmobs.procfs import ProcFS, parse_maps

TORCH_LIB = Path(torch.__file__).parent / "lib"
PROBE = {probe.name: probe for probe in PROBES}


def _maps(*paths):
    return parse_maps(
        "\n".join(
            f"{0x1000 * (i + 1):x}-{0x1000 * (i + 2):x} r-xp 00000000 08:01 {i} {p}"
            for i, p in enumerate(paths)
        )
    )


def test_wheel_copies_with_hashes_match():
    paths = [
        "/x/nvidia/cuda_runtime/lib/libcudart.so.12",
        "/y/libcudart-3c6a2c55.so.12.1",
        "/z/libcudnn.so.9",
    ]
    assert find_libraries(paths, LIB_CUDART) == paths[:2]


def test_resolve_from_maps(tmp_path):
    paths = mapped_libraries(
        _maps(str(TORCH_LIB / "libc10.so"), "/gone/lib.so (deleted)", str(TORCH_LIB / "libc10.so"))
    )
    assert paths == [str(TORCH_LIB / "libc10.so")]
    procfs = ProcFS(tmp_path)  # no <pid>/root there: the path is used as it is
    resolved = resolve(PROBE["alloc_cpu"], 99, paths, procfs)
    assert not isinstance(resolved, Skipped)
    assert resolved.symbol.name == "_ZN3c109alloc_cpuEm" and resolved.address == resolved.symbol.vaddr


def test_missing_library_and_symbol_are_skips(tmp_path):
    procfs = ProcFS(tmp_path)
    skipped = resolve(PROBE["cuLaunchKernel"], 99, [str(TORCH_LIB / "libc10.so")], procfs)
    assert isinstance(skipped, Skipped) and "no library matching" in skipped.reason
    fake = tmp_path / "libcuda.so.1"
    fake.write_bytes((TORCH_LIB / "libc10.so").read_bytes())  # a real ELF without cuLaunchKernel
    skipped = resolve(PROBE["cuLaunchKernel"], 99, [str(fake)], procfs)
    assert isinstance(skipped, Skipped) and "symbol cuLaunchKernel not found" in skipped.reason


def test_context_cell_address(tmp_path):
    # a /proc of processes 42 and 43 whose map file (seen through /proc/PID/root) passes the owner/mode
    # checks: this test is about choosing the mapping (tests/bpf/test_security_maps.py: the checks)
    for pid in (42, 43):
        shm = tmp_path / str(pid) / "root" / "dev" / "shm"
        shm.mkdir(parents=True)
        for name in ("llmobs.42", "llmobs.5", "llmobs.6"):
            (shm / name).touch(mode=0o600)
    entries = parse_maps(
        "7f0000000000-7f0000010000 rw-s 00000000 00:1a 99 /dev/shm/llmobs.42\n"
        "7f0000020000-7f0000030000 rw-s 00001000 00:1a 98 /dev/shm/llmobs.42\n"
    )
    root = str(tmp_path)
    assert find_context_cell(42, entries, 256, root) == 0x7F0000000000 + 256
    assert (
        find_context_cell(43, entries, 256, root) == 0x7F0000000000 + 256
    )  # own pid namespace: the only map
    assert find_context_cell(42, [], 256, root) == 0
    two = parse_maps(
        "7f0000000000-7f0000010000 rw-s 00000000 00:1a 99 /dev/shm/llmobs.5\n"
        "7f0000020000-7f0000030000 rw-s 00000000 00:1a 98 /dev/shm/llmobs.6\n"
    )
    assert find_context_cell(42, two, 256, root) == 0  # ambiguous: untracked rather than wrong
    (tmp_path / "42" / "root" / "dev" / "shm" / "llmobs.42").chmod(0o644)
    assert find_context_cell(42, entries, 256, root) == 0  # anyone could have written its cell
