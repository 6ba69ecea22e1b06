"""Attaching loaded BPF programs to uprobes and tracepoints with perf_event_open(2), as bcc does.

A uprobe is a perf event of the `uprobe` PMU (config1 = the file's path, config2 = the file offset,
the retprobe bit of config for a return probe) opened for one process; a tracepoint is a
PERF_TYPE_TRACEPOINT event (config = its id in tracefs) opened for every process on CPU 0 (a BPF
program on a tracepoint runs on every CPU whichever CPU its event was opened on). The program goes on
with PERF_EVENT_IOC_SET_BPF; closing the perf fd removes both, also when the agent is SIGKILLed,
so nothing is ever written to tracefs' uprobe_events.
"""

from __future__ import annotations

import ctypes as ct
import errno
import fcntl
import os
import platform
import struct
from dataclasses import dataclass
from functools import lru_cache

_NR_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241, "ppc64le": 319, "s390x": 331, "riscv64": 241}
PERF_TYPE_TRACEPOINT = 2
PERF_FLAG_FD_CLOEXEC = 8
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_EVENT_IOC_SET_BPF = 0x40042408
_ATTR_BYTES = 128  # PERF_ATTR_SIZE_VER7; the kernel takes any known size
UPROBE_PMU = "/sys/bus/event_source/devices/uprobe"
TRACEFS_EVENTS = ("/sys/kernel/tracing/events", "/sys/kernel/debug/tracing/events")

_libc = ct.CDLL(None, use_errno=True)
_libc.syscall.restype = ct.c_long


@dataclass(frozen=True)
class PerfLink:
    """One perf event carrying one of our programs: closing `fd` detaches it."""

    fd: int
    what: str  # e.g. "uprobe libc10.so+0x91f10 pid 42" or "tracepoint sched:sched_switch"


def _perf_event_open(attr: ct.Array, pid: int, cpu: int, what: str) -> int:
    nr = _NR_PERF_EVENT_OPEN.get(platform.machine())
    if nr is None:
        raise OSError(
            errno.ENOSYS, f"{what}: no perf_event_open syscall number known for {platform.machine()}"
        )
    fd = _libc.syscall(nr, attr, ct.c_int(pid), ct.c_int(cpu), ct.c_int(-1), ct.c_ulong(PERF_FLAG_FD_CLOEXEC))
    if fd < 0:
        err = ct.get_errno()
        raise OSError(err, f"perf_event_open for {what}: {os.strerror(err)}")
    return fd


def _attr(kind: int, config: int, config1: int = 0, config2: int = 0) -> ct.Array:
    attr = ct.create_string_buffer(_ATTR_BYTES)
    # type, size, config, sample_period = 1; wakeup_events = 1; config1, config2
    struct.pack_into("<IIQQ", attr, 0, kind, _ATTR_BYTES, config, 1)
    struct.pack_into("<I", attr, 48, 1)
    struct.pack_into("<QQ", attr, 56, config1, config2)
    return attr


def _set_bpf(fd: int, prog_fd: int, what: str) -> None:
    try:
        fcntl.ioctl(fd, PERF_EVENT_IOC_SET_BPF, prog_fd)
        fcntl.ioctl(fd, PERF_EVENT_IOC_ENABLE, 0)
    except OSError as exc:
        os.close(fd)
        raise OSError(exc.errno, f"attaching the program to {what}: {exc.strerror}") from None


@lru_cache(maxsize=1)
def uprobe_pmu() -> tuple[int, int]:
    """(the uprobe PMU's perf type, the config bit that makes a probe a return probe)."""
    try:
        with open(f"{UPROBE_PMU}/type") as handle:
            kind = int(handle.read())
        with open(f"{UPROBE_PMU}/format/retprobe") as handle:
            bit = int(handle.read().strip().split(":")[1].split("-")[0])  # "config:0"
    except (OSError, ValueError, IndexError) as exc:
        raise OSError(errno.ENOTSUP, f"this kernel has no uprobe perf PMU ({UPROBE_PMU}): {exc}") from None
    return kind, bit


def attach_uprobe(prog_fd: int, path: str, offset: int, pid: int, retprobe: bool = False) -> PerfLink:
    """Runs the program at file `offset` of `path` (uretprobe: when that function returns), for `pid`."""
    kind, bit = uprobe_pmu()
    what = f"{'uretprobe' if retprobe else 'uprobe'} {path}+{offset:#x} pid {pid}"
    name = ct.create_string_buffer(path.encode())
    attr = _attr(kind, (1 << bit) if retprobe else 0, ct.addressof(name), offset)
    fd = _perf_event_open(attr, pid, -1, what)
    _set_bpf(fd, prog_fd, what)
    return PerfLink(fd, what)


def tracepoint_id(category: str, name: str) -> int:
    for root in TRACEFS_EVENTS:
        try:
            with open(f"{root}/{category}/{name}/id") as handle:
                return int(handle.read())
        except FileNotFoundError:
            continue
    raise OSError(errno.ENOENT, f"no tracepoint {category}:{name} under {TRACEFS_EVENTS[0]}")


def attach_tracepoint(prog_fd: int, tracepoint: str) -> PerfLink:
    """Runs the program on every hit of tracepoint 'category:name', in every process."""
    category, name = tracepoint.split(":")
    what = f"tracepoint {tracepoint}"
    fd = _perf_event_open(_attr(PERF_TYPE_TRACEPOINT, tracepoint_id(category, name)), -1, 0, what)
    _set_bpf(fd, prog_fd, what)
    return PerfLink(fd, what)


def detach(link: PerfLink) -> None:
    os.close(link.fd)
