"""ProcWatcher: which processes qualify (map or libtorch/libcuda, and the selectors), pid reuse, and that
a scan with nothing new reads no maps. First against a fake /proc tree, then against real children."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from llmobs.daemon.discovery import ProcWatcher, Selectors
from llmobs.procfs import ProcFS

OLD = 1000  # start time in ticks: long ago (boot + 10 s), so a refusal is re-checked only after recheck_s


class FakeProc:
    """A /proc tree of files: what ProcWatcher reads (stat, status, cmdline, cgroup, maps)."""

    def __init__(self, root: Path):
        self.root = root
        self.shm = root / "shm"
        self.shm.mkdir(parents=True)

    def add(
        self, pid, *, start=OLD, uid=1000, cmd="python serve.py", cgroup="/user.slice/a", libs=(), map_=False
    ):
        d = self.root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        fields = ["S"] + ["0"] * 18 + [str(start)] + ["0"] * 30
        (d / "stat").write_text(f"{pid} (python) {' '.join(fields)}\n")
        (d / "status").write_text(f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
        (d / "cmdline").write_bytes(cmd.replace(" ", "\0").encode() + b"\0")
        (d / "cgroup").write_text(f"0::{cgroup}\n")
        lines = [
            f"7f00{i:08x}000-7f00{i:08x}fff r-xp 00000000 08:01 {100 + i} {lib}" for i, lib in enumerate(libs)
        ]
        (d / "maps").write_text(
            "\n".join(["00400000-00401000 r-xp 00000000 08:01 1 /usr/bin/python3.11", *lines])
        )
        if map_:
            (self.shm / f"llmobs.{pid}").write_bytes(b"\0" * 64)

    def remove(self, pid):
        for f in (self.root / str(pid)).iterdir():
            f.unlink()
        (self.root / str(pid)).rmdir()


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def fake(tmp_path):
    return FakeProc(tmp_path / "proc")


def watcher(fake, selectors=None, clock=None, **kw):
    procfs = ProcFS(fake.root)
    return ProcWatcher(
        selectors or Selectors(), procfs, shm_dir=str(fake.shm), exclude=(), now=clock or Clock(), **kw
    )


TORCH = "/opt/venv/lib/python3.11/site-packages/torch/lib/libc10.so"
TORCH_CPU = "/opt/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so"
CUDA = "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"


def pids(procs):
    return sorted(p.pid for p in procs)


def test_qualifies_by_map_or_libraries(fake):
    fake.add(10, libs=[TORCH])
    fake.add(11, libs=[CUDA])
    fake.add(12, map_=True)
    fake.add(13, libs=[TORCH_CPU])
    fake.add(14, libs=["/usr/lib/libssl.so.3", "/opt/x/libc10_extras.so"])  # neither
    fake.add(15, cmd="")  # a kernel thread: no command line
    appeared, gone = watcher(fake).scan()
    assert pids(appeared) == [10, 11, 12, 13] and gone == []
    assert {p.pid: p.why for p in appeared} == {10: "libtorch", 11: "libcuda", 12: "map", 13: "libtorch"}


@pytest.mark.parametrize(
    ("selectors", "selected"),
    [
        (Selectors(users=(1000,)), [1]),
        (Selectors(users=(2000, 0)), [2, 3]),
        (Selectors(cgroup="/system.slice/llm-*.service"), [2]),
        (Selectors(cgroup="/user.slice/*"), [1, 3]),
        (Selectors(command=r"vllm|serve\.py"), [1, 2]),
        (Selectors(users=(0,), command="train"), [3]),
        (Selectors(users=(0,), command="serve"), []),
    ],
)
def test_selectors(fake, selectors, selected):
    fake.add(1, uid=1000, cmd="python serve.py --port 1", cgroup="/user.slice/user-1000.slice", libs=[TORCH])
    fake.add(2, uid=2000, cmd="python -m vllm.entrypoints", cgroup="/system.slice/llm-a.service", libs=[CUDA])
    fake.add(3, uid=0, cmd="torchrun train.py", cgroup="/user.slice/root", map_=True)
    assert pids(watcher(fake, selectors).scan()[0]) == selected


def test_nothing_new_reads_no_maps_and_gone_is_reported(fake):
    fake.add(1, libs=[TORCH])
    fake.add(2, libs=["/usr/lib/libz.so.1"])
    w = watcher(fake)
    assert pids(w.scan()[0]) == [1]
    examined, maps_read = w.stats.examined, w.stats.maps_read
    assert (examined, maps_read) == (2, 2)
    for _ in range(3):
        assert w.scan() == ([], [])
    assert (w.stats.examined, w.stats.maps_read) == (examined, maps_read)  # cached by (pid, start time)
    fake.remove(1)
    appeared, gone = w.scan()
    assert appeared == [] and pids(gone) == [1]


def test_pid_reuse_is_a_new_process(fake):
    fake.add(7, start=OLD, libs=[TORCH], cmd="python a.py")
    w = watcher(fake)
    (first,) = w.scan()[0]
    fake.add(7, start=OLD + 500, libs=[TORCH], cmd="python b.py")
    appeared, gone = w.scan()
    assert gone == [first]
    assert [(p.pid, p.start_ticks, p.command) for p in appeared] == [(7, OLD + 500, "python b.py")]


def test_refused_process_rechecked_after_recheck_period(fake):
    clock = Clock()
    fake.add(5, libs=[])  # no torch yet
    w = watcher(fake, clock=clock, recheck_s=30.0)
    assert w.scan() == ([], [])
    fake.add(5, libs=[TORCH])  # it imported torch
    clock.t += 10
    assert w.scan() == ([], [])  # not looked at again yet
    clock.t += 25
    assert pids(w.scan()[0]) == [5]


def test_young_process_rechecked_at_next_scan(fake):
    now_ticks = int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))
    fake.add(6, start=now_ticks, libs=[])  # started just now: still importing
    w = watcher(fake, recheck_s=3600.0)
    assert w.scan() == ([], [])
    fake.add(6, start=now_ticks, libs=[TORCH])
    assert pids(w.scan()[0]) == [6]


def test_refuse_and_forget(fake):
    clock = Clock()
    fake.add(8, libs=[TORCH])
    w = watcher(fake, clock=clock, recheck_s=30.0)
    (proc,) = w.scan()[0]
    w.refuse(proc, "nothing attached")
    assert w.why_not(8) == "nothing attached"
    assert w.scan() == ([], [])
    clock.t += 31
    assert pids(w.scan()[0]) == [8]
    w.forget(8)
    assert pids(w.scan()[0]) == [8]  # forgotten while alive: found again


def test_new_selectors_report_deselected_as_gone_and_reexamine_refused(fake):
    fake.add(1, cmd="python a.py", libs=[TORCH])
    fake.add(2, cmd="python b.py", libs=[TORCH])
    w = watcher(fake, Selectors(command="a.py"), recheck_s=3600.0)
    assert pids(w.scan()[0]) == [1]
    w.set_selectors(Selectors(command="b.py"))
    appeared, gone = w.scan()
    assert pids(gone) == [1] and pids(appeared) == [2]
    assert w.scan() == ([], [])


# ---- real child processes ------------------------------------------------------------------------
CHILD = r"""
import mmap, sys
# the parent opened the file: a child of another user need not reach the test's private tmp dir
mapped = mmap.mmap(int(sys.argv[1]), 0, prot=mmap.PROT_READ)  # in /proc/self/maps under its name
print("ready", flush=True)
sys.stdin.readline()
"""


class Child:
    """A real process with a file named like libc10 mapped, held until closed (synchronised by pipes)."""

    def __init__(self, tmp_path: Path, token: str, user: int | None = None):
        lib = tmp_path / "torch" / "lib" / "libc10.so"
        lib.parent.mkdir(parents=True, exist_ok=True)
        lib.write_bytes(b"\x7fELF" + b"\0" * 4092)
        extra = {"user": user, "group": user} if user is not None else {}
        # another user may not be able to run the venv's interpreter (under root's home): the system one
        python = (
            "/usr/bin/python3" if user is not None and os.path.exists("/usr/bin/python3") else sys.executable
        )
        with open(lib, "rb") as handle:
            self.proc = subprocess.Popen(
                [python, "-c", CHILD, str(handle.fileno()), token],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                pass_fds=(handle.fileno(),),
                **extra,
            )
        readable, _, _ = select.select([self.proc.stdout], [], [], 30)
        assert readable and self.proc.stdout.readline().strip() == "ready"
        self.pid = self.proc.pid

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def real_watcher(selectors):
    return ProcWatcher(selectors, ProcFS(), shm_dir="/nonexistent")


def test_real_children_by_command_regex(tmp_path):
    token = f"llmobs-disc-{uuid.uuid4().hex[:8]}"
    a, b = Child(tmp_path / "a", f"{token}-a"), Child(tmp_path / "b", f"{token}-b")
    try:
        w = real_watcher(Selectors(command=rf"{token}-a\b"))
        assert [(p.pid, p.why) for p in w.scan()[0]] == [(a.pid, "libtorch")]
        w.set_selectors(Selectors(command=token))
        assert pids(w.scan()[0]) == sorted([b.pid])  # a is tracked already; b newly selected
        b.close()
        assert pids(w.scan()[1]) == [b.pid]
    finally:
        a.close()
        if b.proc.poll() is None:
            b.close()


def test_real_children_by_user_and_cgroup(tmp_path):
    token = f"llmobs-disc-{uuid.uuid4().hex[:8]}"
    mine = Child(tmp_path / "a", token)
    other = Child(tmp_path / "b", token, user=65534) if os.geteuid() == 0 else None
    try:
        by_me = real_watcher(Selectors(users=(os.geteuid(),), command=token)).scan()[0]
        assert pids(by_me) == [mine.pid]
        if other is not None:  # root could start one as nobody
            assert pids(real_watcher(Selectors(users=(65534,), command=token)).scan()[0]) == [other.pid]
        own_cgroup = Path(f"/proc/{mine.pid}/cgroup").read_text().splitlines()[0].split(":", 2)[2]
        assert mine.pid in pids(real_watcher(Selectors(cgroup=own_cgroup, command=token)).scan()[0])
        assert real_watcher(Selectors(cgroup="/no/such/cgroup/*", command=token)).scan()[0] == []
    finally:
        mine.close()
        if other is not None:
            other.close()
