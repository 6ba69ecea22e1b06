"""What the per-thread tag (OTEP 4947 record, bpf/c/llmobs_events.h llmobs_read_thread_tag) adds to a
probe hit, in BPF run time per program run (kernel.bpf_stats_enabled; the mem profile's programs:
alloc_cpu entry and return, free_cpu, of which the entry and free_cpu read a tag), interleaved rounds,
medians.

One target process (the real map writer, the thread-context library loaded) with a thread that has
stepped (it has a record) and its main thread (no record); the mem profile's alloc_cpu/free_cpu
probes attached; --allocs torch.empty calls a round, in three arms:
  cell    the target's registry left unset: every hit reads the process cell (what was before);
  record  registry set, the stepping thread allocates: slot + record read, no cell read;
  miss    registry set, the main thread allocates: slot read (no match) + the cell read.

    sudo .venv/bin/python -m bench.thread_tag_cost [--rounds 7] [--allocs 20000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from bench.probes import BpfStats, prog_stats

_TARGET = r"""
import sys, threading, torch
from llmobs.shm import thread_ctx
from llmobs.shm.writer import get_writer
torch.set_num_threads(1)
w = get_writer()
assert thread_ctx.library() is not None
go, done = threading.Event(), threading.Event()
def stepper():
    w.begin_step(0x1234, 0x5678, 0, 0)  # this thread's record: valid, step 1
    while True:
        go.wait(); go.clear()
        for _ in range(n[0]):
            torch.empty(64, dtype=torch.uint8)
        done.set()
n = [0]
threading.Thread(target=stepper, daemon=True).start()
torch.empty(64, dtype=torch.uint8)
print("ready", flush=True)
for line in sys.stdin:
    who, count = line.split()
    n[0] = int(count)
    if who == "record":
        go.set(); done.wait(); done.clear()
    else:
        for _ in range(n[0]):
            torch.empty(64, dtype=torch.uint8)
    print("done", flush=True)
"""


def main(argv: list[str] | None = None) -> int:
    from llmobs.bpf.profiles import probes_of
    from llmobs.bpf.program import ProbeProgram
    from llmobs.bpf.session import AttachSession, Options

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--allocs", type=int, default=20_000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    program = ProbeProgram(probes_of(("mem",)))
    proc = subprocess.Popen([sys.executable, "-c", _TARGET], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    per_hit: dict[str, list[float]] = {"cell": [], "record": [], "miss": []}
    try:
        assert proc.stdout.readline() == "ready\n"
        session = AttachSession(proc.pid, Options(profiles=("mem",), sample_n=1000, sample_mode="cpu"),
                                program=program)  # fmt: skip
        session.start()
        if not session.threads_address:
            print("error: the target's thread-context registry was not found", file=sys.stderr)
            print("hint: run scripts/setup.sh (it builds the library)", file=sys.stderr)
            return 1
        fds = list(program._loaded.prog_fds.values())
        with BpfStats():
            for _ in range(args.rounds):
                for arm in ("cell", "record", "miss"):
                    threads = 0 if arm == "cell" else session.threads_address
                    program.set_target(proc.pid, session.cell_address, threads)
                    ns0, cnt0 = prog_stats(fds)
                    proc.stdin.write(f"{'record' if arm != 'miss' else 'main'} {args.allocs}\n")
                    proc.stdin.flush()
                    assert proc.stdout.readline() == "done\n"
                    ns1, cnt1 = prog_stats(fds)
                    per_hit[arm].append((ns1 - ns0) / max(cnt1 - cnt0, 1))
                session.poll()
        session.close()
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        program.close()
    figures = {arm: statistics.median(values) for arm, values in per_hit.items()}
    figures.update({f"{arm}_all": values for arm, values in per_hit.items()})
    figures["record_minus_cell_ns"] = figures["record"] - figures["cell"]
    figures["miss_minus_cell_ns"] = figures["miss"] - figures["cell"]
    figures["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for arm in ("cell", "record", "miss"):
        print(f"{arm:<8} {figures[arm]:7.0f} ns per BPF run (median of {args.rounds})")
    record, miss = figures["record_minus_cell_ns"], figures["miss_minus_cell_ns"]
    print(f"record - cell {record:+.0f} ns, miss - cell {miss:+.0f} ns")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
