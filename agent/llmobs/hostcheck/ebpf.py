"""Live eBPF checks: bcc compiles and loads a program, a uprobe and a tracepoint fire an exactly
known number of times, and a ring-buffer event makes the trip to user space.

They probe this very process (a libc function called through ctypes, a syscall made from here), so
they need no helper process and finish in about a second. bcc is imported lazily: a host without it
still gets a report.
"""

from __future__ import annotations

import ctypes
import os
import time

from llmobs.hostcheck.host import RUN_AS_ROOT, bpf_privileges
from llmobs.hostcheck.model import Context, Finding, Status

# A libc function nothing else in the agent calls, so every hit on it is one of ours.
PROBED_LIBC_FUNCTION = "l64a"
_PROBED = PROBED_LIBC_FUNCTION.encode()  # bcc 0.26 wants bytes for names
UPROBE_CALLS = 100
TRACEPOINT = "syscalls:sys_enter_getppid"
TRACEPOINT_CALLS = 50
RINGBUF_POLL_S = 2.0

INSTALL_BCC = "apt-get install python3-bpfcc, then scripts/setup.sh (it bridges bcc into the venv)"

# Counters for the uprobe and tracepoint checks; LLMOBS_TGID is this process, set with -D.
COUNTER_PROGRAM = r"""
// hits[0]: uprobe hits, hits[1]: tracepoint hits, from this process only.
BPF_ARRAY(hits, u64, 2);

// Counts calls of the probed libc function (the pid filter is on the perf event).
int on_uprobe(struct pt_regs *ctx)
{
    int key = 0;
    u64 *count = hits.lookup(&key);
    if (count)
        __sync_fetch_and_add(count, 1);
    return 0;
}

// Counts getppid() syscalls made by this process; the tracepoint fires for every process.
int on_tracepoint(void *ctx)
{
    if ((bpf_get_current_pid_tgid() >> 32) != LLMOBS_TGID)
        return 0;
    int key = 1;
    u64 *count = hits.lookup(&key);
    if (count)
        __sync_fetch_and_add(count, 1);
    return 0;
}
"""

RINGBUF_PROGRAM = r"""
#include <uapi/linux/ptrace.h>

struct doctor_event {
    u64 cookie;
    u32 tgid;
    u32 pad;
};

// One page is plenty for the single event the check sends.
BPF_RINGBUF_OUTPUT(events, 1);

// Sends the probed function's first argument (a cookie chosen by the check) to user space.
int on_uprobe_submit(struct pt_regs *ctx)
{
    struct doctor_event event = {};
    event.cookie = PT_REGS_PARM1(ctx);
    event.tgid = bpf_get_current_pid_tgid() >> 32;
    events.ringbuf_output(&event, sizeof(event), 0);
    return 0;
}
"""

# Compiles without maps, so an unprivileged run can still tell whether bcc and clang work.
MAPLESS_PROGRAM = "int on_nothing(void *ctx) { return 0; }"


def _import_bcc():
    import bcc  # imported lazily: the report must not depend on bcc being installed

    return bcc


