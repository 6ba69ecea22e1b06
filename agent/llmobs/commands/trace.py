"""`llmobs-agent trace --pid N --steps K`: CUPTI activity of a running process for K token steps.

Asks the process's in-process collector through the map's control block (CMD_COLLECT_CUPTI), waits
(bounded, with progress on stderr) while it collects, reads the records from the map's CUPTI ring,
and reports kernels and GPU time per token step and the top kernels. With --db the records land in
the store's gpu_ops table joined to their token steps, and the steps' rollups get their GPU time.

A process without a GPU, without CUDA in its torch, or not instrumented gets one line saying exactly
that and a distinct exit code (NoGpu 10, NotTracked 7, NoSuchProcess 3, GpuBusy 12, NoResponse 13).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from llmobs.errors import GpuBusy, MissingLibrary, NoGpu, NoResponse, NotTracked
from llmobs.shm import layout

POLL_S = 0.01  # ring poll period while collecting: the ring must be read faster than it wraps
PROGRESS_S = 1.0
STEPS_GRACE_S = 2.0  # after MARK_END, how long to wait for the last token steps to be committed


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pid", type=int, required=True, help="the instrumented PyTorch process")
    parser.add_argument(
        "--steps", type=int, default=8, metavar="K", help="token steps to collect (default 8)"
    )
    parser.add_argument("--db", metavar="PATH", help="store the records, joined to their token steps, here")
    parser.add_argument(
        "--timeout", type=float, default=60.0, metavar="S", help="give up after S seconds (default 60)"
    )
    parser.add_argument("--top", type=int, default=10, metavar="N", help="top kernels to show (default 10)")
    parser.add_argument("--json", metavar="FILE", help="also write the summary as JSON to FILE")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--shm-dir", default=layout.SHM_DIR, help=argparse.SUPPRESS)
    parser.add_argument("--proc-root", default="/proc", help=argparse.SUPPRESS)
    parser.add_argument("--dev-root", default="/dev", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        print("error: --steps must be >= 1", file=sys.stderr)
        return 2
    if args.timeout <= 0:
        print("error: --timeout must be > 0", file=sys.stderr)
        return 2
    from llmobs.shm.reader import ShmReader

    with ShmReader(args.pid, shm_dir=args.shm_dir, proc_root=args.proc_root) as view:
        check_gpu(args.pid, args.proc_root, args.dev_root)
        result = Tracer(view, args).trace()
    print_report(result, args.top)
    if args.json:
        write_json(args.json, result)
    if args.db:
        store(args.db, result)
        print(f"stored {len(result['records'])} CUPTI records in {args.db}")
    if result["end"] is None:
        raise NoResponse(
            f"process {args.pid} did not finish flushing its CUPTI records within {args.timeout:g} s "
            f"(the report above is partial)"
        )
    return 0


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
        from llmobs.gpu_trace import CuptiCapture, summarize
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
        from llmobs.gpu_trace import steps_in

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


# --- output ----------------------------------------------------------------------------------------
def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3f}"


def print_report(result: dict, top: int = 10, out=None) -> None:
    out = out if out is not None else sys.stdout
    s = result["summary"]
    cap = result["capture"]
    print(
        f"CUPTI trace of pid {result['pid']}, steps {result['first_step']}..{result['last_step']}", file=out
    )
    print(f"{'step_seq':>9} {'tokens':>6} {'kernels':>7} {'gpu_ms':>9} {'kernel_ms':>9} {'memcpy':>6} "
          f"{'launches':>8} {'api':>6}  trace_id", file=out)  # fmt: skip
    for st in s.steps:
        label = str(st.step_seq) if st.step_seq else "untracked"
        print(f"{label:>9} {st.tokens:>6} {st.kernels:>7} {_ms(st.gpu_ns):>9} {_ms(st.kernel_ns):>9} "
              f"{st.memcpy:>6} {st.launches:>8} {st.api_calls:>6}  {st.trace_id}", file=out)  # fmt: skip
    if s.top_kernels:
        print(f"top {min(top, len(s.top_kernels))} kernels by GPU time:", file=out)
        for k in s.top_kernels:
            print(
                f"  {_ms(k.total_ns):>9} ms {k.count:>6}x {k.mean_ns / 1e3:>9.1f} us  {k.name[:120]}",
                file=out,
            )
    print(f"records {s.records} (kernels {s.kernels}); joined to token steps {s.joined}, "
          f"untracked {s.untracked}, step not read {s.unjoined}", file=out)  # fmt: skip
    if cap.clock is not None:
        c = cap.clock
        print(f"clock fit: CUPTI -> CLOCK_MONOTONIC offset {c.offset_ns} ns, drift {c.drift_ppm:.3f} ppm, "
              f"residual {c.residual_ns:.0f} ns rms ({c.max_residual_ns:.0f} max, {c.samples} samples)",
              file=out)  # fmt: skip
    if cap.end is not None:
        e = cap.end
        print(f"drops: CUPTI {e.cupti_dropped}, collector {e.collector_dropped}, overwritten before read "
              f"{cap.lost}, corrupt {cap.corrupt}; records without a step {e.unattributed}"
              + ("; CUPTI was taken over by another tool mid-way" if e.lost_ownership else ""),
              file=out)  # fmt: skip


def summary_json(result: dict) -> dict:
    s = result["summary"]
    cap = result["capture"]
    return {
        "pid": result["pid"], "first_step": result["first_step"], "last_step": result["last_step"],
        "records": s.records, "kernels": s.kernels, "joined": s.joined, "untracked": s.untracked,
        "unjoined": s.unjoined,
        "steps": [vars(st) for st in s.steps],
        "top_kernels": [{"name": k.name, "count": k.count, "total_ns": k.total_ns} for k in s.top_kernels],
        "clock": vars(cap.clock) if cap.clock else None,
        "end": vars(cap.end) if cap.end else None,
        "lost": cap.lost, "corrupt": cap.corrupt,
        "token_steps": sorted(set(result["steps"]["step_seq"].tolist())),
    }  # fmt: skip


def write_json(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(summary_json(result), f, indent=1)


def store(db: str, result: dict) -> None:
    """Append the token steps (those not in the store yet), the CUPTI records and the clock fit; then
    recompute the steps' rollups so they carry their GPU time."""
    import numpy as np

    from llmobs import clock
    from llmobs.correlate import correlate
    from llmobs.gpu_trace import gpu_ops_rows
    from llmobs.store import DuckDBStore

    pid, steps = result["pid"], result["steps"]
    with DuckDBStore(db) as st:
        seqs = steps["step_seq"]
        if len(seqs):
            have = {
                r[0]
                for r in st.connection.execute(
                    "SELECT DISTINCT step_seq FROM token_steps WHERE pid = ? AND step_seq BETWEEN ? AND ?",
                    [pid, int(seqs.min()), int(seqs.max())],
                ).fetchall()
            }
            keep = ~np.isin(seqs, list(have)) if have else np.ones(len(seqs), bool)
            idx = np.flatnonzero(keep)
            new_steps = {k: (v[keep] if isinstance(v, np.ndarray) else [v[i] for i in idx])
                         for k, v in steps.items()}  # fmt: skip
        else:
            new_steps = steps
        batch = {"gpu_ops": gpu_ops_rows(pid, result["records"], result["names"], steps)}
        if len(new_steps["step_seq"]):
            batch["token_steps"] = new_steps
        st.append(batch)
        cap = result["capture"]
        if cap.clock is not None:
            c = cap.clock
            fit = clock.ClockFit(c.ref_mono_ns, c.offset_ns, c.drift_ppm, c.residual_ns, c.max_residual_ns,
                                 c.samples)  # fmt: skip
            st.record_clock_fit("cupti", fit, pid=pid)
        since = int(steps["t_start_ns"].min()) if len(steps["t_start_ns"]) else 0
        correlate(st.connection, since_ns=since, pid=pid)
