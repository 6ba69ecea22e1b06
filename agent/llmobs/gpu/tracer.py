"""One CUPTI trace of a running process, the agent's side of the protocol (docs/gpu-check.md).

Asks the process's in-process collector through the map's control block (CMD_COLLECT_CUPTI), waits
(bounded, with progress lines) while it collects, reads the records from the map's CUPTI ring until the
collector's MARK_END, then the token steps of the collected range. `check_gpu` says, before anything is
asked, why a process cannot have GPU work.
"""

from __future__ import annotations

import os
import sys
import time

from llmobs.errors import GpuBusy, MissingLibrary, NoGpu, NoResponse, NotTracked
from llmobs.shm import layout

POLL_S = 0.01  # ring poll period while collecting: the ring must be read faster than it wraps
PROGRESS_S = 1.0
STEPS_GRACE_S = 2.0  # after MARK_END, how long to wait for the last token steps to be committed


def check_gpu(pid: int, proc_root: str = "/proc", dev_root: str = "/dev") -> None:
    """NoGpu, saying exactly why, unless the process has the CUDA driver (libcuda.so) loaded."""
    from llmobs.procfs import ProcFS

    libs = {os.path.basename(m.path) for m in ProcFS(proc_root).maps(pid)}
    if any(lib.startswith("libcuda.so") for lib in libs):
        return
    device = os.path.join(dev_root, "nvidia0")
    if not os.path.exists(device):
        raise NoGpu(
            f"cannot trace process {pid}: this host has no NVIDIA GPU ({device} is absent) and the process "
            f"has not loaded the CUDA driver (no libcuda.so in {proc_root}/{pid}/maps)"
        )
    if any(lib.startswith(("libtorch_cuda", "libc10_cuda")) for lib in libs):
        raise NoGpu(
            f"cannot trace process {pid}: its torch has CUDA but it has not initialised it "
            f"(libtorch_cuda is loaded, libcuda.so is not): it has run nothing on the GPU"
        )
    raise NoGpu(
        f"cannot trace process {pid}: it runs no CUDA (its torch is CPU-only: neither libtorch_cuda "
        f"nor libcuda.so is in {proc_root}/{pid}/maps)"
    )