def _libc_path() -> str:
    """The libc this process has mapped (from /proc/self/maps), so the probe hits the very copy
    ctypes calls into."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rstrip("\n").split(maxsplit=5)[-1]
            name = os.path.basename(path)
            if name.startswith("libc.so") or (name.startswith("libc-") and name.endswith(".so")):
                return path
    raise FileNotFoundError("no libc in /proc/self/maps")


def _call_libc(function: str, argument: int, times: int) -> None:
    fn = getattr(ctypes.CDLL(_libc_path()), function)
    fn.argtypes = [ctypes.c_long]
    fn.restype = ctypes.c_void_p
    for _ in range(times):
        fn(argument)


def _prerequisites(ctx: Context) -> Finding | None:
    """A MISSING finding when the live checks cannot even be tried, else None."""
    allowed, why = bpf_privileges(ctx)
    if not allowed:
        return Finding(Status.MISSING, f"not tried: {why}", RUN_AS_ROOT)
    if not ctx.live:
        return Finding(Status.MISSING, f"not tried: checking a fake root ({ctx.root})")
    return None


def _compiles_without_loading(blocked: Finding) -> Finding:
    """Unprivileged: say whether bcc and clang work at all (a mapless program compiles without
    touching the kernel); the row stays MISSING, since nothing can be loaded."""
    reason = blocked.detail.removeprefix("not tried: ")
    try:
        bcc = _import_bcc()
        start = time.monotonic()
        bcc.BPF(text=MAPLESS_PROGRAM.encode()).cleanup()
    except ImportError as exc:
        return Finding(Status.MISSING, f"cannot import bcc ({exc}); and {reason}", blocked.hint)
    except Exception as exc:  # bcc raises bare Exception when the compile fails
        return Finding(Status.MISSING, f"bcc cannot compile ({exc}); and {reason}", blocked.hint)
    version = getattr(bcc, "__version__", "?")
    elapsed = time.monotonic() - start
    return Finding(
        Status.MISSING,
        f"bcc {version} compiles ({elapsed:.2f} s) but the kernel will not load programs: {reason}",
        blocked.hint,
    )


def check_bcc(ctx: Context) -> Finding:
    blocked = _prerequisites(ctx)
    if blocked is not None:
        return _compiles_without_loading(blocked) if ctx.live else blocked
    try:
        bcc = _import_bcc()
    except ImportError as exc:
        return Finding(Status.MISSING, f"cannot import bcc ({exc})", INSTALL_BCC)
    version = getattr(bcc, "__version__", "?")
    start = time.monotonic()
    try:
        program = bcc.BPF(text=COUNTER_PROGRAM.encode(), cflags=[f"-DLLMOBS_TGID={os.getpid()}"])
        ctx.on_close(program.cleanup)
        program.load_func(b"on_uprobe", bcc.BPF.KPROBE)
        program.load_func(b"on_tracepoint", bcc.BPF.TRACEPOINT)
    except Exception as exc:  # bcc raises bare Exception for compile and load failures
        return Finding(
            Status.MISSING,
            f"bcc {version} could not compile or load a trivial program: {exc}",
            "check the kernel headers row; scripts/setup.sh installs or links headers",
        )
    ctx.state["counter_program"] = program
    return Finding(
        Status.OK, f"bcc {version} compiled and loaded 2 programs in {time.monotonic() - start:.2f} s"
    )


def _counter_program(ctx: Context) -> tuple[object | None, Finding | None]:
    blocked = _prerequisites(ctx)
    if blocked is not None:
        return None, blocked
    program = ctx.state.get("counter_program")
    if program is None:
        bcc_row = ctx.rows.get("bcc")
        hint = bcc_row.hint if bcc_row is not None and bcc_row.hint else INSTALL_BCC
        return None, Finding(
            Status.MISSING, "not tried: bcc could not load a program (see the bcc row)", hint
        )
    return program, None


def _count_finding(what: str, counted: int, expected: int, hint: str) -> Finding:
    if counted == expected:
        return Finding(Status.OK, f"{what}: {counted} of {expected} calls counted")
    if counted == 0:
        return Finding(Status.MISSING, f"{what}: attached, but none of {expected} calls was counted", hint)
    return Finding(Status.DEGRADED, f"{what}: {counted} hits counted for {expected} calls", hint)


def check_uprobe(ctx: Context) -> Finding:
    program, blocked = _counter_program(ctx)
    if blocked is not None:
        return blocked
    libc = _libc_path()
    pid = os.getpid()
    program.attach_uprobe(name=libc.encode(), sym=_PROBED, fn_name=b"on_uprobe", pid=pid)
    try:
        _call_libc(PROBED_LIBC_FUNCTION, 1, UPROBE_CALLS)
        counted = program[b"hits"][ctypes.c_int(0)].value
    finally:
        program.detach_uprobe(name=libc.encode(), sym=_PROBED, pid=pid)
    return _count_finding(
        f"{os.path.basename(libc)}:{PROBED_LIBC_FUNCTION} in this process",
        counted,
        UPROBE_CALLS,
        "check kernel.perf_event_paranoid and that CONFIG_UPROBE_EVENTS=y",
    )


def check_tracepoint(ctx: Context) -> Finding:
    program, blocked = _counter_program(ctx)
    if blocked is not None:
        return blocked
    program.attach_tracepoint(tp=TRACEPOINT.encode(), fn_name=b"on_tracepoint")
    try:
        for _ in range(TRACEPOINT_CALLS):
            os.getppid()
        counted = program[b"hits"][ctypes.c_int(1)].value
    finally:
        program.detach_tracepoint(tp=TRACEPOINT.encode())
    return _count_finding(
        f"{TRACEPOINT} from this process",
        counted,
        TRACEPOINT_CALLS,
        "the kernel needs CONFIG_FTRACE_SYSCALLS and a mounted tracefs",
    )


def check_ringbuf(ctx: Context) -> Finding:
    blocked = _prerequisites(ctx)
    if blocked is not None:
        return blocked
    try:
        bcc = _import_bcc()
    except ImportError as exc:
        return Finding(Status.MISSING, f"not tried: cannot import bcc ({exc})", INSTALL_BCC)
    hint = "BPF ring buffers need Linux 5.8+; upgrade the kernel"
    try:
        program = bcc.BPF(text=RINGBUF_PROGRAM.encode())
    except Exception as exc:  # bcc raises bare Exception when the map cannot be created
        return Finding(Status.MISSING, f"cannot create a BPF_RINGBUF_OUTPUT map: {exc}", hint)
    ctx.on_close(program.cleanup)
    received: list[int] = []

    def on_event(_ctx, data, _size):
        received.append(ctypes.cast(data, ctypes.POINTER(ctypes.c_uint64))[0])

    program[b"events"].open_ring_buffer(on_event)
    libc = _libc_path()
    pid = os.getpid()
    cookie = 0x11D0C ^ (pid & 0xFFFF)  # not a constant, so a stale event cannot pass for ours
    program.attach_uprobe(name=libc.encode(), sym=_PROBED, fn_name=b"on_uprobe_submit", pid=pid)
    try:
        _call_libc(PROBED_LIBC_FUNCTION, cookie, 1)
        deadline = time.monotonic() + RINGBUF_POLL_S
        while not received and time.monotonic() < deadline:
            program.ring_buffer_poll(timeout=100)
    finally:
        program.detach_uprobe(name=libc.encode(), sym=_PROBED, pid=pid)
    if received == [cookie]:
        return Finding(Status.OK, "BPF_RINGBUF_OUTPUT: 1 event submitted and polled back intact")
    if not received:
        return Finding(Status.MISSING, f"no event within {RINGBUF_POLL_S:.0f} s of the submit", hint)
    return Finding(Status.DEGRADED, f"expected one event with cookie {cookie:#x}, got {received}", hint)
