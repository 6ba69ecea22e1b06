"""llmobs.runtime.startup_pages: the library pages that only start-up touched are handed back.

Real pages of a real process: a fresh interpreter imports DuckDB (its ~50 MB of code is faulted in by
the module's initialisation), then releases; its RssFile must fall by most of what the library holds,
while its anonymous memory stays (nothing is taken from the heap), and the library still works."""

from __future__ import annotations

import json
import subprocess
import sys

from llmobs.runtime import startup_pages
from llmobs.runtime.agent import Agent

CHILD = r"""
import json, duckdb
from llmobs.runtime import startup_pages

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    return {key: int(fields[key].split()[0]) * 1024 for key in ("RssFile", "RssAnon")}

def duckdb_resident():
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head[0]) > 8 and ":" not in head[0]:
            inside = len(head) >= 6 and "_duckdb" in head[5]
        elif inside and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total

before, lib_before = status(), duckdb_resident()
advised = startup_pages.release()
after, lib_after = status(), duckdb_resident()
works = duckdb.connect().execute("SELECT 40 + 2").fetchall()[0][0]
print(json.dumps({"before": before, "after": after, "lib_before": lib_before, "lib_after": lib_after,
                  "advised": advised, "works": works}))
"""


def test_release_hands_back_library_pages_and_keeps_the_heap():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["advised"] > 0
    assert got["lib_before"] > 8 << 20, got  # DuckDB's initialisation faulted in megabytes of code
    # most of DuckDB's resident pages are gone (a few come straight back: the query after it ran later)
    assert got["lib_after"] < got["lib_before"] / 4, got
    assert got["before"]["RssFile"] - got["after"]["RssFile"] >= got["lib_before"] - got["lib_after"]
    assert abs(got["after"]["RssAnon"] - got["before"]["RssAnon"]) < 4 << 20, got  # the heap is kept
    assert got["works"] == 42


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
