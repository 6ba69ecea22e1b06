"""The target process of the bpf tests (run as a script; holds no tests itself).

A real PyTorch process that publishes a context cell the way the workload's writer does (one mmap of
/dev/shm/llmobs.<pid> from offset 0, the cell at LLMOBS_CTX_OFFSET, seqlock-protected) and, on
command from stdin, runs a phase whose calls are known by construction:

    step STEP_SEQ TRACE_HEX ALLOCS NBYTES GEMMS IOCTLS  -> "done"   (one token step's work)
    exit                                                -> exits 0

ALLOCS torch.empty(NBYTES, uint8) tensors (one c10::alloc_cpu each, freed at the end of the step by
one free_cpu each), GEMMS F.linear calls (one sgemm_ each), IOCTLS ioctl(2) calls on /dev/null.
It prints "ready <cell address>" once set up.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import struct
import sys
import termios

CTX_OFFSET = 256
MAP_BYTES = 64 * 1024


class ContextCell:
    """seq, trace_id_hi, trace_id_lo, step_seq at CTX_OFFSET of one whole-file mapping."""

    def __init__(self):
        self.path = f"/dev/shm/llmobs.{os.getpid()}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, MAP_BYTES)
        self.map = mmap.mmap(fd, MAP_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        self.seq = 0
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map)) + CTX_OFFSET

    def write(self, trace_hex: str, step_seq: int) -> None:
        raw = bytes.fromhex(trace_hex)
        hi, lo = struct.unpack(">QQ", raw)
        self.seq += 1  # odd: update in progress
        struct.pack_into("<Q", self.map, CTX_OFFSET, self.seq)
        struct.pack_into("<QQQ", self.map, CTX_OFFSET + 8, hi, lo, step_seq)
        self.seq += 1
        struct.pack_into("<Q", self.map, CTX_OFFSET, self.seq)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def main() -> int:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    publish = "--no-map" not in sys.argv
    cell = ContextCell() if publish else None
    weight = torch.randn(64, 64)
    x = torch.randn(4, 64)
    null_fd = os.open("/dev/null", os.O_RDONLY)
    with torch.no_grad():
        F.linear(x, weight)  # warm-up: first-call allocations happen before any counted phase
    print(f"ready {cell.address if cell else 0}", flush=True)
    try:
        for line in sys.stdin:
            parts = line.split()
            if not parts or parts[0] == "exit":
                break
            step_seq, trace_hex = int(parts[1]), parts[2]
            allocs, nbytes, gemms, ioctls = (int(v) for v in parts[3:7])
            if cell:
                cell.write(trace_hex, step_seq)
            with torch.no_grad():
                held = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(allocs)]
                for _ in range(gemms):
                    F.linear(x, weight)
                del held
            for _ in range(ioctls):
                with contextlib.suppress(OSError):
                    fcntl.ioctl(null_fd, termios.FIONREAD, b"\0\0\0\0")
            print("done", flush=True)
    finally:
        if cell:
            cell.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
