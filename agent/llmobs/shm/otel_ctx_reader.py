"""Reads another process's OTEP 4719 process context (the reading protocol as merged), for `inspect`,
`doctor` and the agent: find the mapping in /proc/PID/maps by name, read the header and the payload
with process_vm_readv (/proc/PID/mem when that is refused), re-read the timestamp, decode.

Besides the merged format, it recognises the layout llmobs published before the OTEP merged (the
pre-merge draft: the same 32-byte header, but published_at_ns in ns since the epoch and a bare
Resource payload). A CLOCK_BOOTTIME stamp can never be later than this host's CLOCK_BOOTTIME now; an
epoch stamp always is (unless the host has been up for decades), so the clock tells the two apart.
Version 1 (the OTEP's "may be used for development") is reported as a draft too.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field
from typing import Any

from llmobs.shm.otel_ctx_format import (
    DEVELOPMENT_VERSION,
    HEADER,
    MAPPING_NAMES,
    SIGNATURE,
    VERSION,
    decode_draft_payload,
    decode_payload,
)

MAX_PAYLOAD = 1 << 20  # a bigger payload_size is a corrupt header, not a context
ATTEMPTS = 64  # the reading protocol restarts while an update is in progress; bounded here

FORMAT_MERGED = "otep-4719"  # as merged: CLOCK_BOOTTIME stamp, ProcessContext payload
FORMAT_DRAFT = "pre-merge-draft"  # epoch stamp, bare Resource payload (llmobs before the merge)
FORMAT_DEVELOPMENT = "development-v1"  # version 1


@dataclass
class OtelContext:
    """One process's context as read: `format` says which layout, `status` whether it decoded."""

    pid: int
    mapping: str  # the name it has in /proc/PID/maps
    address: int
    version: int
    format: str
    status: str  # "ok", "updating" (stamp 0 every attempt), "unsupported-version", "undecodable"
    published_at_ns: int = 0
    payload_size: int = 0
    resource: dict[str, Any] = field(default_factory=dict)
    attributes: dict[str, Any] = field(default_factory=dict)
    detail: str = ""

    @property
    def is_draft(self) -> bool:
        return self.format != FORMAT_MERGED

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid, "mapping": self.mapping, "address": f"0x{self.address:x}",
            "version": self.version, "format": self.format, "status": self.status,
            "published_at_ns": self.published_at_ns, "payload_size": self.payload_size,
            "resource": self.resource, "attributes": self.attributes, "detail": self.detail,
        }  # fmt: skip


class _iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = None


def _process_vm_readv(pid: int, address: int, size: int) -> bytes | None:
    """`size` bytes at `address` in `pid`, or None when the call is refused or comes up short."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.process_vm_readv.restype = ctypes.c_ssize_t
        buf = ctypes.create_string_buffer(size)
        local = _iovec(ctypes.cast(buf, ctypes.c_void_p), size)
        remote = _iovec(ctypes.c_void_p(address), size)
        got = _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    except (OSError, AttributeError):
        return None
    return buf.raw if got == size else None


class _Memory:
    """Reads of another process's memory: process_vm_readv, else /proc/PID/mem."""

    def __init__(self, pid: int, proc_root: str):
        self.pid, self.proc_root, self._mem = pid, proc_root, None

    def read(self, address: int, size: int) -> bytes:
        if self.proc_root == "/proc":
            data = _process_vm_readv(self.pid, address, size)
            if data is not None:
                return data
        if self._mem is None:
            self._mem = open(f"{self.proc_root}/{self.pid}/mem", "rb", buffering=0)  # noqa: SIM115
        self._mem.seek(address)
        data = self._mem.read(size)
        if len(data) != size:
            raise OSError(f"short read at 0x{address:x}")
        return data

    def close(self) -> None:
        if self._mem is not None:
            self._mem.close()


def find_mappings(pid: int, proc_root: str = "/proc") -> list[tuple[int, str]]:
    """(start address, name) of each mapping whose name starts with one the OTEP lists."""
    found = []
    with open(f"{proc_root}/{pid}/maps") as maps:
        for line in maps:
            parts = line.split(None, 5)
            name = parts[5].rstrip("\n") if len(parts) == 6 else ""
            if name.startswith(MAPPING_NAMES):
                found.append((int(parts[0].split("-", 1)[0], 16), name))
    return found


def read_process_context(pid: int, proc_root: str = "/proc") -> OtelContext | None:
    """The process's context, or None when it publishes none (no mapping with a valid signature).
    Raises OSError when /proc/PID cannot be read (no such process, no permission)."""
    memory = _Memory(pid, proc_root)
    try:
        for address, name in find_mappings(pid, proc_root):
            try:
                context = _read_one(memory, pid, address, name)
            except OSError:
                continue
            if context is not None:
                return context
        return None
    finally:
        memory.close()


def _read_one(memory: _Memory, pid: int, address: int, name: str) -> OtelContext | None:
    signature, version, size, stamp, pointer = HEADER.unpack(memory.read(address, HEADER.size))
    if signature != SIGNATURE:
        return None  # not a context: skip the mapping
    ctx = OtelContext(pid, name, address, version, FORMAT_MERGED, "ok")
    if version not in (VERSION, DEVELOPMENT_VERSION):
        ctx.status, ctx.detail = "unsupported-version", f"version {version} (this reader knows 1 and 2)"
        return ctx
    for _ in range(ATTEMPTS):
        if not stamp:  # an update is in progress: restart
            os.sched_yield()
            _, version, size, stamp, pointer = HEADER.unpack(memory.read(address, HEADER.size))
            continue
        if not 0 < size <= MAX_PAYLOAD:
            ctx.status, ctx.detail = "undecodable", f"payload_size {size}"
            return ctx
        payload = memory.read(pointer, size)
        again = HEADER.unpack(memory.read(address, HEADER.size))
        if again[3] != stamp:  # changed while we read: restart
            _, version, size, stamp, pointer = again
            continue
        ctx.version, ctx.published_at_ns, ctx.payload_size = version, stamp, size
        ctx.format = _format(version, stamp)
        _decode(ctx, payload)
        return ctx
    ctx.status, ctx.detail = "updating", f"monotonic_published_at_ns was 0 or moving in {ATTEMPTS} reads"
    return ctx


def _format(version: int, stamp: int) -> str:
    if version == DEVELOPMENT_VERSION:
        return FORMAT_DEVELOPMENT
    if stamp > time.clock_gettime_ns(time.CLOCK_BOOTTIME):
        return FORMAT_DRAFT  # not a CLOCK_BOOTTIME stamp of this boot: ns since the epoch
    return FORMAT_MERGED


def _decode(ctx: OtelContext, payload: bytes) -> None:
    try:
        if ctx.format == FORMAT_MERGED:
            ctx.resource, ctx.attributes = decode_payload(payload)
            return
        try:  # a draft: the bare Resource it was written with, else a ProcessContext after all
            ctx.resource = decode_draft_payload(payload)
            ctx.detail = "published_at_ns since the epoch, payload a bare Resource (pre-merge OTEP 4719)"
        except ValueError:
            ctx.resource, ctx.attributes = decode_payload(payload)
            ctx.detail = "ProcessContext payload"
    except ValueError as exc:
        ctx.status, ctx.detail = "undecodable", str(exc)
