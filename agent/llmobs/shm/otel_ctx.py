"""Publishes the process's resource attributes as an OpenTelemetry process context (OTEP 4719 as merged,
opentelemetry-specification oteps/profiles/4719-process-ctx.md; format in llmobs.shm.otel_ctx_format).

Other OpenTelemetry tools (the eBPF profiler, OBI, the Datadog agent) find the mapping by its name in
/proc/PID/maps and read it. Publication protocol, as the OTEP orders it:
memfd_create("OTEL_CTX", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_NOEXEC_SEAL) (again without
MFD_NOEXEC_SEAL on older kernels), ftruncate, mmap(PROT_READ | PROT_WRITE, MAP_PRIVATE) and close;
without memfd, an anonymous MAP_PRIVATE mapping; madvise(MADV_DONTFORK); the payload; the header
with monotonic_published_at_ns = 0; a fence; the CLOCK_BOOTTIME timestamp last; then
prctl(PR_SET_VMA, PR_SET_VMA_ANON_NAME, ..., "OTEL_CTX") unconditionally. An anonymous mapping that
cannot be named is unfindable, so that case is a failed publication (the mapping is dropped).

Updating protocol: timestamp 0, fence, the new payload and its pointer and size, fence, a new
timestamp (strictly greater than the last one), prctl again. The payload sits in the mapping right
after the header, in one of two slots used in turn, so an update never rewrites the bytes the
published pointer points at.

Fences: atomic_thread_fence(seq_cst) from the thread-context C library when it is built; without it,
CPython's stores through the mmap are separate C calls, which x86-64 (TSO) keeps in order.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
import uuid

from llmobs import environment
from llmobs.shm import layout, thread_ctx
from llmobs.shm.otel_ctx_format import HEADER, SIGNATURE, TIMESTAMP_OFFSET, VERSION, encode_payload

SIZE = 2 * mmap.PAGESIZE  # the header and two payload slots; a payload that does not fit is not published
SLOT = (SIZE - HEADER.size) // 2 & ~7
PR_SET_VMA = 0x53564D41
PR_SET_VMA_ANON_NAME = 0
MFD_CLOEXEC = 0x0001
MFD_ALLOW_SEALING = 0x0002
MFD_NOEXEC_SEAL = 0x0008  # Linux 6.3+; os has no name for it before Python 3.12
NAME = b"OTEL_CTX"

_lock = threading.Lock()  # one writer: the OTEP's singleton (4947: key-map appends go through it too)
_published: _ProcessContext | None = None
last_failure: str | None = None  # why the last publish_process_context() returned False (doctor, tests)
_orphans: list = []  # mappings a forked child must never unmap (MADV_DONTFORK: the range is not ours)
instance_id = str(uuid.uuid4())  # service.instance.id of this process (regenerated in a forked child)


def default_attributes(model_id: str | None = None) -> dict[str, str]:
    from llmobs.shm.writer import current_writer

    fallback = f"unknown_service:{os.path.basename(sys.executable)}"  # what the OpenTelemetry SDKs report
    name = os.environ.get(environment.OTEL_SERVICE_NAME) or fallback
    attrs = {
        "service.name": name,
        "service.instance.id": instance_id,
        "telemetry.sdk.name": "llmobs",
        "telemetry.sdk.language": "python",
        "process.pid": str(os.getpid()),
    }
    if model_id:
        attrs["llmobs.model_id"] = model_id
    writer = current_writer()
    if writer is not None:
        attrs["llmobs.shm.path"] = writer.path
        attrs["llmobs.shm.abi_version"] = str(layout.ABI_VERSION)
    return attrs


def _boottime_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def _fence() -> None:
    thread_ctx.fence()


def _memfd() -> int | None:
    for flags in (MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_NOEXEC_SEAL, MFD_CLOEXEC | MFD_ALLOW_SEALING):
        try:
            return os.memfd_create("OTEL_CTX", flags)
        except OSError:
            continue
    return None


class _ProcessContext:
    """The mapping, once created; publish() runs the publication or the updating protocol."""

    def __init__(self):
        self.mm: mmap.mmap | None = None
        self.from_memfd = False
        fd = _memfd()
        if fd is not None:
            try:
                os.ftruncate(fd, SIZE)
                self.mm = mmap.mmap(fd, SIZE, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
                self.from_memfd = True
            except OSError:
                self.mm = None
            finally:
                os.close(fd)  # the mapping keeps the memfd alive and visible in /proc/PID/maps
        if self.mm is None:
            self.mm = mmap.mmap(-1, SIZE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.mm.madvise(mmap.MADV_DONTFORK)  # a child must not inherit (and expose) our identity
        anchor = ctypes.c_char.from_buffer(self.mm)
        self.address = ctypes.addressof(anchor)
        del anchor
        self.words = memoryview(self.mm).cast("Q")  # aligned 8-byte stores (the timestamp's atomicity)
        self.published_at = 0
        self.slot = 1
        self.named = False

    def publish(self, payload: bytes) -> bool:
        if len(payload) > SLOT:
            return False
        mm, words = self.mm, self.words
        slot = 1 - self.slot
        start = HEADER.size + slot * SLOT
        stamp = max(_boottime_ns(), self.published_at + 1)  # every update a new, later value
        if self.published_at:  # updating protocol
            words[TIMESTAMP_OFFSET >> 3] = 0
            _fence()
            mm[start : start + len(payload)] = payload
            mm[12:16] = len(payload).to_bytes(4, sys.byteorder)
            words[3] = self.address + start
        else:  # publication protocol: every field but the timestamp, then the timestamp
            mm[start : start + len(payload)] = payload
            HEADER.pack_into(mm, 0, SIGNATURE, VERSION, len(payload), 0, self.address + start)
        _fence()
        words[TIMESTAMP_OFFSET >> 3] = stamp
        self.published_at, self.slot = stamp, slot
        self.named = self._name() or self.named
        return self.from_memfd or self.named  # neither: no reader could ever find it

    def _name(self) -> bool:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            return libc.prctl(PR_SET_VMA, PR_SET_VMA_ANON_NAME, ctypes.c_ulong(self.address),
                              ctypes.c_ulong(SIZE), ctypes.c_char_p(NAME)) == 0  # fmt: skip
        except Exception:  # naming is optional (Linux 5.17+ with CONFIG_ANON_VMA_NAME)
            return False

    def close(self) -> None:
        self.words.release()
        self.mm.close()


def publish_process_context(model_id: str | None = None, extra: dict[str, str] | None = None) -> bool:
    """Publish (or update) this process's OTEL_CTX mapping. Never raises; False if it could not.
    Resource: default_attributes() and `extra`; ProcessContext.attributes: OTEP 4947's threadlocal.*
    reference data when the thread-context library is loaded."""
    global _published, last_failure
    try:
        resource = default_attributes(model_id)
        resource.update(extra or {})
        payload = encode_payload(resource, thread_ctx.reference_attributes())
        with _lock:
            if _published is None:
                _published = _ProcessContext()
            if _published.publish(payload):
                last_failure = None
                return True
            last_failure = (
                f"payload of {len(payload)} B over the {SLOT} B slot"
                if len(payload) > SLOT
                else "no memfd and the anonymous mapping could not be named: no reader could find it"
            )
            _published.close()  # an unnamed anonymous mapping: unfindable, so not a context at all
            _published = None
            return False
    except Exception as exc:
        last_failure = f"{type(exc).__name__}: {exc}"
        return False


def published_address() -> int | None:
    """Where this process's header is (tests), or None."""
    return _published.address if _published is not None else None


def _forget_in_child() -> None:
    global _published, instance_id
    if _published is not None:
        _orphans.append(_published)  # MADV_DONTFORK: the mapping is gone here; never munmap its range
    _published = None
    instance_id = str(uuid.uuid4())


os.register_at_fork(after_in_child=_forget_in_child)
