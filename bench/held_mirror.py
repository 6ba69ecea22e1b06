"""`llmobs-agent mirror` and bench.http_responder as held subprocesses for tests/e2e/test_mirror.py and
bench/mirror.py, synchronised on their start lines (never by sleeps).

with HeldResponder(record=path) as shadow, HeldMirror(primary_url, shadow.url) as mirror:
    ... mirror.base_url ...             # http://127.0.0.1:PORT (the port it picked)
    mirror.stats()                       # GET /llmobs/mirror/stats
    status, summary = mirror.stop()      # SIGTERM: its exit status and its "mirror: stopped: k=v ..." dict
"""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

from bench.ready_pipe import read_json_line

_LISTENING = re.compile(r"mirror: listening on (http://\S+) ")


class _Held:
    proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL and reap (a shadow that dies without a word)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.kill()


class HeldResponder(_Held):
    def __init__(self, record: str | None = None, timeout: float = 30.0):
        self.record, self.timeout = record, timeout

    def __enter__(self) -> HeldResponder:
        ready_r, ready_w = os.pipe()
        argv = [sys.executable, "-m", "bench.http_responder", "--ready-fd", str(ready_w)]
        if self.record:
            argv += ["--record", self.record]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=(ready_w,))
        os.close(ready_w)
        try:
            self.ready = read_json_line(ready_r, self.timeout, who="the responder")
        except AssertionError:
            self.kill()
            raise
        finally:
            os.close(ready_r)
        self.url = self.ready["url"]
        return self

    def recorded(self) -> list[list[str]]:
        """[traceparent, x-llmobs-variant, path] of each request it received, in order."""
        with open(self.record) as f:
            return [line.rstrip("\n").split("\t") for line in f]


class HeldMirror(_Held):
    def __init__(self, primary: str, shadow: str, *options: str, timeout: float = 30.0):
        self.argv = [sys.executable, "-m", "llmobs.cli", "mirror", "--listen", "127.0.0.1:0",
                     "--primary", primary, "--shadow", shadow, *options]  # fmt: skip
        self.timeout = timeout
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 (closed in __exit__)

    def __enter__(self) -> HeldMirror:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self._err)  # fmt: skip
        line = self._line()
        match = _LISTENING.match(line)
        if match is None:
            self.kill()
            raise AssertionError(f"the mirror did not start: {line!r}; stderr: {self.stderr()}")
        self.base_url = match.group(1)
        self.port = int(self.base_url.rsplit(":", 1)[1])
        return self

    def _line(self) -> str:
        fd, data, deadline = self.proc.stdout.fileno(), b"", time.monotonic() + self.timeout
        while not data.endswith(b"\n"):
            readable, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
            if not readable:
                return data.decode(errors="replace")
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
        return data.decode(errors="replace")

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-3000:]

    def stats(self) -> dict[str, int]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", "/llmobs/mirror/stats")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def stop(self, timeout: float = 30.0) -> tuple[int, dict[str, int]]:
        """SIGTERM; (exit status, the counters of its one summary line)."""
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=timeout)
        lines = out.decode().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mirror: stopped: "), lines
        summary = dict(item.split("=") for item in lines[0].removeprefix("mirror: stopped: ").split())
        return self.proc.returncode, {key: int(value) for key, value in summary.items()}

    def __exit__(self, *exc) -> None:
        self.kill()
        self._err.close()
