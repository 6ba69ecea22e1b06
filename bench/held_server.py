"""`python -m llmobs.workloads.serve` as a held target for the serving tests and benchmarks, synchronised over
its --ready-fd pipe, never by sleeps.

with HeldServer("--model", "tiny") as server:       # returns once it serves: server.ready is its ready line
    clients.run_clients(server.base_url, ...)
    status, done = server.stop()                     # SIGTERM; its exit status and "done" line
# on exit: killed if it still runs, reaped
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

from bench.ready_pipe import read_json_line

START_TIMEOUT = 300.0  # a first run saves the model into the cache: an upper bound, not a pace


class HeldServer:
    def __init__(self, *args: str, start_timeout: float = START_TIMEOUT):
        self.args = args
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.ready: dict = {}
        self._ready_r = -1
        # a file, not a pipe: nobody reads it while it serves, so it never fills up and blocks the server
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in __exit__)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def base_url(self) -> str:
        return self.ready["base_url"]

    @property
    def model(self) -> str:
        """The name a client sends (the served directory's path)."""
        return self.ready["served_model"]

    def __enter__(self) -> HeldServer:
        self._ready_r, ready_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmobs.workloads.serve", "--ready-fd", str(ready_w), *self.args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log, pass_fds=(ready_w,),
        )  # fmt: skip
        os.close(ready_w)
        try:
            self.ready = read_json_line(self._ready_r, self.start_timeout, who="the server")
        except AssertionError as exc:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            log = self.stderr()
            self.__exit__(None, None, None)
            raise AssertionError(f"{exc}; its stderr:\n{log}") from None
        return self

    def stderr(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-3000:]

    def stop(self, timeout: float = 120.0) -> tuple[int, dict | None]:
        """SIGTERM, then (exit status, the "done" line or None if it wrote none)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            done = read_json_line(self._ready_r, timeout, who="the server")
        except AssertionError:
            done = None
        return self.proc.wait(timeout=timeout), done

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()
        if self._ready_r >= 0:
            os.close(self._ready_r)
            self._ready_r = -1
        self._log.close()


def in_the_map(pid: int, request_id: str) -> tuple[int, bool]:
    """(token steps, has an end record) of the engine's request `request_id` (the completion's id) in
    the instrumented server's map (pid), now: what the publisher wrote of it."""
    from llmobs.shm.reader import ShmReader

    with ShmReader(pid) as reader:
        steps = reader.read_steps(0).columns["request_id"]
        events = reader.read_request_events(0).columns
    ends = [r for k, r in zip(events["kind"], events["request_id"], strict=True) if k == "end"]
    return sum(r == request_id for r in steps), request_id in ends
