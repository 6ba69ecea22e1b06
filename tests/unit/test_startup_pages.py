"""llmobs.runtime.startup_pages: the pages of read-only file mappings are handed back, nothing else.

Real pages of a real process: a fresh interpreter maps a file of its own read-only and another
writable (private), reads every page of both, holds anonymous memory, and releases. The read-only
mapping leaves its resident set (a file no other process maps: the kernel keeps pages another process
maps too, so a shared library would make the figure depend on what else runs), the writable one and
the anonymous memory stay, and the read-only mapping is still readable afterwards."""

from __future__ import annotations

import json
import subprocess
import sys

from llmobs.runtime import startup_pages
from llmobs.runtime.agent import Agent

CHILD = r"""
import json, mmap, os, sys
from llmobs.runtime import startup_pages

SIZE = 32 << 20
def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    return {key: int(fields[key].split()[0]) * 1024 for key in ("RssFile", "RssAnon")}

paths = [os.path.join(sys.argv[1], name) for name in ("ro", "rw")]
for path in paths:
    with open(path, "wb") as handle:
        handle.write(os.urandom(1 << 20) * 32)
ro = open(paths[0], "rb")
read_only = mmap.mmap(ro.fileno(), SIZE, access=mmap.ACCESS_READ)
rw = open(paths[1], "r+b")
writable = mmap.mmap(rw.fileno(), SIZE, access=mmap.ACCESS_COPY)  # private, writable
first = sum(read_only[i] for i in range(0, SIZE, 4096))
sum(writable[i] for i in range(0, SIZE, 4096))
anon = bytearray(os.urandom(16 << 20))
before = status()
advised = startup_pages.release()
after = status()
again = sum(read_only[i] for i in range(0, SIZE, 4096))  # still readable: faulted back in
print(json.dumps({"before": before, "after": after, "advised": advised, "same": again == first}))
"""

MB = 1 << 20


def test_release_pages_out_read_only_file_mappings_and_nothing_else(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["advised"] >= 32 * MB  # at least the read-only mapping of the private file
    dropped = got["before"]["RssFile"] - got["after"]["RssFile"]
    # the 32 MB read-only mapping (no other process maps that file) leaves the resident set; the
    # private writable one (its pages are ours: copies or not) stays, as does the anonymous memory
    assert dropped >= 31 * MB, got
    assert got["after"]["RssFile"] >= 31 * MB, got  # the writable file mapping is still resident
    assert abs(got["after"]["RssAnon"] - got["before"]["RssAnon"]) < 4 * MB, got
    assert got["same"]  # the pages read back are the file's


def test_only_read_only_mappings_of_files_are_chosen():
    maps = "\n".join(
        [
            "7f0000000000-7f0000002000 r--p 00000000 fe:00 1 /usr/lib/libc.so.6",
            "7f0000002000-7f0000010000 r-xp 00002000 fe:00 1 /usr/lib/libc.so.6",
            "7f0000010000-7f0000011000 rw-p 00010000 fe:00 1 /usr/lib/libc.so.6",
            "7f0000020000-7f0000040000 rw-p 00000000 00:00 0 ",
            "7f0000040000-7f0000041000 r--s 00001000 00:10 1038 anon_inode:bpf-map",
            "7f0000050000-7f0000060000 rw-p 00000000 00:00 0 [heap]",
            "7f0000060000-7f0000062000 r-xp 00000000 00:00 0 [vdso]",
            "7f0000070000-7f0000071000 r--p 00000000 fe:00 7 /tmp/a file with spaces.so",
        ]
    )
    assert startup_pages._read_only_file_mappings(maps) == [
        (0x7F0000000000, 0x2000),
        (0x7F0000002000, 0xE000),
        (0x7F0000070000, 0x1000),
    ]


def test_the_runtime_releases_once_the_start_up_settled():
    agent = Agent(nvml=False)
    start = agent._release_pages_at
    assert start is not None
    agent._slow_tick(start - 0.5)  # not yet
    assert agent.startup_pages_released == 0
    agent._slow_tick(start)
    released = agent.counters()["startup_pages_released"]
    assert released > 0
    agent._slow_tick(start + 60)  # once per settling, not every tick
    assert agent.counters()["startup_pages_released"] == released


def test_the_runtime_releases_again_after_each_reopen_of_the_store(tmp_path):
    from llmobs.store.sink import agent_store

    store = agent_store(tmp_path / "agent.duckdb")
    agent = Agent(store=store, nvml=False)
    first = agent._release_pages_at
    agent._slow_tick(first)
    released = agent.counters()["startup_pages_released"]
    agent._slow_tick(first + 60)  # no reopen: nothing more
    assert agent.counters()["startup_pages_releases"] == 1
    assert store.recycle()  # the store reopens its database (as after RECYCLE_ROWS appended rows)
    reopened_at = first + 61
    agent._slow_tick(reopened_at)  # the first tick that sees it: the reopen is over, its pages go
    assert agent.counters()["startup_pages_releases"] == 2
    assert agent.counters()["startup_pages_released"] > released
    agent._slow_tick(reopened_at + 120)  # once per reopen
    assert agent.counters()["startup_pages_releases"] == 2
    store.close()
