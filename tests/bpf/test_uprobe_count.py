"""A real uprobe (bcc) on a real separate process counts an exactly known number of calls, and
leaves nothing behind in the kernel once cleaned up.

The target is a small C program compiled here; the test drives it over pipes (send a count, wait for
"done"), so there is no sleep anywhere: every wait is on a line from the child, bounded in time.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
from pathlib import Path

import pytest

bcc = pytest.importorskip("bcc")

TARGET_C = r"""
#include <stdio.h>
#include <stdlib.h>

volatile long sink;

/* The probed function: noinline, with a side effect, so every call stays a call. */
__attribute__((noinline)) void llmobs_test_target(long i)
{
    __asm__ volatile("" ::: "memory");
    sink += i;
}

/* Reads a count per line from stdin, calls the target that many times, answers "done <count>". */
int main(void)
{
    char line[64];
    printf("ready\n");
    fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
        long n = strtol(line, NULL, 10);
        for (long i = 0; i < n; i++)
            llmobs_test_target(i);
        printf("done %ld\n", n);
        fflush(stdout);
    }
    return 0;
}
"""

COUNTER = r"""
// Calls of the probed function, per process (tgid), so a hit from the wrong process would show.
BPF_HASH(calls, u32, u64, 64);

// Counts one call of llmobs_test_target.
int on_target(struct pt_regs *ctx)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u64 zero = 0;
    u64 *count = calls.lookup_or_try_init(&tgid, &zero);
    if (count)
        __sync_fetch_and_add(count, 1);
    return 0;
}
"""

SYMBOL = b"llmobs_test_target"  # bcc 0.26 wants bytes for names
LINE_TIMEOUT_S = 20.0


class Target:
    """One target process, driven line by line over its stdin/stdout pipes."""

    def __init__(self, binary: Path):
        self.proc = subprocess.Popen(
            [str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.pid = self.proc.pid
        assert self.read_line() == "ready"

    def read_line(self) -> str:
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(LINE_TIMEOUT_S):
                raise TimeoutError(f"target {self.pid} said nothing for {LINE_TIMEOUT_S} s")
        return self.proc.stdout.readline().strip()

    def call(self, times: int) -> None:
        """Make the target call the probed function `times` times, and wait until it has."""
        self.proc.stdin.write(f"{times}\n")
        self.proc.stdin.flush()
        assert self.read_line() == f"done {times}"

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=LINE_TIMEOUT_S)


@pytest.fixture(scope="module")
def target_binary(tmp_path_factory) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc is needed to build the uprobe target (scripts/setup.sh installs build-essential)")
    workdir = tmp_path_factory.mktemp("uprobe_target")
    source = workdir / "target.c"
    source.write_text(TARGET_C)
    binary = workdir / "llmobs_uprobe_target"
    subprocess.run([gcc, "-O2", "-o", str(binary), str(source)], check=True, timeout=60)
    return binary


@pytest.fixture
def targets(target_binary: Path):
    started: list[Target] = []

    def start() -> Target:
        started.append(Target(target_binary))
        return started[-1]

    yield start
    for target in started:
        if target.proc.poll() is None:
            target.proc.kill()
            target.proc.wait(timeout=LINE_TIMEOUT_S)


def counts(program) -> dict[int, int]:
    return {key.value: value.value for key, value in program[b"calls"].items()}


def test_uprobe_counts_exactly_the_calls_of_the_attached_process(target_binary: Path, targets) -> None:
    watched, other = targets(), targets()
    program = bcc.BPF(text=COUNTER.encode())
    try:
        program.attach_uprobe(name=bytes(target_binary), sym=SYMBOL, fn_name=b"on_target", pid=watched.pid)
        assert counts(program) == {}

        watched.call(1000)
        assert counts(program) == {watched.pid: 1000}

        # Same binary, same function, another process: the pid filter must keep it out.
        other.call(500)
        assert counts(program) == {watched.pid: 1000}

        watched.call(337)
        assert counts(program) == {watched.pid: 1337}
    finally:
        program.cleanup()
        watched.close()
        other.close()


def bpftool_json(*args: str) -> list[dict]:
    out = subprocess.run(["bpftool", "-j", *args], capture_output=True, text=True, timeout=30, check=True)
    return json.loads(out.stdout or "[]")


def our_perf_uprobes(binary: Path) -> list[dict]:
    """Perf-event uprobes held open by this test process on `binary` (bcc 0.26 attaches through the
    uprobe PMU, so this, not uprobe_events, is where its probes show)."""
    return [
        entry
        for entry in bpftool_json("perf")
        if entry.get("pid") == os.getpid()
        and entry.get("fd_type") == "uprobe"
        # bcc names the file through /proc/PID/root/... when it attaches for one pid.
        and entry.get("filename", "").endswith(str(binary))
    ]


def uprobe_events_mentioning(binary: Path) -> list[str]:
    events = Path("/sys/kernel/tracing/uprobe_events")
    if not events.exists():
        events = Path("/sys/kernel/debug/tracing/uprobe_events")
    return [line for line in events.read_text().splitlines() if str(binary) in line]


def links_of(prog_ids: set[int]) -> list[dict]:
    return [link for link in bpftool_json("link") if link.get("prog_id") in prog_ids]


def test_uprobe_is_gone_from_the_kernel_after_cleanup(target_binary: Path, targets) -> None:
    if shutil.which("bpftool") is None:
        pytest.fail("bpftool is needed to see the probe from outside (apt-get install bpftool)")
    target = targets()
    program = bcc.BPF(text=COUNTER.encode())
    try:
        program.attach_uprobe(name=bytes(target_binary), sym=SYMBOL, fn_name=b"on_target", pid=target.pid)
        target.call(10)
        assert counts(program) == {target.pid: 10}
        attached = our_perf_uprobes(target_binary)
        # Seen from outside while attached: the kernel holds a uprobe with our program on the binary.
        assert len(attached) == 1, attached
        prog_ids = {entry["prog_id"] for entry in attached}
        visible_in_events = uprobe_events_mentioning(target_binary)
    finally:
        program.cleanup()
    assert our_perf_uprobes(target_binary) == []
    assert uprobe_events_mentioning(target_binary) == [], f"while attached: {visible_in_events}"
    assert links_of(prog_ids) == []
    # The program itself is unloaded once its last fd is closed.
    progs = {prog["id"] for prog in bpftool_json("prog", "show")}
    assert not prog_ids & progs
    # The target still runs normally once the probe is gone.
    target.call(5)
    target.close()
    assert target.proc.returncode == 0
