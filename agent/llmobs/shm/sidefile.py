"""Files the workload writes next to its map for the agent (a dL/dE dump, a replay's result): written
whole under a temporary name and renamed into place, mode 0600, so the agent never reads half a file
and no other user reads it at all."""

from __future__ import annotations

import contextlib
import os

import numpy as np


def write_npz_atomically(path: str, arrays: dict) -> None:
    """`arrays` as .npz at `path` (mode 0600): written under a temporary name, then renamed into place."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
