"""A benchmark's child process that says when it is ready: started with `--ready-fd N --wait-stdin`, it
writes one JSON line on the pipe once loaded, then waits for "go" on stdin (llmobs.workloads,
scripts/workload.py, bench/synthetic_publisher.py all speak this). Waits are bounded, never sleeps.

    with ReadyChild([sys.executable, "-m", "llmobs.workloads", ...], timeout=600) as child:
        agent = attach(child.pid)
        child.go()
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time


def read_line(fd: int, timeout: float, who: str = "the child") -> str:
    """The last complete line on a pipe fd, waiting at most `timeout` seconds."""
    data, deadline = b"", time.monotonic() + timeout
    while not data.endswith(b"\n"):
        readable, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        chunk = os.read(fd, 4096) if readable else b""
        if not chunk:
            raise SystemExit(f"error: {who} wrote no ready line within {timeout} s (got {data!r})")
        data += chunk
    return data.decode().splitlines()[-1]


class ReadyChild:
    """`argv` + `--wait-stdin --ready-fd N`, started and ready (`.ready` is its JSON line)."""

    def __init__(self, argv: list[str], *, timeout: float = 600, env: dict | None = None, cwd=None,
                 stdout=subprocess.PIPE):  # fmt: skip
        self.ready_r, ready_w = os.pipe()
        self.proc = subprocess.Popen(
            [*argv, "--wait-stdin", "--ready-fd", str(ready_w)], stdin=subprocess.PIPE, stdout=stdout,
            pass_fds=(ready_w,), cwd=cwd, env=None if env is None else {**os.environ, **env},
        )  # fmt: skip
        os.close(ready_w)
        try:
            self.ready = json.loads(read_line(self.ready_r, timeout, who=argv[-1]))
        except BaseException:
            self.kill()
            raise
        self.pid = self.proc.pid

    def go(self) -> None:
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def close(self) -> None:
        self.kill()
        if self.ready_r >= 0:
            os.close(self.ready_r)
            self.ready_r = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
