"""Can an instrumented process here publish its OpenTelemetry contexts? OTEP 4719 (process context):
which of memfd_create and prctl(PR_SET_VMA_ANON_NAME) work, so which name the OTEL_CTX mapping gets
in /proc/PID/maps; OTEP 4947 (thread context): whether the library exporting otel_thread_ctx_v1 is
built. Tried on scratch mappings of this process, named "llmobs-doctor" (never OTEL_CTX: a reader
must not mistake the doctor for a publisher)."""

from __future__ import annotations

import ctypes
import mmap
import os

from llmobs.hostcheck.model import Context, Finding, Row, Status
from llmobs.shm import otel_ctx, thread_ctx

SCRATCH = b"llmobs-doctor"


def _maps_name(address: int) -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(None, 5)
            if int(parts[0].split("-", 1)[0], 16) == address:
                return parts[5].strip() if len(parts) == 6 else ""
    return ""


def _try_mapping(use_memfd: bool) -> tuple[bool, str]:
    """(mapping made, its name after prctl) for a memfd-backed or an anonymous private mapping."""
    fd = -1
    try:
        if use_memfd:
            fd = os.memfd_create(SCRATCH.decode(), otel_ctx.MFD_CLOEXEC | otel_ctx.MFD_ALLOW_SEALING)
            os.ftruncate(fd, mmap.PAGESIZE)
            mm = mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        else:
            mm = mmap.mmap(-1, mmap.PAGESIZE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return False, ""
    finally:
        if fd >= 0:
            os.close(fd)
    try:
        anchor = ctypes.c_char.from_buffer(mm)
        address = ctypes.addressof(anchor)
        del anchor
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(otel_ctx.PR_SET_VMA, otel_ctx.PR_SET_VMA_ANON_NAME, ctypes.c_ulong(address),
                   ctypes.c_ulong(mmap.PAGESIZE), ctypes.c_char_p(SCRATCH))  # fmt: skip
        return True, _maps_name(address)
    finally:
        mm.close()


def check_otel_context(ctx: Context) -> Finding:
    if not ctx.live:
        return Finding(Status.DEGRADED, "not checked (not this host)")
    memfd, memfd_name = _try_mapping(True)
    anon, anon_name = _try_mapping(False)
    if memfd:
        named = memfd_name.startswith("[anon_shmem:")
        shown = "[anon_shmem:OTEL_CTX]" if named else "/memfd:OTEL_CTX (deleted)"
    elif anon and anon_name.startswith("[anon:"):
        shown = "[anon:OTEL_CTX]"
    else:
        return Finding(
            Status.MISSING,
            "neither memfd_create nor naming an anonymous mapping works: no process context (OTEP 4719)",
            "a kernel with memfd_create, or Linux 5.17+ with CONFIG_ANON_VMA_NAME",
        )
    detail = f"process context (OTEP 4719) shows as {shown}"
    if not thread_ctx.available():
        return Finding(
            Status.DEGRADED,
            f"{detail}; thread context (OTEP 4947) off: {thread_ctx.LIBRARY.name} not built",
            "install gcc, libc6-dev and python3-dev, then reinstall llmobs-agent (pip builds the library; "
            "in a checkout: scripts/setup.sh)",
        )
    return Finding(Status.OK, f"{detail}; thread context (OTEP 4947) on: {thread_ctx.SYMBOL} exported")


def process_row(pid: int) -> Row:
    """`doctor --pid N`: the OTEL_CTX of process N as read, as a row (never required)."""
    from llmobs.shm.otel_ctx_reader import FORMAT_MERGED, read_process_context

    def row(status: Status, detail: str, hint: str = "") -> Row:
        return Row("otel_ctx_pid", f"OTEL_CTX of pid {pid}", status, detail, hint)

    try:
        context = read_process_context(pid)
    except OSError as exc:
        return row(Status.MISSING, f"cannot read /proc/{pid}: {exc.strerror or exc}",
                   "check the pid, and run as root (or as the process's user)")  # fmt: skip
    if context is None:
        return row(Status.MISSING, "no OTEL_CTX mapping", "llmobs.instrument() publishes one")
    if context.status != "ok":
        return row(Status.DEGRADED, f"{context.format}: {context.status} ({context.detail})")
    resource = context.resource
    name, instance = resource.get("service.name", "-"), resource.get("service.instance.id", "-")
    who = f"service.name {name}, instance {instance}"
    if context.format != FORMAT_MERGED:
        return row(Status.DEGRADED, f"{context.format} layout: {context.detail}; {who}",
                   "an older llmobs: other OpenTelemetry readers expect OTEP 4719 as merged")  # fmt: skip
    schema = context.attributes.get("threadlocal.schema_version")
    thread = f"; thread context {schema}" if schema else "; no thread context"
    return row(Status.OK, f"OTEP 4719 v{context.version}; {who}{thread}")
