"""What `attach` tells the user: the attach plan, a live status line, and the closing summary."""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

import numpy as np

from llmobs.bpf.profiles import PROBES
from llmobs.dataflow import SinkResult

_NAMES = [probe.name for probe in PROBES]


def attached(session, stream: TextIO = sys.stderr) -> None:
    """One line per attached / skipped probe, with where each uprobe sits."""
    where = {r.probe.name: r for r in session.resolved}
    for probe in session.attached_probes:
        resolved = where.get(probe.name)
        if resolved:
            site = f"{os.path.basename(resolved.path)}:{resolved.symbol.name}{resolved.placement.describe()}"
        else:
            site = ", ".join(tp for tp, _ in probe.tracepoints)
        durations = session.options.gemm_durations and probe.optional_duration
        timed = " entry+return" if probe.timed or durations else ""
        print(f"attached {probe.name:<16} {site}{timed}", file=stream)
    for skipped in session.skipped:
        print(f"skipped  {skipped.probe.name:<16} {skipped.reason}", file=stream)
    for note in session.notes:
        print(f"note: {note}", file=stream)
    tag = (
        f"context cell at {session.cell_address:#x}"
        if session.cell_address
        else "no llmobs map: events untracked"
    )
    print(f"pid {session.pid}: {tag}; attached in {session.stats.attached_after_s:.2f} s", file=stream)


class StatusLine:
    """events/s, drops and steps: rewritten in place on a TTY, a plain line every 10 s otherwise.
    A sink of the target's raw events (it counts what was sampled, per probe). `interval` None is those
    defaults (1 s on a TTY, 10 s otherwise); a given interval is used as it is (`attach`'s hidden
    `--status-interval`, with which a test sees the first line soon after the loop has started)."""

    name = "status"

    def __init__(self, session, interval: float | None = None, stream: TextIO = sys.stderr):
        self.session = session
        self.stream = stream
        self.tty = stream.isatty()
        self.interval = interval if interval is not None else (1.0 if self.tty else 10.0)
        self.sampled_by_probe = np.zeros(len(PROBES), dtype=np.int64)
        self._last_time = time.monotonic()
        self._last_total = 0
        self._next = self._last_time + self.interval
        self._printed = False

    def submit(self, events: np.ndarray) -> None:
        if len(events):
            self.sampled_by_probe += np.bincount(events["probe"], minlength=len(PROBES))[: len(PROBES)]

    def close(self, timeout: float | None = None) -> SinkResult:
        return SinkResult(self.name, accepted=int(self.sampled_by_probe.sum()))

    def maybe_print(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval
        total, steps, last = self.session.totals_overview()  # not every step's totals merged each time
        rate = (total - self._last_total) / max(now - self._last_time, 1e-9)
        self._last_total, self._last_time = total, now
        counters = self.session.counters()
        line = (
            f"pid {self.session.pid} | {rate:,.0f} events/s | sampled {int(self.sampled_by_probe.sum()):,} | "
            f"drops kernel {counters['ring_drops']:,} user {counters['user_drops']:,} | "
            f"steps {steps:,}" + (f" (last {last})" if steps else "")
        )
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._printed = True

    def finish(self) -> None:
        if self.tty and self._printed:
            self.stream.write("\n")
            self.stream.flush()


def summary(session, final: dict, reason: str, status: StatusLine) -> dict:
    totals = final.get("totals", {})
    per_probe: dict[str, dict] = {}
    per_step: dict[int, dict[str, int]] = {}
    for (_pid, probe, step), (count, sum_value, sum_duration) in totals.items():
        name = _NAMES[probe]
        slot = per_probe.setdefault(name, {"count": 0, "sum_value": 0, "sum_duration_ns": 0, "sampled": 0})
        slot["count"] += count
        slot["sum_value"] += sum_value
        slot["sum_duration_ns"] += sum_duration
        per_step.setdefault(step, {})[name] = per_step.setdefault(step, {}).get(name, 0) + count
    for index, sampled in enumerate(status.sampled_by_probe.tolist()):
        if sampled:
            per_probe.setdefault(
                _NAMES[index], {"count": 0, "sum_value": 0, "sum_duration_ns": 0, "sampled": 0}
            )
            per_probe[_NAMES[index]]["sampled"] = sampled
    stats = session.stats
    decode_rate = stats.sampled / stats.decode_seconds if stats.decode_seconds > 0 else None
    return {
        "pid": session.pid,
        "reason": reason,
        "target_exited": reason == "target exited",
        "profiles": list(session.options.profiles),
        "sample_n": session.options.sample_n,
        "sample_mode": session.options.sample_mode,
        "attached": [probe.name for probe in session.attached_probes],
        "skipped": {s.probe.name: s.reason for s in session.skipped},
        "placements": {r.probe.name: r.placement.describe() for r in session.resolved},
        "context_cell": session.cell_address,
        "attached_after_s": stats.attached_after_s,
        "first_event_after_s": stats.first_event_after_s,
        "first_event_after_process_start_s": (
            None
            if stats.first_event_after_s is None
            else stats.first_event_after_s + session.process_age_at_start_s
        ),
        "elapsed_s": time.monotonic() - stats.started_at,
        "counters": final.get("counters", {}),
        "detach_problems": final.get("problems", []),
        "per_probe": per_probe,
        "per_step": {str(step): counts for step, counts in sorted(per_step.items())},
        "sampled_events": stats.sampled,
        "decode_events_per_s": decode_rate,
    }


def print_summary(data: dict, stream: TextIO, last_steps: int = 10) -> None:
    print(f"detached from pid {data['pid']} after {data['elapsed_s']:.1f} s ({data['reason']})", file=stream)
    print(
        f"{'probe':<16} {'events':>12} {'sampled':>10} {'sum value':>16} {'sum duration ms':>16}", file=stream
    )
    for name, slot in sorted(data["per_probe"].items()):
        print(
            f"{name:<16} {slot['count']:>12,} {slot['sampled']:>10,} {slot['sum_value']:>16,} "
            f"{slot['sum_duration_ns'] / 1e6:>16,.1f}",
            file=stream,
        )
    steps = [step for step in data["per_step"] if step != "0"]
    untracked = data["per_step"].get("0")
    print(
        f"steps seen: {len(steps)}"
        + (f"; untracked events: {sum(untracked.values()):,}" if untracked else ""),
        file=stream,
    )
    for step in steps[-last_steps:]:
        counts = ", ".join(f"{name} {count:,}" for name, count in sorted(data["per_step"][step].items()))
        print(f"  step {step}: {counts}", file=stream)
    counters = data["counters"]
    print(
        f"drops: kernel {counters.get('ring_drops', 0):,}, user {counters.get('user_drops', 0):,}; "
        f"aggregate overflow {counters.get('agg_overflow', 0):,}; "
        f"context-cell read faults {counters.get('ctx_faults', 0):,}",
        file=stream,
    )
    if data["first_event_after_s"] is not None:
        total, own = data["first_event_after_process_start_s"], data["first_event_after_s"]
        print(
            f"first event {total:.2f} s after the agent started (attach began {total - own:.2f} s in; "
            f"probes attached {data['attached_after_s']:.2f} s after that)",
            file=stream,
        )
    for problem in data["detach_problems"]:
        print(f"warning: detach: {problem}", file=stream)
