"""CPU time and RSS of another live process, from /proc (bench/drain_idle.py, bench/soak.py): what a
benchmark reads of an agent it did not start in-process and has not reaped yet (getrusage cannot)."""

from __future__ import annotations

import contextlib
import os
import threading

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
RSS_PERIOD_S = 0.1  # RssSampler's period


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (fields 14 and 15 of /proc/PID/stat), in seconds: CLK_TCK resolution."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        fields = handle.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


def rss_parts(pid: int) -> dict[str, int]:
    """RssAnon and RssFile of `pid` in bytes (/proc/PID/status): the process's own memory, and the pages
    of files (libraries, the ring's mapping) it has mapped."""
    with open(f"/proc/{pid}/status") as handle:
        fields = dict(line.split(":", 1) for line in handle.read().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("RssAnon", "RssFile")}


class RssSampler:
    """A process's RSS every RSS_PERIOD_S while the `with` block runs (an agent's peaks come and go
    within a second: a correlate run's DuckDB memory, an attach's start-up). `samples` are bytes."""

    def __init__(self, pid: int):
        self.pid, self.samples = pid, [rss_bytes(pid)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(RSS_PERIOD_S):
            with contextlib.suppress(OSError):  # the process may have exited: its last samples stand
                self.samples.append(rss_bytes(self.pid))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
