"""The profiler-side read of OTEP 4947 through our own BPF program: the opt-in `threadctx` profile's
uprobe on at::_ops::linear::call runs on the stepping thread, in the middle of its token step, reads
that thread's record (the registry lookup every probe uses) and returns the record's span id in the
event's value. Two threads step different requests at once through the publisher's request API; each
event's span id must be the one the OTLP export derives from that token step's row (SpanIds.step_ids
over the rows read back from the process's map), and a thread with no step returns none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from llmobs.bpf.profiles import PROBE_IDS, probes_of
from llmobs.bpf.program import ProbeProgram
from llmobs.bpf.records import FLAG_THREAD, FLAG_TRACKED
from llmobs.bpf.session import AttachSession, Options
from llmobs.otlp.encoder import SpanIds
from llmobs.shm.reader import ShmReader

STEPS = 4
LINEARS = 2  # nn.Linear layers in the child's model: at::_ops::linear::call hits per forward pass

CHILD = r"""
import json, sys, threading, torch
import llmobs
from llmobs.shm import thread_ctx

torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 32))
llmobs.instrument(model, model_id="span-probe")
assert thread_ctx.library() is not None  # loaded now: the agent finds its registry when it attaches
steps = int(sys.argv[1])
inside = threading.Barrier(2, timeout=60)
tids = {}

def run(tenant, prompt):
    tids[tenant] = threading.get_native_id()
    with llmobs.request(torch.tensor([prompt]), tenant=tenant, model_id="span-probe") as req:
        x = torch.randn(1, 8)
        for _ in range(steps):
            req.begin_step()
            inside.wait()  # both threads are inside a step now: the cell holds only one of them
            logits = model(x)
            req.step(logits, token_ids=logits.argmax(-1))

print("ready", flush=True)
sys.stdin.readline()  # the agent is attached
threads = [threading.Thread(target=run, args=t) for t in (("acme", [1, 2, 3]), ("globex", [9, 8]))]
for t in threads:
    t.start()
for t in threads:
    t.join()
with torch.no_grad():
    model(torch.randn(1, 8))  # the main thread runs no step: its hits return no span id
print(json.dumps({"tids": tids, "main": threading.get_native_id()}), flush=True)
sys.stdin.readline()  # the test has read the rows back
"""


@pytest.fixture(scope="module")
def program():
    program = ProbeProgram(probes_of(("threadctx",)))
    yield program
    program.close()


def test_uprobe_on_the_stepping_thread_returns_the_exported_span_id(program):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(STEPS)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip

    def send(line: str) -> None:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()

    try:
        assert proc.stdout.readline() == "ready\n"
        session = AttachSession(proc.pid, Options(profiles=("threadctx",)), program=program)
        session.start()
        assert session.cell_address and session.threads_address
        send("attached")
        result = json.loads(proc.stdout.readline())
        with ShmReader(proc.pid) as reader:
            rows = reader.read_steps(0).rows()
        last, final = session.close()
        send("exit")
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    tids, main = {name: int(tid) for name, tid in result["tids"].items()}, result["main"]
    first = {row["step_seq"]: row for row in rows if row["batch_row"] == 0}
    events = last[(last["probe"] == PROBE_IDS["thread_span"]) & (last["pid"] == proc.pid)]
    for tenant, tid in tids.items():
        mine = events[events["tid"] == tid]
        seqs = sorted(s for s, row in first.items() if row["tenant"] == tenant)
        assert len(seqs) == STEPS, tenant
        # every hit was inside one of this thread's steps: LINEARS per step, each with that step's tag
        assert sorted(mine["step_seq"].tolist()) == sorted(seqs * LINEARS), tenant
        assert (mine["flags"] & (FLAG_THREAD | FLAG_TRACKED) == FLAG_THREAD | FLAG_TRACKED).all()
        step_seq = mine["step_seq"].astype(np.int64)
        traces = pa.array([first[s]["trace_id"] for s in step_seq.tolist()])
        _, export_spans, _ = SpanIds().step_ids(
            np.full(len(mine), proc.pid), traces, step_seq, np.zeros(len(mine), np.int64)
        )
        returned = b"".join(int(v).to_bytes(8, "little") for v in mine["value"].tolist())
        assert returned == export_spans, tenant
    # the two threads' span ids never mix: each thread's are its own steps', all distinct per step
    spans = {int(v) for v in events[np.isin(events["tid"], list(tids.values()))]["value"].tolist()}
    assert len(spans) == 2 * STEPS
    idle = events[events["tid"] == main]
    assert len(idle) == LINEARS and (idle["value"] == 0).all() and not (idle["flags"] & FLAG_THREAD).any()
    # the exact aggregates count every hit per step and sum nothing: a span id is no quantity
    ours = {(proc.pid, PROBE_IDS["thread_span"])}
    totals = {step: tuple(v) for (pid, p, step), v in final["totals"].items() if (pid, p) in ours}
    assert totals == {**{s: (LINEARS, 0, 0) for s in first}, 0: (LINEARS, 0, 0)}
    assert final["problems"] == []
