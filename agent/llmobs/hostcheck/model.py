"""The data the host checks produce: a status, a row per check, and the context they share."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any


class Status(StrEnum):
    OK = "OK"
    DEGRADED = "DEGRADED"  # works, with a limitation the detail names
    MISSING = "MISSING"  # not there or not working; the hint says what to do


@dataclass(frozen=True)
class Row:
    """One line of the doctor's table: what was found and, when not OK, what to do about it."""

    check: str  # stable id, e.g. "uprobe"; scripts key on it in `doctor --json`
    title: str
    status: Status
    detail: str
    hint: str = ""
    required: bool = False  # needed by the CPU probe profile (decides the exit code)
    elapsed_ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "title": self.title,
            "status": str(self.status),
            "detail": self.detail,
            "hint": self.hint,
            "required_for_cpu_profile": self.required,
            "elapsed_ms": round(self.elapsed_ms, 1),
        }


@dataclass
class Finding:
    """What a check function returns; the runner adds the id, title, timing and requirement."""

    status: Status
    detail: str
    hint: str = ""


@dataclass
class Context:
    """What the checks share: the filesystem root they read /proc and /sys under (a tmp_path in unit
    tests), the rows so far, and live objects (a loaded BPF program) to release at the end."""

    root: Path = Path("/")
    rows: dict[str, Row] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    _closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def live(self) -> bool:
        """True when the checks look at this very host (only then may they load BPF programs)."""
        return os.path.realpath(self.root) == "/"

    def path(self, absolute: str) -> Path:
        """`absolute` (e.g. "/proc/self/status") under the context's root."""
        return self.root / absolute.lstrip("/")

    def on_close(self, closer: Callable[[], None]) -> None:
        self._closers.append(closer)

    def close(self) -> None:
        """Release what the checks left open (BPF programs, probes), newest first; never raises."""
        while self._closers:
            closer = self._closers.pop()
            with contextlib.suppress(Exception):  # a failing cleanup must not hide the report
                closer()


CheckFn = Callable[[Context], Finding]


@dataclass(frozen=True)
class Check:
    check: str
    title: str
    fn: CheckFn
    timeout_s: float = 5.0
    required: bool = False
