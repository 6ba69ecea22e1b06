"""Per-thread tags from the OTEP 4947 thread records: two threads of one process step different
requests at once (the per-process context cell can hold only one of them), and every alloc_cpu
event of each thread carries that thread's own step and trace; a thread that runs no step is tagged
from the cell. While both threads are stopped mid-step, the records are also read from outside the
process (the registry the probes use, then /proc/PID/mem) and their span ids checked against the
OTLP encoder's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from llmobs.bpf.profiles import PROBE_IDS, probes_of
from llmobs.bpf.program import ProbeProgram
from llmobs.bpf.records import FLAG_THREAD, FLAG_TRACKED
from llmobs.bpf.session import AttachSession, Options
from llmobs.bpf.thread_records import find_thread_registry
from llmobs.otlp.encoder import SpanIds
from llmobs.procfs import ProcFS

ALLOCS = 7  # torch.empty calls per thread per step: one c10::alloc_cpu each
STEPS = 3

CHILD = r"""
import json, os, sys, threading, torch
from llmobs.shm import thread_ctx
from llmobs.shm.writer import get_writer

torch.set_num_threads(1)
w = get_writer()
assert thread_ctx.library() is not None  # loaded now: the agent finds it when it attaches
traces = {"a": (0x0A0A, 1), "b": (0x0B0B, 2)}
tenants = {name: w.name(1, "tenant-" + name) for name in traces}
seqs = {"a": [], "b": []}
tids = {}
stepped = threading.Barrier(3, timeout=60)
released = threading.Barrier(3, timeout=60)
done = threading.Barrier(3, timeout=60)

def worker(name):
    tids[name] = threading.get_native_id()
    torch.empty(64, dtype=torch.uint8)  # warm-up: first-call allocations before any counted phase
    for _ in range(int(sys.argv[1])):
        seqs[name].append(w.begin_step(*traces[name], tenants[name], 0))
        stepped.wait()
        released.wait()  # both steps are live now; the cell holds the later one
        held = [torch.empty(64, dtype=torch.uint8) for _ in range(int(sys.argv[2]))]
        del held
        done.wait()
    w.clear_context()

threads = [threading.Thread(target=worker, args=(n,)) for n in traces]
for t in threads:
    t.start()
print("ready", flush=True)
sys.stdin.readline()  # the agent is attached
for _ in range(int(sys.argv[1])):
    stepped.wait()
    print("stepped " + json.dumps({n: seqs[n][-1] for n in seqs}), flush=True)
    sys.stdin.readline()  # the test has read both records from outside
    released.wait()
    held = [torch.empty(64, dtype=torch.uint8) for _ in range(int(sys.argv[2]))]  # no step of its own
    del held
    done.wait()
for t in threads:
    t.join()
print(json.dumps({"tids": tids, "seqs": seqs, "main": threading.get_native_id()}), flush=True)
sys.stdin.readline()
"""


@pytest.fixture(scope="module")
def program():
    program = ProbeProgram(probes_of(("mem",)))
    yield program
    program.close()


def _read(pid: int, address: int, size: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(address)
        return mem.read(size)


def test_each_thread_tagged_with_its_own_step(program):
    # the map in /dev/shm, where the agent looks for it (it is removed when the child exits)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(STEPS), str(ALLOCS)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip

    def send(line: str) -> None:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()

    try:
        assert proc.stdout.readline() == "ready\n"
        session = AttachSession(proc.pid, Options(profiles=("mem",)), program=program)
        session.start()
        registry = find_thread_registry(proc.pid, ProcFS().maps(proc.pid))
        assert session.cell_address and registry and session.threads_address == registry
        send("attached")
        batches, outside = [], []
        for _ in range(STEPS):
            line = proc.stdout.readline()
            assert line.startswith("stepped "), line
            step = json.loads(line.split(" ", 1)[1])
            raw = _read(proc.pid, registry, 1024 * 16)  # both threads wait on a barrier: stopped
            slots = {int.from_bytes(raw[i : i + 4], "little"): int.from_bytes(raw[i + 8 : i + 16], "little")
                     for i in range(0, len(raw), 16)}  # fmt: skip
            outside.append(
                (step, {tid: _read(proc.pid, address, 40) for tid, address in slots.items() if tid})
            )
            send("go")
            batches.append(session.poll())
        result = json.loads(proc.stdout.readline())
        last, final = session.close()
        send("exit")
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    tids, seqs, main = {n: int(t) for n, t in result["tids"].items()}, result["seqs"], result["main"]
    traces = {"a": (0x0A0A, 1), "b": (0x0B0B, 2)}
    # outside reads, through the registry the probes use: each thread's record, its own span
    for step, records in outside:
        for name, tid in tids.items():
            record = records[tid]
            hi, lo = traces[name]
            assert record[24] == 1 and record[0:16] == hi.to_bytes(8, "big") + lo.to_bytes(8, "big")
            assert record[16:24] == SpanIds.step_span_id(proc.pid, f"{hi:016x}{lo:016x}", step[name], 0)
    events = np.concatenate(batches + [last])
    allocs = events[(events["probe"] == PROBE_IDS["alloc_cpu"]) & (events["pid"] == proc.pid)]
    for name, tid in tids.items():
        mine = allocs[allocs["tid"] == tid]
        hi, lo = traces[name]
        # the warm-up alloc came before any step (untracked); then ALLOCS per step, each with its step
        stepped = mine[mine["step_seq"] != 0]
        assert sorted(stepped["step_seq"].tolist()) == sorted(seqs[name] * ALLOCS), name
        assert (stepped["trace_id_hi"] == hi).all() and (stepped["trace_id_lo"] == lo).all()
        assert (stepped["flags"] & (FLAG_THREAD | FLAG_TRACKED) == FLAG_THREAD | FLAG_TRACKED).all()
    # the main thread runs no step: tagged from the cell, which holds one of the two live steps
    from_cell = allocs[(allocs["tid"] == main) & (allocs["step_seq"] != 0)]
    assert len(from_cell) == STEPS * ALLOCS and not (from_cell["flags"] & FLAG_THREAD).any()
    live = [set(pair) for pair in zip(seqs["a"], seqs["b"], strict=True)]
    assert all(int(s) in set().union(*live) for s in from_cell["step_seq"].tolist())
    assert final["problems"] == []
