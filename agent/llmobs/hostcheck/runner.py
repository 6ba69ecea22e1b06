"""Runs the host checks in order, each bounded in time and fenced off: a check that raises, hangs
or prints to stderr becomes a row, never a crash or noise on the terminal."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator

from llmobs.hostcheck import ebpf, gpu, host, otelctx
from llmobs.hostcheck.model import Check, Context, Finding, Row, Status

# What the agent needs for its CPU probe profile; `doctor` exits non-zero unless all of these work.
CPU_PROFILE_CHECKS = ("privileges", "bcc", "uprobe", "tracepoint", "ringbuf")
# What the cuda probe profile, NVML sampling and CUPTI need; optional for the agent as a whole.
GPU_CHECKS = ("libcuda", "cuda_driver", "nvml", "cupti")


def default_checks() -> list[Check]:
    required = set(CPU_PROFILE_CHECKS)
    table = [
        ("privileges", "privileges", host.check_privileges, 2.0),
        ("btf", "BTF", host.check_btf, 2.0),
        # bcc compiles with clang in-process: seconds on a busy 2-core machine.
        ("bcc", "bcc compile+load", ebpf.check_bcc, 20.0),
        ("uprobe", "uprobe", ebpf.check_uprobe, 5.0),
        ("tracepoint", "tracepoint", ebpf.check_tracepoint, 5.0),
        ("ringbuf", "BPF ring buffer", ebpf.check_ringbuf, 20.0),
        ("kernel_headers", "kernel headers", host.check_kernel_headers, 2.0),
        ("tracefs", "tracefs", host.check_tracefs, 2.0),
        ("libcuda", "libcuda", gpu.check_libcuda, 5.0),
        ("cuda_driver", "CUDA driver", gpu.check_cuda_driver, 10.0),
        ("nvml", "NVML", gpu.check_nvml, 10.0),
        ("cupti", "cupti-python", gpu.check_cupti, 10.0),
        ("otel_context", "OpenTelemetry contexts", otelctx.check_otel_context, 2.0),
    ]
    return [Check(cid, title, fn, timeout, cid in required) for cid, title, fn, timeout in table]


@contextlib.contextmanager
def _stderr_to_file() -> Iterator[list[str]]:
    """Sends file descriptor 2 to a temporary file for the block (bcc and libbpf write straight to
    it from C); the block's output is in the yielded list afterwards."""
    captured: list[str] = []
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # stderr closed (`2>&-`) or replaced: nothing to capture
        yield captured
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.append(sink.read().decode(errors="replace"))


def _telling_line(text: str) -> str:
    """The line of captured stderr most worth showing: the first error, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and "errors generated" not in line]
    return errors[0] if errors else (lines[-1] if lines else "")


def run_check(ctx: Context, check: Check, capture_stderr: bool = True) -> Row:
    """One check, in a worker thread joined with a timeout, so a hung kernel call or library load
    costs at most `check.timeout_s`. The thread is a daemon: a check that never returns is left
    behind, reported, and does not keep the process alive."""
    outcome: list[Finding | BaseException] = []

    def work() -> None:
        try:
            outcome.append(check.fn(ctx))
        except BaseException as exc:  # every failure must become a row
            outcome.append(exc)

    start = time.monotonic()
    with _stderr_to_file() if capture_stderr else contextlib.nullcontext([]) as captured:
        worker = threading.Thread(target=work, name=f"doctor-{check.check}", daemon=True)
        worker.start()
        worker.join(check.timeout_s)
    elapsed_ms = (time.monotonic() - start) * 1000
    stderr_tail = _telling_line(captured[0]) if captured else ""

    if not outcome:
        finding = Finding(
            Status.MISSING,
            f"no answer within {check.timeout_s:g} s",
            "the host is overloaded or a kernel/library call hangs; rerun, then check dmesg",
        )
    elif isinstance(outcome[0], BaseException):
        exc = outcome[0]
        finding = Finding(
            Status.MISSING,
            f"check failed: {type(exc).__name__}: {exc}".rstrip(": "),
            "rerun with the error above; if it persists, report it with `llmobs-agent doctor --json`",
        )
    else:
        finding = outcome[0]
    detail = finding.detail
    if finding.status is not Status.OK and stderr_tail and stderr_tail not in detail:
        detail = f"{detail} [stderr: {stderr_tail}]"
    row = Row(check.check, check.title, finding.status, detail, finding.hint, check.required, elapsed_ms)
    ctx.rows[check.check] = row
    return row


def run_checks(
    ctx: Context | None = None, checks: Iterable[Check] | None = None, capture_stderr: bool = True
) -> list[Row]:
    """Every check in order; the live objects they created are released before returning."""
    ctx = ctx if ctx is not None else Context()
    try:
        return [
            run_check(ctx, check, capture_stderr)
            for check in (checks if checks is not None else default_checks())
        ]
    finally:
        ctx.close()


def cpu_profile_ok(rows: Iterable[Row]) -> bool:
    """True when every row the CPU probe profile needs is there and none of them is MISSING."""
    by_id = {row.check: row for row in rows}
    return all(cid in by_id and by_id[cid].status is not Status.MISSING for cid in CPU_PROFILE_CHECKS)
