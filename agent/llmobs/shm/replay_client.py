"""Agent side of CMD_REPLAY: ask a workload's flight recorder to replay a token step, wait for the file.

The workload acknowledges at its next step boundary (ack_status: ok, unknown request, busy, or
unsupported when it runs without a recorder), then replays on its `llmobs-replay` thread and renames the
finished result into place (`<map>.replay.<ack_step_seq>.npz`, llmobs.shm.names.replay_path): the file
appearing is the signal, never half a file. Both waits poll with a deadline; the workload never waits.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmobs.errors import NoRecorder, NoResponse, ReplayBusy, ReplayTimeout, UnknownRequest
from llmobs.shm import layout
from llmobs.shm.control import ControlClient
from llmobs.shm.names import replay_path

POLL_S = 0.02


@dataclass(frozen=True)
class Accepted:
    """A replay the workload took on: where its result will appear."""

    path: str
    ack_step_seq: int
    posted_at: float  # time.monotonic()


def post(client: ControlClient, step_seq: int, batch_row: int, window: int, timeout: float) -> Accepted:
    """Post CMD_REPLAY and wait (bounded) for its acknowledgement; each refusal is its own error."""
    posted_at = time.monotonic()
    seq = client.post(layout.CMD_REPLAY, layout.replay_arg(step_seq, batch_row, window))
    ack = client.wait_ack(seq, timeout)
    pid, what = client.pid, f"step_seq {step_seq} row {batch_row}"
    if ack is None:
        raise NoResponse(f"process {pid} did not acknowledge the replay of {what} within {timeout:g} s")
    status = ack["ack_status"]
    if status == layout.ACK_UNKNOWN_REQUEST:
        raise UnknownRequest(f"process {pid}'s flight recorder keeps no request with the token step {what}")
    if status == layout.ACK_BUSY:
        raise ReplayBusy(f"process {pid} is running another replay")
    if status in (layout.ACK_UNSUPPORTED, layout.ACK_UNKNOWN_COMMAND):
        why = "runs without a flight recorder" if status == layout.ACK_UNSUPPORTED else "predates replays"
        raise NoRecorder(f"process {pid} cannot replay: it {why} (ack status {status})")
    if status != layout.ACK_OK:
        raise NoRecorder(f"process {pid} refused the replay with ack status {status}")
    return Accepted(replay_path(client.path, ack["ack_step_seq"]), int(ack["ack_step_seq"]), posted_at)


def wait_file(
    accepted: Accepted,
    timeout: float,
    pid: int,
    progress: Callable[[float], None] | None = None,
    cancelled: Callable[[], bool] = lambda: False,
) -> str:
    """The result file's path once it exists; ReplayTimeout past `timeout` s after the post, or when the
    process exits first or `cancelled()` says so. `progress(elapsed_s)` is called about once a second
    while waiting."""
    deadline = accepted.posted_at + timeout
    next_progress = time.monotonic() + 1.0
    while not os.path.exists(accepted.path):
        now = time.monotonic()
        if not os.path.exists(f"/proc/{pid}"):
            raise ReplayTimeout(
                f"process {pid} exited before it wrote the replay {accepted.path}",
                hint="the replay runs in the workload: keep it running until it is done",
            )
        if now > deadline or cancelled():
            raise ReplayTimeout(f"process {pid} accepted the replay but wrote no result within {timeout:g} s")
        if progress is not None and now >= next_progress:
            progress(now - accepted.posted_at)
            next_progress = now + 1.0
        time.sleep(POLL_S)
    return accepted.path
