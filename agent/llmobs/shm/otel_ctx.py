"""Publishes the process's resource attributes in the OpenTelemetry process-context format (OTEP 4719).

Other OpenTelemetry eBPF tools (the eBPF profiler) find a mapping named OTEL_CTX in /proc/PID/maps
and read from it: signature "OTEL_CTX" (char[8], written last), version u32 = 2, payload_size u32,
published_at_ns u64 (ns since the epoch; 0 while an update is in progress), payload pointer u64,
then the payload: an opentelemetry.proto.resource.v1.Resource protobuf. We place the payload right
after the 32-byte header in the same mapping. Implemented: publication (memfd_create("OTEL_CTX"),
falling back to an anonymous mapping; MADV_DONTFORK; prctl(PR_SET_VMA_ANON_NAME) unconditionally,
errors ignored) and the update protocol. Not implemented: EntityRefs, non-string attribute values.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import struct
import sys
import threading
import time
import uuid

from llmobs import environment

SIGNATURE = b"OTEL_CTX"
VERSION = 2
HEADER = struct.Struct("<8sIIQQ")  # signature, version, payload_size, published_at_ns, payload pointer
SIZE = 2 * mmap.PAGESIZE  # header + payload; a payload that does not fit is not published
PR_SET_VMA = 0x53564D41
PR_SET_VMA_ANON_NAME = 0

_lock = threading.Lock()
_published: _ProcessContext | None = None
instance_id = str(uuid.uuid4())  # service.instance.id of this process (regenerated in a forked child)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def encode_resource(attributes: dict[str, str]) -> bytes:
    """Resource{attributes: [KeyValue{key, value: AnyValue{string_value}}]} in protobuf wire format."""
    out = b""
    for key, value in attributes.items():
        any_value = _field(1, value.encode("utf-8"))  # AnyValue.string_value = 1
        out += _field(1, _field(1, key.encode("utf-8")) + _field(2, any_value))  # Resource.attributes = 1
    return out


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
        attrs["llmobs.shm.abi_version"] = "1"
    return attrs


class _ProcessContext:
    def __init__(self):
        self.mm = None
        try:
            fd = os.memfd_create("OTEL_CTX", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, SIZE)
                self.mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)  # the mapping keeps the memfd alive and visible in /proc/PID/maps
        except OSError:
            self.mm = mmap.mmap(-1, SIZE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(OSError, AttributeError):
            self.mm.madvise(mmap.MADV_DONTFORK)  # a child must not inherit (and expose) our identity
        anchor = ctypes.c_char.from_buffer(self.mm)
        self.address = ctypes.addressof(anchor)
        del anchor

    def publish(self, payload: bytes) -> bool:
        if HEADER.size + len(payload) > SIZE:
            return False
        mm = self.mm
        first = mm[:8] != SIGNATURE
        if not first:
            struct.pack_into("<Q", mm, 16, 0)  # published_at_ns = 0: update in progress
        mm[HEADER.size : HEADER.size + len(payload)] = payload
        struct.pack_into("<IIQQ", mm, 8, VERSION, len(payload), 0, self.address + HEADER.size)
        struct.pack_into("<Q", mm, 16, time.time_ns())  # CPython's stores are ordered on x86-64
        if first:
            mm[:8] = SIGNATURE  # last: readers never see a half-written context
        self._name()
        return True

    def _name(self) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_VMA, PR_SET_VMA_ANON_NAME, ctypes.c_ulong(self.address), ctypes.c_ulong(SIZE),
                       ctypes.c_char_p(b"OTEL_CTX"))  # fmt: skip
        except Exception:  # naming is optional (Linux 5.17+ with CONFIG_ANON_VMA_NAME)
            pass


def publish_process_context(model_id: str | None = None, extra: dict[str, str] | None = None) -> bool:
    """Publish (or update) this process's OTEL_CTX mapping. Never raises; False if it could not."""
    global _published
    try:
        attrs = default_attributes(model_id)
        attrs.update(extra or {})
        with _lock:
            if _published is None:
                _published = _ProcessContext()
            return _published.publish(encode_resource(attrs))
    except Exception:
        return False


def read_process_context(pid: int, proc_root: str = "/proc") -> dict[str, str] | None:
    """Reader side (tests, `inspect`): find the OTEL_CTX mapping of `pid` and decode its attributes."""
    with open(f"{proc_root}/{pid}/maps") as f:
        lines = [ln for ln in f if "OTEL_CTX" in ln]
    with open(f"{proc_root}/{pid}/mem", "rb", buffering=0) as mem:
        for line in lines:
            start = int(line.split("-", 1)[0], 16)
            mem.seek(start)
            raw = mem.read(HEADER.size)
            sig, version, size, published, ptr = HEADER.unpack(raw)
            if sig != SIGNATURE or version != VERSION or not published or size > SIZE:
                continue
            mem.seek(ptr)
            payload = mem.read(size)
            mem.seek(start)
            if HEADER.unpack(mem.read(HEADER.size))[3] != published:
                continue  # updated while we read
            return decode_resource(payload)
    return None


def decode_resource(payload: bytes) -> dict[str, str]:
    """Decode string attributes of a Resource (the subset encode_resource writes)."""

    def fields(buf: bytes):
        i = 0
        while i < len(buf):
            key, i = _read_varint(buf, i)
            if key & 7 != 2:
                raise ValueError("unexpected wire type")
            length, i = _read_varint(buf, i)
            yield key >> 3, buf[i : i + length]
            i += length

    out = {}
    for number, kv in fields(payload):
        if number != 1:
            continue
        parts = dict(fields(kv))
        value = dict(fields(parts.get(2, b""))).get(1, b"")
        out[parts.get(1, b"").decode()] = value.decode()
    return out


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _forget_in_child() -> None:
    global _published, instance_id
    _published = None  # MADV_DONTFORK: the mapping is gone in the child
    instance_id = str(uuid.uuid4())


os.register_at_fork(after_in_child=_forget_in_child)
