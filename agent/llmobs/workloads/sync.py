"""How a workload tells its driver where it stands, without sleeps on either side: JSON lines written
atomically to a file (--ready-file) and/or to an inherited pipe (--ready-fd)."""

from __future__ import annotations

import json
import os


def announce(line: dict, ready_file: str | None = None, ready_fd: int | None = None) -> None:
    text = json.dumps(line) + "\n"
    if ready_file:
        tmp = f"{ready_file}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, ready_file)  # a reader sees the old line or the new one, never half of one
    if ready_fd is not None:
        os.write(ready_fd, text.encode())