class Tracer:
    """One trace: post the command, wait for the acknowledgement, read the ring until MARK_END."""

    def __init__(self, view, args, out=sys.stderr):
        self.view = view
        self.args = args
        self.out = out
        self.pid = args.pid

    def say(self, line: str) -> None:
        if not self.args.quiet:
            print(f"trace: {line}", file=self.out, flush=True)

    def trace(self) -> dict:
        from llmobs.gpu.records import CuptiCapture, summarize
        from llmobs.shm.control import ControlClient

        args = self.args
        deadline = time.monotonic() + args.timeout
        header = self.view.refresh()
        cupti_cursor, steps_cursor = header["cupti_head"], header["steps_head"]
        capture = CuptiCapture()
        with ControlClient(self.pid, args.shm_dir) as control:
            seq = control.post(layout.CMD_COLLECT_CUPTI, args.steps)
            self.say(f"asked process {self.pid} for CUPTI activity of {args.steps} token steps")
            ack = self._wait_ack(control, seq, deadline)
            cupti_cursor = self._read(capture, cupti_cursor)
            self._check_ack(ack, capture)
            first = ack["ack_step_seq"]
            self.say(f"collecting from step {first}")
            cupti_cursor = self._collect(capture, cupti_cursor, first, deadline)
        last = capture.end.last_step if capture.end else max(first, self._current_step() - 1)
        steps = self._read_steps(steps_cursor, first, last, deadline)
        records = capture.array()
        self.view.read_names()
        names = dict(self.view.names)
        summary = summarize(records, names, steps, top=args.top)
        return {
            "pid": self.pid, "first_step": first, "last_step": last, "records": records, "names": names,
            "steps": steps, "summary": summary, "capture": capture,
        }  # fmt: skip

    # --- steps of the protocol -------------------------------------------------------------------
    def _wait_ack(self, control, seq: int, deadline: float) -> dict:
        next_progress = time.monotonic() + PROGRESS_S
        while True:
            ack = control.wait_ack(seq, timeout=min(PROGRESS_S, max(0.0, deadline - time.monotonic())))
            if ack is not None:
                return ack
            now = time.monotonic()
            if now >= deadline:
                control.post(layout.CMD_NONE)  # withdraw: a later step must not start a collection
                idle = self._idle_s()
                raise NoResponse(
                    f"process {self.pid} did not start a token step within {self.args.timeout:g} s"
                    + (f" (its last step started {idle:.1f} s ago)" if idle is not None else " (no step yet)")
                )
            if now >= next_progress:
                idle = self._idle_s()
                self.say(
                    f"waiting for process {self.pid} to start a token step"
                    + (f" (last one {idle:.1f} s ago)" if idle is not None else "")
                )
                next_progress = now + PROGRESS_S

    def _check_ack(self, ack: dict, capture) -> None:
        status = ack["ack_status"]
        if status == layout.ACK_OK:
            return
        reason = ""
        if capture.statuses:
            self.view.read_names()
            reason = self.view.name(capture.statuses[-1][2])
        pid = self.pid
        if status == layout.ACK_NO_GPU:
            raise NoGpu(
                f"process {pid} has no usable GPU: " + (reason or "torch.cuda.is_available() is False")
            )
        if status == layout.ACK_BUSY:
            raise GpuBusy(f"process {pid} cannot collect CUPTI now: " + (reason or "CUPTI is busy"))
        if status == layout.ACK_UNSUPPORTED:
            raise MissingLibrary(
                f"process {pid} has CUDA but no CUPTI collector: "
                + (reason or "llmobs.cupti is not installed in it (instrument() registers it)"),
                hint="pip install cupti-python where the workload runs, and call llmobs.instrument(model)",
            )
        raise NotTracked(
            f"process {pid} does not know the COLLECT_CUPTI command (acknowledged with status {status})",
            hint="the workload's llmobs is older than this agent; upgrade it",
        )

    def _read(self, capture, cursor: int) -> int:
        self.view.refresh()
        got = self.view.read_cupti(cursor)
        capture.add(got)
        return got.next_cursor

    def _collect(self, capture, cursor: int, first: int, deadline: float) -> int:
        next_progress = time.monotonic() + PROGRESS_S
        while capture.end is None and time.monotonic() < deadline:
            cursor = self._read(capture, cursor)
            if capture.end is not None:
                break
            now = time.monotonic()
            if now >= next_progress:
                done = min(self.args.steps, max(0, self._current_step() - first))
                self.say(f"step {done}/{self.args.steps}, {len(capture.records)} records")
                next_progress = now + PROGRESS_S
            time.sleep(POLL_S)
        if capture.end is not None:
            e = capture.end
            self.say(f"collected steps {e.first_step}..{e.last_step}: {e.written} records")
        return cursor

    def _read_steps(self, cursor: int, first: int, last: int, deadline: float) -> dict:
        from llmobs.gpu.records import steps_in

        grace = min(deadline, time.monotonic() + STEPS_GRACE_S)
        columns: dict | None = None
        while True:
            batch = self.view.read_steps(cursor)
            part = steps_in(batch.columns, first, last)
            columns = part if columns is None else _concat(columns, part)
            cursor = batch.next_cursor
            have = set(columns["step_seq"].tolist())
            if all(s in have for s in range(first, last + 1)) or time.monotonic() >= grace:
                return columns
            time.sleep(POLL_S)

    def _current_step(self) -> int:
        ctx = self.view.context()
        return ctx["step_seq"] if ctx else 0

    def _idle_s(self) -> float | None:
        from llmobs import clock

        beat = self.view.refresh()["heartbeat_ns"]
        return (clock.monotonic_ns() - beat) / 1e9 if beat else None


def _concat(a: dict, b: dict) -> dict:
    import numpy as np

    return {k: (np.concatenate([a[k], b[k]]) if isinstance(a[k], np.ndarray) else list(a[k]) + list(b[k]))
            for k in a}  # fmt: skip
