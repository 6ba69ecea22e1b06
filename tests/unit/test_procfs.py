"""llmobs.procfs on a fake /proc tree: maps parsing, stat fields, errors for vanished processes."""

from __future__ import annotations

import os

import pytest
from llmobs.errors import NoSuchProcess
from llmobs.procfs import ProcFS, parse_maps

MAPS = """\
55d0c0000000-55d0c0001000 r--p 00000000 08:01 1234 /usr/bin/python3.11
7f0000000000-7f0000010000 rw-s 00000000 00:1a 99 /dev/shm/llmobs.42
7f0000100000-7f0000200000 r-xp 00010000 08:01 777 /opt/torch/lib/libc10.so
7f0000300000-7f0000301000 rw-p 00000000 00:00 0
7f0000400000-7f0000401000 r-xp 00000000 08:01 5 /tmp/old lib.so (deleted)
garbage line
"""


def _fake_process(root, pid=42, comm="python (x) y", state="S", start=123456):
    proc = root / str(pid)
    (proc / "task" / str(pid)).mkdir(parents=True)
    (proc / "task" / str(pid + 1)).mkdir()
    (proc / "fd").mkdir()
    os.symlink("/dev/nvidia0", proc / "fd" / "3")
    os.symlink("/dev/null", proc / "fd" / "4")
    fields = [state, "1", "42", "42", "0", "-1", "4194560"] + ["0"] * 14
    fields[19] = str(start)  # field 22 overall = index 19 after state
    (proc / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")
    (proc / "maps").write_text(MAPS)
    (proc / "status").write_text("Name:\tpython\nUid:\t1000\t1001\t1001\t1001\nCapEff:\t000001ffffffffff\n")
    (proc / "cmdline").write_bytes(b"python\0train.py\0")
    os.symlink("/usr/bin/python3.11", proc / "exe")
    return ProcFS(root)


def test_parse_maps_fields_and_deleted():
    entries = parse_maps(MAPS)
    assert len(entries) == 5  # the garbage line is skipped
    shm = entries[1]
    assert (shm.start, shm.end, shm.perms, shm.offset, shm.inode) == (
        0x7F0000000000,
        0x7F0000010000,
        "rw-s",
        0,
        99,
    )
    assert shm.path == "/dev/shm/llmobs.42"
    assert entries[2].offset == 0x10000
    assert entries[3].path == ""
    assert entries[4].deleted and entries[4].path == "/tmp/old lib.so (deleted)"


def test_stat_fields_survive_odd_comm(tmp_path):
    procfs = _fake_process(tmp_path)
    assert procfs.comm(42) == "python (x) y"
    assert procfs.state(42) == "S"
    assert procfs.start_time_ticks(42) == 123456
    assert procfs.threads(42) == [42, 43]
    assert procfs.cmdline(42) == ["python", "train.py"]
    assert procfs.exe(42) == "/usr/bin/python3.11"
    assert procfs.uids(42) == (1000, 1001)
    assert procfs.effective_caps(42) == 0x1FFFFFFFFFF
    assert procfs.fds(42) == {3: "/dev/nvidia0", 4: "/dev/null"}
    assert procfs.root_path(42, "/usr/lib/x.so") == f"{tmp_path}/42/root/usr/lib/x.so"


def test_missing_and_zombie_processes_are_no_such_process(tmp_path):
    procfs = _fake_process(tmp_path)
    _fake_process(tmp_path, pid=50, state="Z")
    procfs.require(42)
    for pid in (7, 50, 0, -1):
        with pytest.raises(NoSuchProcess):
            procfs.require(pid)
    with pytest.raises(NoSuchProcess):
        procfs.maps(7)
    with pytest.raises(NoSuchProcess):
        procfs.fds(7)


def test_real_proc_self():
    procfs = ProcFS()
    pid = os.getpid()
    assert procfs.exists(pid)
    assert procfs.start_time_ticks(pid) > 0
    assert any(entry.path.endswith(".so") or "python" in entry.path for entry in procfs.maps(pid))
