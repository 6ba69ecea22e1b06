"""scripts/workload.py as a held target for the agent's tests and the benchmarks, synchronised over a
pipe, never by sleeps.

with HeldWorkload("--model", "tiny", "--requests", "6") as workload:   # returns once it is "ready"
    agent = Agent("--pid", str(workload.pid), ...)
    workload.generate()                                                # "go", then waits for "done"
# on exit: "bye" releases --hold and the process is reaped
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from bench.ready_pipe import read_json_line

__all__ = ["HeldWorkload", "read_json_line"]  # tests and benchmarks import the reader from here too

WORKLOAD = Path(__file__).resolve().parents[1] / "scripts" / "workload.py"


class HeldWorkload:
    """The workload started with --wait-stdin --hold: loaded and waiting until `generate()`, alive after it
    until the block ends, so an agent can attach before the first token and detach after the last."""

    def __init__(self, *args: str):
        self.args = args
        self.process: subprocess.Popen | None = None
        self._ready_r = -1

    @property
    def pid(self) -> int:
        return self.process.pid

    def __enter__(self) -> HeldWorkload:
        self._ready_r, ready_w = os.pipe()
        held = ("--wait-stdin", "--hold", "--ready-fd", str(ready_w))
        command = [sys.executable, str(WORKLOAD), *self.args, *held]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(ready_w,)
        )
        os.close(ready_w)
        try:
            assert read_json_line(self._ready_r)["phase"] == "ready"
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def generate(self) -> None:
        self._send(b"go\n")
        assert read_json_line(self._ready_r)["phase"] == "done"

    def _send(self, line: bytes) -> None:
        self.process.stdin.write(line)
        self.process.stdin.flush()

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(BrokenPipeError, ValueError):  # it may have exited already
            self._send(b"bye\n")
        self.process.wait(timeout=30)
        os.close(self._ready_r)
