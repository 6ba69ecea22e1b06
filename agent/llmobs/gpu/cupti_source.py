"""CuptiSource: one finished trace as a Source of the pipeline.

A trace (llmobs.gpu.tracer) has read its CUPTI records and the token steps of the collected range from
the map; this hands them on as one batch, {"gpu_ops": ..., "token_steps": ...}, so that `trace --db`
stores them through the same Pipeline (store writer, final correlate) as `attach` does, instead of
appending and correlating by hand.

Token steps the store already holds are left out (`stored_steps`): the workload's steps reach a store
from `attach` too, and a second trace of the same range must add CUPTI rows without duplicating steps.
The check is by step_seq over the trace's range (a set, not the pipeline's newest-key resume point: a
trace's steps may be older than what an attach stored since).
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from llmobs import clock
from llmobs.gpu.records import gpu_ops_rows, select_rows

STORED_STEPS_SQL = "SELECT DISTINCT step_seq FROM token_steps WHERE pid = ? AND step_seq BETWEEN ? AND ?"


def stored_step_seqs(conn, pid: int, steps: dict) -> set[int]:
    """The step_seqs of `steps` (token-step columns) that `pid` already has in the store behind `conn`."""
    seqs = np.asarray(steps["step_seq"])
    if not len(seqs):
        return set()
    rows = conn.execute(STORED_STEPS_SQL, [pid, int(seqs.min()), int(seqs.max())]).fetchall()
    return {int(r[0]) for r in rows}


def clock_fit(result: dict) -> clock.ClockFit | None:
    """The collector's CUPTI -> CLOCK_MONOTONIC fit (its MARK_CLOCK record), None when none came."""
    mark = result["capture"].clock
    if mark is None:
        return None
    return clock.ClockFit(mark.ref_mono_ns, mark.offset_ns, mark.drift_ppm, mark.residual_ns,
                          mark.max_residual_ns, mark.samples)  # fmt: skip


class CuptiSource:
    """`poll()` returns the trace's batch once, then None; `stats()` counts what it handed on."""

    def __init__(self, result: dict, stored_steps: Collection[int] = ()):
        self.result = result
        self.pid = int(result["pid"])
        self._stored = set(stored_steps)
        self._handed = False
        self.counters = {"records": 0, "token_steps": 0, "already_stored": 0}

    def poll(self) -> dict | None:
        if self._handed:
            return None
        self._handed = True
        result = self.result
        steps = result["steps"]
        batch: dict = {"gpu_ops": gpu_ops_rows(self.pid, result["records"], result["names"], steps)}
        self.counters["records"] = len(result["records"])
        fresh = _without(steps, self._stored)
        self.counters["already_stored"] = len(steps["step_seq"]) - len(fresh["step_seq"])
        if len(fresh["step_seq"]):
            batch["token_steps"] = fresh
            self.counters["token_steps"] = len(fresh["step_seq"])
        return batch

    def stats(self) -> dict[str, int]:
        return dict(self.counters)


def _without(steps: dict, stored: set[int]) -> dict:
    """The token-step columns whose step_seq is not in `stored`."""
    if not stored:
        return steps
    return select_rows(steps, ~np.isin(np.asarray(steps["step_seq"]), list(stored)))
