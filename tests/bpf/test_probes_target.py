"""The target process of the bpf tests (run as a script; holds no tests itself).

A real PyTorch process that publishes its context cell through the workload's own map writer
(llmobs.shm.writer: /dev/shm/llmobs.<pid>, the cell at LLMOBS_CTX_OFFSET) and, on command from
stdin, runs a phase whose calls are known by construction (STEP_SEQ must count 1, 2, ...):

    step STEP_SEQ TRACE_HEX ALLOCS NBYTES GEMMS IOCTLS PAGES  -> "done"   (one token step's work)
    cuda STEP_SEQ TRACE_HEX LAUNCHES ALLOC_BYTES SYNCS  -> "done"   (calls into --cuda-lib LIB)
    exit                                                -> exits 0

ALLOCS torch.empty(NBYTES, uint8) tensors (one c10::alloc_cpu each, freed at the end of the step by
one free_cpu each), GEMMS F.linear calls (one sgemm_ each), IOCTLS ioctl(2) calls on /dev/null,
PAGES pages of a fresh anonymous mapping written once each (one user page fault each).
It prints "ready <cell address>" once set up.

The tests import `Target` (drives this script) and `leftovers` (what probes remain in the kernel).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import mmap
import os
import select
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path


class ContextCell:
    """The workload's map, made by the real writer (llmobs.shm.writer); begin_step sets the cell."""

    def __init__(self):
        from llmobs.shm import layout
        from llmobs.shm.writer import ShmWriter

        self.writer = ShmWriter()
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.writer.mm)) + layout.CTX_OFFSET

    def write(self, trace_hex: str, step_seq: int) -> None:
        hi, lo = struct.unpack(">QQ", bytes.fromhex(trace_hex))
        published = self.writer.begin_step(hi, lo, 0, 0)
        assert published == step_seq, f"the writer numbers steps 1, 2, ...: asked {step_seq}, got {published}"

    def remove(self) -> None:
        self.writer.close()


