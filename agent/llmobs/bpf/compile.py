"""The compile step, run in a short-lived child process: bcc (clang/LLVM) turns the assembled C unit into
a cache entry (llmobs.bpf.cache), then the process exits and its ~250 MB of LLVM heap with it.

    python -m llmobs.bpf.compile   < {"source": ..., "cflags": [...], "key": ..., "cache_dir": ...}

stdout gets one JSON line: {"ok": true, "path": ..., "compile_s": ...} or {"ok": false, "error": ...,
"missing": bool} (missing: bcc is not importable). The agent calls `compile_entry`, which runs this.

bcc creates the maps while compiling and writes their fds into the instructions it emits; the
child reads each map's spec back from the kernel (BPF_OBJ_GET_INFO_BY_FD) and records which
instruction references which map, so the agent can create its own maps and patch its fds in.
"""

from __future__ import annotations

import ctypes as ct
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

from llmobs.bpf import syscall
from llmobs.bpf.cache import Cache, Entry, Function, MapSpec
from llmobs.errors import MissingLibrary

LD_IMM64 = 0x18  # BPF_LD | BPF_IMM | BPF_DW: a 64-bit immediate in two instruction slots
PSEUDO_MAP_FD, PSEUDO_MAP_VALUE = 1, 2  # src_reg of an ld_imm64 whose imm is a map fd
COMPILE_TIMEOUT_S = 300.0


def prog_type_of(function: str) -> int:
    """The program type a function is loaded as: named after its hook, as the C files do."""
    return syscall.PROG_TRACEPOINT if function.startswith("tracepoint") else syscall.PROG_KPROBE


def map_references(insns: bytes, fd_to_index: dict[int, int], function: str) -> tuple[tuple[int, int], ...]:
    """(instruction index, map index) of every ld_imm64 that loads a map, from bcc's rewritten code."""
    refs = []
    index, count = 0, len(insns) // 8
    while index < count:
        code, regs, _off, imm = struct.unpack_from("<BBhi", insns, index * 8)
        if code == LD_IMM64:
            if regs >> 4 in (PSEUDO_MAP_FD, PSEUDO_MAP_VALUE):
                if imm not in fd_to_index:
                    raise ValueError(
                        f"{function}: instruction {index} references fd {imm}, not one of the maps"
                    )
                refs.append((index, fd_to_index[imm]))
            index += 2  # the second half of the 16-byte instruction
            continue
        index += 1
    return tuple(refs)


def compile_with_bcc(source: str, cflags: list[str], key: str) -> Entry:
    """Compiles in this process (the child): bcc's module -> an Entry."""
    from bcc import BPF
    from bcc.libbcc import lib

    began = time.perf_counter()
    program = BPF(text=source.encode(), cflags=cflags)
    compile_s = time.perf_counter() - began
    module = program.module
    lib.bpf_num_tables.restype, lib.bpf_num_tables.argtypes = ct.c_ulonglong, [ct.c_void_p]
    lib.bpf_table_name.restype, lib.bpf_table_name.argtypes = ct.c_char_p, [ct.c_void_p, ct.c_ulonglong]
    lib.bpf_table_fd_id.restype, lib.bpf_table_fd_id.argtypes = ct.c_int, [ct.c_void_p, ct.c_ulonglong]
    maps, fd_to_index = [], {}
    for table in range(lib.bpf_num_tables(module)):
        fd = lib.bpf_table_fd_id(module, table)
        if fd < 0:
            continue
        info = syscall.map_info(fd)
        name = lib.bpf_table_name(module, table).decode()
        fd_to_index[fd] = len(maps)
        maps.append(MapSpec(name, info.type, info.key_size, info.value_size, info.max_entries, info.flags))
    functions = {}
    for index in range(lib.bpf_num_functions(module)):
        name = lib.bpf_function_name(module, index).decode()
        insns = program.dump_func(name.encode())
        functions[name] = Function(name, prog_type_of(name), insns, map_references(insns, fd_to_index, name))
    licence = (lib.bpf_module_license(module) or b"GPL").decode()
    entry = Entry(key, maps, functions, licence, int(lib.bpf_module_kern_version(module)), compile_s)
    program.cleanup()
    return entry


def main() -> int:
    request = json.loads(sys.stdin.read())
    try:
        entry = compile_with_bcc(request["source"], request["cflags"], request["key"])
    except ImportError as exc:
        print(
            json.dumps(
                {"ok": False, "missing": True, "error": f"bcc (python3-bpfcc) is not importable: {exc}"}
            )
        )
        return 1
    except Exception as exc:  # bcc raises plain Exceptions: a compile error, a map it could not create
        print(json.dumps({"ok": False, "missing": False, "error": str(exc).strip() or type(exc).__name__}))
        return 1
    path = Cache(Path(request["cache_dir"])).write(entry)
    print(json.dumps({"ok": True, "path": str(path), "compile_s": entry.compile_s}))
    return 0


def compile_entry(source: str, cflags: list[str], key: str, cache: Cache) -> float:
    """Compiles in a child process and writes the entry to `cache`; returns the child's wall seconds.
    MissingLibrary (one line, with the compiler's last words) when it cannot."""
    cache.ensure_dir()
    request = json.dumps(
        {"source": source, "cflags": list(cflags), "key": key, "cache_dir": str(cache.directory)}
    )
    began = time.perf_counter()
    try:
        child = subprocess.run(
            [sys.executable, "-m", "llmobs.bpf.compile"],
            input=request.encode(),
            capture_output=True,
            timeout=COMPILE_TIMEOUT_S,
            env={**os.environ, "PYTHONPATH": _pythonpath()},
        )
    except subprocess.TimeoutExpired:
        raise MissingLibrary(f"compiling the BPF program took over {COMPILE_TIMEOUT_S:.0f} s") from None
    took = time.perf_counter() - began
    lines = child.stdout.decode(errors="replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        answer = {"ok": False, "missing": False, "error": f"the compiler process exited {child.returncode}"}
    if not answer.get("ok"):
        stderr = [line for line in child.stderr.decode(errors="replace").splitlines() if line.strip()]
        detail = next((line for line in stderr if "error" in line.lower()), stderr[-1] if stderr else "")
        first = answer["error"].splitlines()[0]
        message = f"cannot compile the BPF program: {first}" + (f" ({detail.strip()})" if detail else "")
        raise MissingLibrary(message)
    return took


def _pythonpath() -> str:
    """The child imports this very llmobs package (a bench may run another tree than the venv's)."""
    package_root = str(Path(__file__).resolve().parents[2])
    existing = os.environ.get("PYTHONPATH", "")
    return package_root + (os.pathsep + existing if existing else "")


if __name__ == "__main__":
    sys.exit(main())
