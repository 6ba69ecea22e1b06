"""`llmobs-agent trace --pid N --steps K`: CUPTI activity of a running process for K token steps.

Asks the process's in-process collector through the map's control block (CMD_COLLECT_CUPTI), waits
(bounded, with progress on stderr) while it collects, reads the records from the map's CUPTI ring,
and reports kernels and GPU time per token step and the top kernels (the protocol is
llmobs.gpu.tracer). With --db the records land in the store's gpu_ops table joined to their token
steps, through the same Pipeline as `attach` (a CuptiSource batch), and the steps' rollups get their
GPU time.

A process without a GPU, without CUDA in its torch, or not instrumented gets one line saying exactly
that and a distinct exit code (NoGpu 10, NotTracked 7, NoSuchProcess 3, GpuBusy 12, NoResponse 13).
"""

from __future__ import annotations

import argparse
import json
import sys

from llmobs.errors import NoResponse, StoreError, UsageError
from llmobs.gpu.tracer import Tracer, check_gpu
from llmobs.pipeline.sources import ShmSource
from llmobs.shm import layout


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
        raise UsageError(f"--steps must be >= 1, not {args.steps}", hint="see `llmobs-agent trace --help`")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0, not {args.timeout}", hint="see `llmobs-agent trace --help`")
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
    if result["capture"].end is None:
        raise NoResponse(
            f"process {args.pid} did not finish flushing its CUPTI records within {args.timeout:g} s "
            f"(the report above is partial)"
        )
    return 0


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
    """Store a trace through the pipeline: the CUPTI records and the token steps the store does not
    hold yet go to the store writer as one CuptiSource batch, and the pipeline's close commits them and
    re-rolls the steps so their rollups carry their GPU time. The clock fit is recorded first."""
    from llmobs.gpu.cupti_source import CuptiSource, clock_fit, stored_step_seqs
    from llmobs.pipeline import Pipeline
    from llmobs.store.sink import agent_store

    pid = result["pid"]
    st = agent_store(db)
    try:
        fit = clock_fit(result)
        if fit is not None:
            st.record_clock_fit("cupti", fit, pid=pid)
        source = CuptiSource(result, stored_step_seqs(st.connection, pid, result["steps"]))
    except BaseException:
        st.close()
        raise
    pipeline = Pipeline(st, pid, snapshot=False, owns_store=True, shm=_TracedStepsOnly(pid), detector=None)
    while (batch := source.poll()) is not None:
        pipeline.add_batch(batch)
    summary = pipeline.close()
    failed = summary.failed_rows + summary.dropped_rows
    if failed or summary.store_error:
        raise StoreError(
            f"the trace was not stored whole in {db}: {failed:,} rows not committed"
            + (f" ({summary.store_error})" if summary.store_error else "")
        )


class _TracedStepsOnly(ShmSource):
    """The pipeline's map source, kept shut: a trace stores the token steps of the range it collected
    (its CuptiSource's), not everything the map's ring still holds."""

    def _open(self) -> bool:
        return False
