"""What publishing the OTEP 4947 thread record costs per token step (issue 19; target <= 1 us).

Figures per step, from --rounds rounds of --steps calls on one thread, in thread CPU time (the
publishing thread's own, so a busy host's other processes do not count), the fastest round and the
median:
  - attach: llmobs.shm.thread_ctx.attach alone (the span id's blake2b, the attribute bytes, the ctypes
    call that writes the record), what ShmWriter.begin_step adds to every step;
  - begin_step with and without it: the real map writer's begin_step in a temporary map, the thread
    record switched off by pointing LLMOBS_THREAD_CTX_LIB at nothing in a second interpreter (so the
    two arms differ only by the record), the difference per step.

    .venv/bin/python -m bench.thread_ctx_cost [--steps 50000] [--rounds 9] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from llmobs import environment

_ARM = r"""
import json, os, sys, time
from llmobs.shm import thread_ctx
steps, rounds = int(sys.argv[1]), int(sys.argv[2])
os.environ["LLMOBS_SHM_DIR"] = sys.argv[3]
from llmobs.shm.writer import get_writer
w = get_writer()
out = {"library": thread_ctx.available(), "attach_ns": [], "begin_step_ns": []}
tenant = w.name(1, "acme")
pid = os.getpid()
for _ in range(rounds):
    t0 = time.thread_time_ns()
    for seq in range(1, steps + 1):
        thread_ctx.attach(pid, 0x1234, 0x5678, seq, tenant)
    out["attach_ns"].append((time.thread_time_ns() - t0) / steps)
    t0 = time.thread_time_ns()
    for _ in range(steps):
        w.begin_step(0x1234, 0x5678, tenant, 0)
    out["begin_step_ns"].append((time.thread_time_ns() - t0) / steps)
w.close()
print(json.dumps(out))
"""


def _arm(steps: int, rounds: int, with_library: bool) -> dict:
    env = dict(os.environ)
    if not with_library:
        env[environment.LLMOBS_THREAD_CTX_LIB] = "/nonexistent/libllmobs_otel_thread_ctx.so"
    with tempfile.TemporaryDirectory() as shm_dir:
        proc = subprocess.run([sys.executable, "-c", _ARM, str(steps), str(rounds), shm_dir], env=env,
                              capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", type=str, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    on = _arm(args.steps, args.rounds, True)
    if not on["library"]:
        print("error: the thread-context library is not built", file=sys.stderr)
        print("hint: run scripts/setup.sh (it builds agent/llmobs/shm/c/libllmobs_otel_thread_ctx.so)",
              file=sys.stderr)  # fmt: skip
        return 1
    off = _arm(args.steps, args.rounds, False)
    figures = {}
    for how, pick in (("min", min), ("median", statistics.median)):
        figures[f"attach_ns_{how}"] = pick(on["attach_ns"])
        figures[f"begin_step_ns_with_record_{how}"] = pick(on["begin_step_ns"])
        figures[f"begin_step_ns_without_record_{how}"] = pick(off["begin_step_ns"])
        figures[f"begin_step_added_ns_{how}"] = pick(on["begin_step_ns"]) - pick(off["begin_step_ns"])
    figures["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    figures["steps"], figures["rounds"] = args.steps, args.rounds
    for key, value in figures.items():
        print(f"{key:<40} {value:.0f}" if isinstance(value, float) else f"{key:<40} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
