"""A writer process publishing 10k real token steps and a reader in this process.

- keeps up: the reader advertises its cursor (control.reader_tail) and the test's writer loop only
  runs ahead by less than the ring; the reader must see every step, zero lost.
- paused: the reader reads nothing until the writer is done; it must report exactly N - capacity
  lost and return the last `capacity` steps intact.
- racing: no pacing at all; every position is either seen intact or counted lost, none corrupt.
Each record's fields are all derived from its step index, so a torn record cannot pass the checks.
"""

from __future__ import annotations

import math
import select
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

N_STEPS = 10_000
VOCAB = 32
PROMPT = [1, 2, 3]


def _expected_loss(i: int) -> float:
    k = i % 7  # logits are zeros except logits[target] = k
    return math.log(VOCAB - 1 + math.exp(k)) - k


def child(mode: str, n: int, capacity: int, shm_dir: str) -> None:
    import llmobs
    import torch
    from llmobs.shm import layout
    from llmobs.shm.writer import configure, get_writer

    configure(shm_dir=shm_dir, steps_capacity=capacity)
    w = get_writer()
    tail_at = layout.CONTROL_OFFSET + layout.CONTROL.offsets["reader_tail"]
    print("ready", flush=True)
    sys.stdin.readline()
    logits = torch.zeros(VOCAB)
    with llmobs.request(PROMPT, tenant="tenant-x", session="sess-y") as req:
        for i in range(n):
            if mode == "paced":  # test-harness flow control: stay less than a ring ahead of the reader
                deadline = time.monotonic() + 30
                while w.steps_head - struct.unpack_from("<Q", w.mm, tail_at)[0] > capacity - 2:
                    if time.monotonic() > deadline:
                        print("reader stalled", flush=True)
                        return
                    time.sleep(0.0002)
            t = i % VOCAB
            logits.zero_()
            logits[t] = float(i % 7)
            req.begin_step()
            req.step(logits, target_ids=[t])
    print("done", flush=True)
    sys.stdin.readline()  # keep the map until the reader is finished


@pytest.fixture
def spawn(tmp_path):
    procs = []

    def start(mode: str, capacity: int):
        proc = subprocess.Popen(
            [sys.executable, __file__, mode, str(N_STEPS), str(capacity), str(tmp_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        procs.append(proc)
        assert _line(proc) == "ready"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.stdin.close()
            proc.wait(timeout=30)


def _line(proc, timeout: float = 60) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "writer process did not answer in time"
    return proc.stdout.readline().strip()


def _check_records(cols: dict, first: int, count: int) -> None:
    from llmobs.shm.hashing import trace_id

    steps = np.asarray(cols["step"])
    assert list(steps) == list(range(first, first + count))
    assert (np.asarray(cols["step_seq"]) == steps + 1).all()
    assert (np.asarray(cols["position"]) == steps + len(PROMPT)).all()
    assert (np.asarray(cols["target_id"]) == steps % VOCAB).all()
    assert (np.asarray(cols["token_id"]) == steps % VOCAB).all()
    assert (np.asarray(cols["target_rank"]) == 0).all()
    expected = np.array([_expected_loss(i) for i in steps])
    assert np.allclose(cols["loss"], expected, rtol=0, atol=1e-5)
    assert np.allclose(cols["target_prob"], np.exp(-expected), rtol=0, atol=1e-6)
    assert (np.asarray(cols["latency_ns"]) >= 0).all()
    assert set(cols["trace_id"]) == {trace_id(PROMPT).hex()}
    assert set(cols["tenant"]) == {"tenant-x"} and set(cols["session"]) == {"sess-y"}


def _drain(reader, proc, control=None, until_done=True, timeout: float = 120):
    """Read until every position 0..N-1 is accounted for (seen or lost)."""
    seen = {k: [] for k in ("step", "step_seq", "position", "target_id", "token_id", "target_rank", "loss",
                            "target_prob", "latency_ns", "trace_id", "tenant", "session")}  # fmt: skip
    cursor = lost = corrupt = 0
    deadline = time.monotonic() + timeout
    while cursor < N_STEPS:
        assert time.monotonic() < deadline, f"reader stuck at {cursor}"
        batch = reader.read_steps(cursor)
        lost += batch.lost
        corrupt += batch.corrupt
        for k in seen:
            seen[k].extend(list(batch.columns[k]))
        if batch.next_cursor == cursor:
            assert proc.poll() is None, "writer died"
            time.sleep(0.0005)  # poll interval while the writer has nothing new
        cursor = batch.next_cursor
        if control is not None:
            control.advertise_tail(cursor)
    return seen, lost, corrupt


def test_reader_that_keeps_up_sees_every_step(spawn, tmp_path):
    from llmobs.shm.control import ControlClient
    from llmobs.shm.reader import ShmReader

    capacity = 1024  # far smaller than the run: without keeping up it would lose most steps
    proc = spawn("paced", capacity)
    with ShmReader(proc.pid, shm_dir=str(tmp_path)) as reader, ControlClient(proc.pid, str(tmp_path)) as ctl:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        seen, lost, corrupt = _drain(reader, proc, control=ctl)
        assert _line(proc) == "done"
        assert (lost, corrupt, len(seen["step"])) == (0, 0, N_STEPS)
        _check_records(seen, 0, N_STEPS)
        assert reader.refresh()["steps_dropped"] == 0


def test_paused_reader_counts_exact_drops(spawn, tmp_path):
    from llmobs.shm.reader import ShmReader

    capacity = 2048
    proc = spawn("free", capacity)
    with ShmReader(proc.pid, shm_dir=str(tmp_path)) as reader:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert _line(proc) == "done"  # the reader was "paused" for the whole run
        batch = reader.read_steps(0)
        assert batch.lost == N_STEPS - capacity and batch.corrupt == 0 and len(batch) == capacity
        assert batch.next_cursor == N_STEPS
        _check_records(batch.columns, N_STEPS - capacity, capacity)


def test_racing_reader_never_returns_a_torn_record(spawn, tmp_path):
    from llmobs.shm.reader import ShmReader

    capacity = 256
    proc = spawn("free", capacity)
    with ShmReader(proc.pid, shm_dir=str(tmp_path)) as reader:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        seen, lost, corrupt = _drain(reader, proc)
        assert corrupt == 0 and lost + len(seen["step"]) == N_STEPS
        steps = seen["step"]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
        idx = np.asarray(steps)
        for k in ("step_seq", "position", "target_id", "loss"):  # each record consistent with its own step
            vals = np.asarray(seen[k])
            want = {"step_seq": idx + 1, "position": idx + 3, "target_id": idx % VOCAB,
                    "loss": np.array([_expected_loss(i) for i in idx])}[k]  # fmt: skip
            assert np.allclose(vals, want, atol=1e-5), k


if __name__ == "__main__":
    child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
