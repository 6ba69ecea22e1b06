"""The bpf(2) system call through ctypes: map create / lookup / update / delete / iterate / batch,
program load, object info. What the agent needs to run a compiled program without bcc or LLVM in
its address space (bcc's libbcc alone is ~60 MB resident, its compile another ~200 MB).

Every attr is a zero-filled byte buffer with the fields packed at their offsets in `union bpf_attr`
(include/uapi/linux/bpf.h); the kernel ignores trailing zeroes, so one size serves every command.
Failures raise OSError with the errno, naming the command.
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
import platform
import struct
from dataclasses import dataclass
from functools import lru_cache

# syscall numbers of bpf(2) per architecture
_NR_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}

# commands (enum bpf_cmd)
MAP_CREATE = 0
MAP_LOOKUP_ELEM = 1
MAP_UPDATE_ELEM = 2
MAP_DELETE_ELEM = 3
MAP_GET_NEXT_KEY = 4
PROG_LOAD = 5
OBJ_GET_INFO_BY_FD = 15
MAP_LOOKUP_BATCH = 24
MAP_UPDATE_BATCH = 26
MAP_DELETE_BATCH = 27

# map types (enum bpf_map_type) the programs use; any other type is created from its number just the same
MAP_HASH, MAP_ARRAY, MAP_PERCPU_HASH, MAP_PERCPU_ARRAY, MAP_RINGBUF = 1, 2, 5, 6, 27
PERCPU_MAP_TYPES = frozenset(
    {MAP_PERCPU_HASH, MAP_PERCPU_ARRAY, 10, 21}
)  # +LRU_PERCPU_HASH, PERCPU_CGROUP_STORAGE
# program types (enum bpf_prog_type)
PROG_KPROBE, PROG_TRACEPOINT = 2, 5
BPF_ANY = 0
OBJ_NAME_LEN = 16
INSN_BYTES = 8

_ATTR_BYTES = 144
_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long


_NR = _NR_BPF.get(platform.machine(), -1)


def _call(cmd: int, attr, what: str) -> int:
    """bpf(cmd, attr): the result (>= 0), else OSError(errno, 'what: strerror')."""
    if _NR < 0:
        raise OSError(errno.ENOSYS, f"{what}: no bpf(2) syscall number known for {platform.machine()}")
    result = _libc.syscall(_NR, ct.c_int(cmd), attr, ct.c_uint(len(attr)))
    if result < 0:
        err = ct.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _attr() -> ct.Array:
    return ct.create_string_buffer(_ATTR_BYTES)


def _address(buffer) -> int:
    """The address of a ctypes object, a numpy array or an int (already an address); 0 for None."""
    if buffer is None:
        return 0
    if isinstance(buffer, int):
        return buffer
    if hasattr(buffer, "ctypes"):  # numpy
        return buffer.ctypes.data
    return ct.addressof(buffer)


def _name(text: str) -> bytes:
    """An object name as the kernel takes it: at most 15 bytes of [A-Za-z0-9_.], NUL-terminated."""
    cleaned = "".join(c if c.isalnum() or c in "_." else "_" for c in text)
    return cleaned.encode()[: OBJ_NAME_LEN - 1]


# ---- maps ---------------------------------------------------------------------------------------------
def map_create(
    map_type: int, key_size: int, value_size: int, max_entries: int, flags: int = 0, name: str = ""
) -> int:
    attr = _attr()
    struct.pack_into("<6I", attr, 0, map_type, key_size, value_size, max_entries, flags, 0)
    struct.pack_into("16s", attr, 28, _name(name))
    return _call(MAP_CREATE, attr, f"BPF_MAP_CREATE {name or map_type}")


def _elem_attr(fd: int, key, value, flags: int = 0) -> ct.Array:
    attr = _attr()
    struct.pack_into("<IIQQQ", attr, 0, fd, 0, _address(key), _address(value), flags)
    return attr


def map_lookup(fd: int, key, value) -> bool:
    """Copies the value of `key` into `value` (a ctypes buffer); False when there is no such key."""
    try:
        _call(MAP_LOOKUP_ELEM, _elem_attr(fd, key, value), "BPF_MAP_LOOKUP_ELEM")
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return False
        raise
    return True


def map_update(fd: int, key, value, flags: int = BPF_ANY) -> None:
    _call(MAP_UPDATE_ELEM, _elem_attr(fd, key, value, flags), "BPF_MAP_UPDATE_ELEM")


def map_delete(fd: int, key) -> bool:
    """Deletes `key`; False when it was not there."""
    try:
        _call(MAP_DELETE_ELEM, _elem_attr(fd, key, None), "BPF_MAP_DELETE_ELEM")
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return False
        raise
    return True


def map_next_key(fd: int, key, next_key) -> bool:
    """Writes the key after `key` (None: the first) into `next_key`; False at the end."""
    try:
        _call(MAP_GET_NEXT_KEY, _elem_attr(fd, key, next_key), "BPF_MAP_GET_NEXT_KEY")
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return False
        raise
    return True


def _batch_attr(fd: int, in_batch, out_batch, keys, values, count: int) -> ct.Array:
    attr = _attr()
    struct.pack_into(
        "<QQQQII",
        attr,
        0,
        _address(in_batch),
        _address(out_batch),
        _address(keys),
        _address(values),
        count,
        fd,
    )
    return attr


def _batch_count(attr) -> int:
    return struct.unpack_from("<I", attr, 32)[0]


def map_lookup_batch(fd: int, in_batch, out_batch, keys, values, count: int) -> tuple[int, bool]:
    """One BPF_MAP_LOOKUP_BATCH: (entries copied, whether the map's end was reached). in_batch None
    starts at the beginning; out_batch (a 4-byte-or-larger buffer for hashes) is where to go on."""
    attr = _batch_attr(fd, in_batch, out_batch, keys, values, count)
    try:
        _call(MAP_LOOKUP_BATCH, attr, "BPF_MAP_LOOKUP_BATCH")
    except OSError as exc:
        if exc.errno == errno.ENOENT:  # the end: count holds what this call still copied
            return _batch_count(attr), True
        raise
    return _batch_count(attr), False


def map_update_batch(fd: int, keys, values, count: int) -> int:
    attr = _batch_attr(fd, None, None, keys, values, count)
    _call(MAP_UPDATE_BATCH, attr, "BPF_MAP_UPDATE_BATCH")
    return _batch_count(attr)


def map_delete_batch(fd: int, keys, count: int) -> int:
    """Deletes `count` keys; returns how many were deleted (it stops at the first missing key)."""
    attr = _batch_attr(fd, None, None, keys, None, count)
    try:
        _call(MAP_DELETE_BATCH, attr, "BPF_MAP_DELETE_BATCH")
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise
    return _batch_count(attr)


@dataclass(frozen=True)
class MapInfo:
    """What the kernel says about a map (struct bpf_map_info)."""

    type: int
    id: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str


def _obj_info(fd: int, info_bytes: int, what: str) -> ct.Array:
    """BPF_OBJ_GET_INFO_BY_FD into a zeroed buffer of `info_bytes` (struct bpf_map_info or
    bpf_prog_info; the kernel fills what fits and leaves the rest zero)."""
    info = ct.create_string_buffer(info_bytes)
    attr = _attr()
    struct.pack_into("<IIQ", attr, 0, fd, len(info), ct.addressof(info))
    _call(OBJ_GET_INFO_BY_FD, attr, f"BPF_OBJ_GET_INFO_BY_FD ({what})")
    return info


def map_info(fd: int) -> MapInfo:
    info = _obj_info(fd, 96, "map")
    kind, ident, key_size, value_size, max_entries, flags = struct.unpack_from("<6I", info, 0)
    name = info.raw[24:40].split(b"\0", 1)[0].decode(errors="replace")
    return MapInfo(kind, ident, key_size, value_size, max_entries, flags, name)


def prog_id(fd: int) -> int:
    """The kernel id of a loaded program (what bpftool shows)."""
    return struct.unpack_from("<I", _obj_info(fd, 256, "program"), 4)[0]


# ---- programs -----------------------------------------------------------------------------------------
class VerifierError(OSError):
    """BPF_PROG_LOAD refused the program; `log` holds the verifier's last lines."""

    def __init__(self, err: int, message: str, log: str):
        super().__init__(err, message)
        self.log = log


def prog_load(prog_type: int, insns: bytes, name: str, license: bytes = b"GPL", kern_version: int = 0) -> int:
    """Loads raw instructions; on a refusal retries once with the verifier log on, for the message."""
    code = ct.create_string_buffer(bytes(insns), len(insns))
    licence = ct.create_string_buffer(license)

    def attempt(log) -> int:
        attr = _attr()
        struct.pack_into(
            "<IIQQ", attr, 0, prog_type, len(insns) // INSN_BYTES, ct.addressof(code), ct.addressof(licence)
        )
        if log is not None:
            struct.pack_into("<IIQ", attr, 24, 1, len(log), ct.addressof(log))
        struct.pack_into("<II16s", attr, 40, kern_version, 0, _name(name))
        return _call(PROG_LOAD, attr, f"BPF_PROG_LOAD {name}")

    try:
        return attempt(None)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EINVAL):
            raise
        log = ct.create_string_buffer(1 << 20)
        try:
            return attempt(log)  # a refusal that was transient (it loads now)
        except OSError as again:
            text = log.value.decode(errors="replace").strip()
            tail = " | ".join(text.splitlines()[-3:])
            raise VerifierError(
                again.errno, f"{again.strerror}; verifier: {tail}" if tail else str(again), text
            ) from None


# ---- CPUs -----------------------------------------------------------------------------------------------
def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8] (the kernel's cpu list format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


@lru_cache(maxsize=1)
def possible_cpus() -> int:
    """How many CPUs a per-CPU map holds a value for (/sys/devices/system/cpu/possible)."""
    with open("/sys/devices/system/cpu/possible") as handle:
        return len(parse_cpu_list(handle.read()))


def percpu_value_bytes(value_size: int, ncpus: int | None = None) -> int:
    """A per-CPU map's value as user space reads it: each CPU's value rounded up to 8 bytes."""
    return (value_size + 7) // 8 * 8 * (possible_cpus() if ncpus is None else ncpus)