class Target:
    """This script as a child process, driven line by line with bounded waits (no sleeps)."""

    def __init__(self, *args: str, timeout: float = 60.0):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.pid = self.proc.pid
        self._buffer = b""
        ready = self.readline(timeout)
        assert ready.startswith("ready "), ready
        self.cell_address = int(ready.split()[1])

    def readline(self, timeout: float = 30.0) -> str:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            readable, _, _ = select.select([fd], [], [], timeout)
            if not readable:
                raise TimeoutError(f"target {self.pid} said nothing for {timeout} s")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise EOFError(f"target {self.pid} exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def step(self, step_seq: int, trace_hex: str, allocs=0, nbytes=64, gemms=0, ioctls=0, pages=0) -> None:
        """One token step with exactly these calls; returns once the target has done them."""
        line = f"step {step_seq} {trace_hex} {allocs} {nbytes} {gemms} {ioctls} {pages}\n"
        self.proc.stdin.write(line.encode())
        self.proc.stdin.flush()
        assert self.readline() == "done"

    def cuda(self, step_seq: int, trace_hex: str, launches=0, alloc_bytes=0, syncs=0) -> None:
        """Driver-API calls into the library given with --cuda-lib."""
        self.proc.stdin.write(f"cuda {step_seq} {trace_hex} {launches} {alloc_bytes} {syncs}\n".encode())
        self.proc.stdin.flush()
        assert self.readline() == "done"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b"exit\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TargetPool:
    """Plain `Target()`s, each started in the background while the test before it runs (a target imports
    torch: ~2.7 s, on the core the test leaves): `take()` returns the one started ahead, once it is
    ready, and starts the next; `close()` ends the one left. A module's fixture holds one."""

    def __init__(self):
        self._spare: tuple[threading.Thread, dict] | None = None
        self._start()

    def _start(self) -> None:
        box: dict = {}

        def start() -> None:
            try:
                box["target"] = Target()
            except BaseException as exc:  # raised by take() or close(), in the test's thread
                box["error"] = exc

        thread = threading.Thread(target=start, name="target-pool", daemon=True)
        thread.start()
        self._spare = (thread, box)

    def _ready(self) -> Target:
        thread, box = self._spare
        self._spare = None
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["target"]

    def take(self) -> Target:
        target = self._ready()
        self._start()
        return target

    def close(self) -> None:
        if self._spare is not None:
            self._ready().close()


LINEAR_OUTPUT_BYTES = 4 * 64 * 4  # F.linear(x[4,64], w[64,64]) allocates one float32 [4,64] output
GEMM_FLOPS = 2 * 64 * 4 * 64  # and calls sgemm_ with m=64, n=4, k=64
OUR_PROGRAM_PREFIXES = ("uprobe__", "uretprobe__", "tracepoint_s", "tracepoint_p")


def _bpftool(*args: str) -> str:
    return subprocess.run(["bpftool", "-j", *args], capture_output=True, text=True, check=True).stdout


def _prog_ids_held_by_processes() -> set[int]:
    """Ids of the BPF programs some live process holds an fd to (from /proc/*/fdinfo)."""
    held = set()
    for fdinfo in Path("/proc").glob("[0-9]*/fdinfo/*"):
        try:
            text = fdinfo.read_text()
        except OSError:
            continue  # the process or fd went away meanwhile
        for line in text.splitlines():
            if line.startswith("prog_id:"):
                held.add(int(line.split()[1]))
    return held


def leftovers(agent_pid: int | None = None, target_pid: int | None = None) -> dict[str, list]:
    """What llmobs probes are still in the kernel: perf-event uprobes/tracepoints held by the agent
    pid or placed on the target's libraries, tracefs uprobe_events lines, and llmobs programs that no
    live process holds (other test runs may load their own at the same time: those are not leaks)."""
    perf = json.loads(_bpftool("perf", "list") or "[]")
    held = [
        entry
        for entry in perf
        if entry.get("pid") == agent_pid
        or (target_pid is not None and f"/proc/{target_pid}/" in entry.get("filename", ""))
    ]
    progs = json.loads(_bpftool("prog", "list") or "[]")
    ours = {p["id"]: p["name"] for p in progs if p.get("name", "").startswith(OUR_PROGRAM_PREFIXES)}
    owned = _prog_ids_held_by_processes() if ours else set()
    orphans = sorted(name for prog_id, name in ours.items() if prog_id not in owned)
    with open("/sys/kernel/tracing/uprobe_events") as handle:
        uprobe_events = [line for line in handle.read().splitlines() if line.strip()]
    return {"perf": held, "programs": orphans, "uprobe_events": uprobe_events}


def main() -> int:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    publish = "--no-map" not in sys.argv
    cell = ContextCell() if publish else None
    weight = torch.randn(64, 64)
    x = torch.randn(4, 64)
    null_fd = os.open("/dev/null", os.O_RDONLY)
    cuda = ctypes.CDLL(sys.argv[sys.argv.index("--cuda-lib") + 1]) if "--cuda-lib" in sys.argv else None
    with torch.no_grad():
        F.linear(x, weight)  # warm-up: first-call allocations happen before any counted phase
    print(f"ready {cell.address if cell else 0}", flush=True)
    try:
        for line in sys.stdin:
            parts = line.split()
            if not parts or parts[0] == "exit":
                break
            step_seq, trace_hex = int(parts[1]), parts[2]
            if cell:
                cell.write(trace_hex, step_seq)
            if parts[0] == "cuda":
                launches, alloc_bytes, syncs = (int(v) for v in parts[3:6])
                pointer = ctypes.c_ulong(0)
                for _ in range(launches):
                    cuda.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
                cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(alloc_bytes))
                for _ in range(syncs):
                    cuda.cuStreamSynchronize(None)
                print("done", flush=True)
                continue
            allocs, nbytes, gemms, ioctls, pages = (int(v) for v in parts[3:8])
            with torch.no_grad():
                held = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(allocs)]
                for _ in range(gemms):
                    F.linear(x, weight)
                del held
            for _ in range(ioctls):
                with contextlib.suppress(OSError):
                    fcntl.ioctl(null_fd, termios.FIONREAD, b"\0\0\0\0")
            if pages:
                with mmap.mmap(-1, pages * mmap.PAGESIZE) as memory:
                    for offset in range(0, pages * mmap.PAGESIZE, mmap.PAGESIZE):
                        memory[offset] = 1
            print("done", flush=True)
    finally:
        if cell:
            cell.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
