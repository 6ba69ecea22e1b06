"""The status lines a held target (scripts/workload.py, llmobs.workloads.serve) writes as JSON, one per
line, on its --ready-fd pipe: read with a bounded wait, never a sleep.

Failures are AssertionErrors, so a test that waits on a target fails with the reason, and a holder that
can live without a line (HeldServer.stop) catches exactly that.
"""

from __future__ import annotations

import json
import os
import select
import time


def read_json_line(fd: int, timeout: float = 60.0, who: str = "the workload") -> dict:
    """The next status line on `fd` (the last one, if several arrived together), waiting at most
    `timeout` seconds in all."""
    data, deadline = b"", time.monotonic() + timeout
    while not data.endswith(b"\n"):
        readable, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
        assert readable, f"{who} did not report within {timeout:g} s (got {data!r})"
        chunk = os.read(fd, 4096)
        assert chunk, f"{who} exited before it reported (got {data!r})"
        data += chunk
    return json.loads(data.decode().splitlines()[-1])
