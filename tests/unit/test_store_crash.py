"""A writer SIGKILLed mid-ingest: on reopen every batch it reported committed is intact, none is partial.

The child appends batches in a loop, each one token-steps part plus an events part in one transaction, and
writes each committed batch id to a pipe. The parent kills it after a random number of commits, at a
random point of the next batch, reopens the file and checks every batch against what was reported.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from llmobs.store import DuckDBStore

BATCH_ID_STRIDE = 1_000_000  # step_seq = batch_id * stride + row: a row knows its batch

CHILD = textwrap.dedent(
    """
    import os, sys
    import numpy as np, pyarrow as pa
    from llmobs.store import DuckDBStore

    path, fd, stride = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = DuckDBStore(path)
    os.write(fd, b"open\\n")
    batch_id = 0
    while True:
        batch_id += 1
        n = 1000 + (batch_id * 7919) % 20000  # batch sizes vary: some land in the WAL, some in row groups
        seq = batch_id * stride + np.arange(n, dtype=np.int64)
        steps = pa.table({
            "pid": np.full(n, 1, np.int32), "step_seq": seq, "trace_id": [f"{batch_id:032x}"] * n,
            "loss": (seq % 97).astype(np.float32), "t_start_ns": seq, "t_end_ns": seq + 1})
        events = pa.table({
            "pid": np.full(2 * n, 1, np.int32), "ts_ns": np.repeat(seq, 2), "probe": ["alloc_cpu"] * (2 * n),
            "kind": ["mem"] * (2 * n), "step_seq": np.repeat(seq, 2), "value": np.repeat(seq % 4096, 2)})
        store.append({"token_steps": steps, "events": events})
        os.write(fd, f"{batch_id} {n}\\n".encode())
    """
)


def _batch_size(batch_id: int) -> int:
    return 1000 + (batch_id * 7919) % 20000


def _read_lines(fd: int, want: int, timeout_s: float) -> list[str]:
    """Read newline-terminated reports until `want` arrived (or EOF when want is 0); bounded in time."""
    buffer = b""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while want == 0 or len(lines) < want:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"child reported {len(lines)} of {want} lines in {timeout_s} s")
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        lines.extend(line.decode() for line in complete)
    return lines


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_mid_ingest_leaves_every_committed_batch_and_no_partial_one(tmp_path, seed):
    rng = random.Random(seed)
    path = tmp_path / "crash.duckdb"
    read_fd, write_fd = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(write_fd), str(BATCH_ID_STRIDE)], pass_fds=(write_fd,)
    )
    os.close(write_fd)
    try:
        assert _read_lines(read_fd, 1, timeout_s=30) == ["open"]
        target = rng.randint(3, 25)
        reports = _read_lines(read_fd, target, timeout_s=45)
        # Not synchronisation: a random pause so the kill lands at a random point inside the next batch.
        time.sleep(rng.uniform(0, 0.01))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        reports += _read_lines(read_fd, 0, timeout_s=10)  # commits reported before the kill landed
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        os.close(read_fd)
    assert child.returncode == -signal.SIGKILL
    committed = {int(line.split()[0]): int(line.split()[1]) for line in reports}
    assert len(committed) >= target

    with DuckDBStore(path) as store:
        steps = store.query(
            f"SELECT step_seq // {BATCH_ID_STRIDE} AS batch_id, count(*) AS n,"
            " sum(step_seq % 97) AS loss_sum, count(DISTINCT trace_id) AS traces, min(trace_id) AS trace"
            " FROM token_steps GROUP BY ALL"
        ).to_pylist()
        events = dict(
            store.connection.execute(
                f"SELECT step_seq // {BATCH_ID_STRIDE}, count(*) FROM mem_events GROUP BY ALL"
            ).fetchall()
        )
        exact_loss = dict(
            store.connection.execute(
                f"SELECT step_seq // {BATCH_ID_STRIDE}, sum(loss) FROM token_steps GROUP BY ALL"
            ).fetchall()
        )
    present = {row["batch_id"]: row for row in steps}
    for batch_id, n in committed.items():
        row = present.get(batch_id)
        assert row is not None, f"committed batch {batch_id} is missing after the kill"
        assert row["n"] == n and events.get(batch_id) == 2 * n
        assert row["traces"] == 1 and row["trace"] == f"{batch_id:032x}"
        assert exact_loss[batch_id] == row["loss_sum"]
    # A batch the child had not reported may have committed just before the kill - but only whole.
    for batch_id, row in present.items():
        assert batch_id in committed or batch_id == max(committed) + 1
        assert row["n"] == _batch_size(batch_id) and events.get(batch_id) == 2 * _batch_size(batch_id)
    assert set(events) == set(present)
