"""The overhead governor: keeps each workload's estimated slowdown from the probes under a budget.

Once a tick (about a second) and for every tracked AttachSession it takes the exact per-probe hit
counts (session.live_totals(): what the kernel counted, sampled or not), turns them into hit rates
over a sliding window, and weighs them with the calibrated per-hit cost of each probe at its site
(llmobs.bpf.calibrate). The workload's busy time comes from /proc/PID/stat (utime + stime, all
threads): the traps run in the workload's own context and are part of it, so

    overhead = sum(rate_i * cost_i)            (CPU-seconds per second spent in probe hits)
    useful   = busy - overhead                 (the workload's own work; floored, see useful_work)
    slowdown = overhead / useful               (how much longer the same work takes with the probes)

Shedding a probe removes its share from busy and overhead alike, so `useful` is computed once per tick
and every estimate of that tick divides by it: shedding only ever lowers the estimate.

When the slowdown exceeds the budget (and the probes take at least `min_overhead` of a core: a
nearly idle process is not slowed down in any way that matters, however its few CPU ticks compare)
it sheds the costliest probes (largest rate * cost first) until the estimate is within budget.

A shed probe's rate is then unknown; it is projected from its rate when it was shed, scaled by the
workload's busy time since (load dropping lowers it). A probe is restored when the estimate with it
stays under `restore_below` * budget for `hold_s` (hysteresis), one probe at a time (spaced by the
window, so the next decision sees the restored probe's real rate) and never sooner than
`min_interval_s` after it was shed. Shedding is immediate (the budget comes first), so one flap -
shed, restore, shed - takes at least `min_interval_s`, and a probe shed again soon after a restore
doubles its hold (up to 8x): a workload at the edge of the budget does not make probes flap.
Shedding the last probe is allowed (the budget is a promise) but never silent: it is its own action,
"shed-last".

Only uprobes are governed: the tracepoints (host profile) are attached once per program and cost
per event hundreds of ns, not the microseconds of a uprobe trap.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from llmobs.bpf import calibrate
from llmobs.bpf.profiles import PROBES

DEFAULT_BUDGET = 0.01
# Calibrated costs x this: a hit inside a real workload costs more than in the calibration's tight loop
# (the kernel's trap path with cold caches and TLB, and the workload's own code slower after each trap).
# Measured here by python -m bench.governor, the workload's CPU per token with every probe against none:
# 2.7x the calibrated estimate on the tiny model, 1.9x on SmolLM2-135M (docs/governor.md); 2.3 is their
# geometric mean. A host or workload that differs overrides it: `--cost-scale`, overhead.cost_scale.
DEFAULT_COST_SCALE = 2.3
# When the probes' estimated cost reaches the workload's whole CPU time (a target that does nothing but
# call probed functions, or costs overestimated in situ), its own work is taken as this share of busy:
# the estimate stays finite (at most 1/MIN_USEFUL_SHARE - 1 more work) instead of dividing by ~0.
MIN_USEFUL_SHARE = 0.01
MAX_SLOWDOWN = 100.0  # 10,000%: any estimate beyond it says only "the probes dominate this process"
_NAMES = [probe.name for probe in PROBES]
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Decision:
    """One governor action, as logged, counted in metrics and shown by `top`."""

    at_s: float  # the tick's clock (monotonic seconds)
    wall: str  # HH:MM:SS when it was taken
    pid: int
    probe: str
    action: str  # shed | shed-last | restore | shed-failed | restore-failed
    before: float  # estimated slowdown before the action (fraction)
    after: float  # ... and after it
    reason: str
    rate_hz: float  # the probe's hit rate (measured, or projected for a restore)
    cost_ns: float

    def line(self) -> str:
        return (
            f"governor: pid {self.pid} {self.action} {self.probe}: estimated slowdown {self.before:.2%} -> "
            f"{self.after:.2%} ({self.reason}; {self.rate_hz:,.0f} hits/s x {self.cost_ns:,.0f} ns)"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def useful_work(overhead: float, busy: float) -> float:
    """The workload's own work (cores) when `overhead` of its `busy` cores went to probe hits; at least
    MIN_USEFUL_SHARE of busy (the estimated overhead may reach busy: rates and costs are estimated)."""
    return max(busy - overhead, MIN_USEFUL_SHARE * busy, 1e-9)


def slowdown(overhead: float, useful: float) -> float:
    """How much longer `useful` cores of work take with `overhead` cores of probe hits added, <= MAX_SLOWDOWN.
    Increasing in overhead for a fixed `useful` - the tick's useful_work(), which shedding does not change."""
    if overhead <= 0:
        return 0.0
    return min(overhead / max(useful, 1e-9), MAX_SLOWDOWN)


def probe_bound(overhead: float, busy: float) -> bool:
    """The probes' estimated cost is (nearly) all of the workload's CPU: the estimate is floored/clamped."""
    return busy - overhead <= MIN_USEFUL_SHARE * busy


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of all the threads of `pid` (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # fields 14 and 15 of proc(5)


@dataclass
class _Shed:
    at_s: float
    rate_hz: float  # its rate over the window before it was shed
    busy: float  # the workload's busy cores then


@dataclass
class _Target:
    session: object
    pid: int
    costs: dict[str, calibrate.ProbeCost]
    samples: deque = field(default_factory=deque)  # (t, {probe: count}, cpu_s)
    shed: dict[str, _Shed] = field(default_factory=dict)
    last_change: dict[str, float] = field(default_factory=dict)
    restored_at: dict[str, float] = field(default_factory=dict)
    flaps: dict[str, int] = field(default_factory=dict)
    calm_since: dict[str, float] = field(default_factory=dict)  # restore condition held since
    rates: dict[str, float] = field(default_factory=dict)
    busy: float = 0.0
    useful: float = 0.0  # busy minus the active probes' overhead (floored), for this tick
    estimate: float = 0.0
    estimate_sum: float = 0.0  # sum of estimate x busy: the mean is weighted by the work done
    estimate_weight: float = 0.0
    error: str | None = None  # why the last tick of this target failed
    last_restore_s: float = -1e18  # restores are spaced so the window sees each one's real rate


class Governor:
    """Tracks attach sessions and sheds / restores their uprobes to keep each under `budget`."""

    def __init__(
        self,
        budget: float = DEFAULT_BUDGET,
        log: Callable[[str], None] | None = None,
        *,
        window_s: float = 5.0,
        min_span_s: float = 1.0,
        restore_below: float = 0.7,
        hold_s: float = 10.0,
        min_interval_s: float = 5.0,
        min_overhead: float = 0.001,
        cost_scale: float = DEFAULT_COST_SCALE,
        cpu_seconds: Callable[[int], float | None] = process_cpu_seconds,
        history: int = 100,
    ):
        if budget <= 0:
            raise ValueError("the governor's budget must be > 0 (0 means: no governor)")
        self.budget = budget
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.restore_below = restore_below
        self.hold_s = hold_s
        self.min_interval_s = min_interval_s
        self.min_overhead = min_overhead
        if not cost_scale > 0:
            raise ValueError("the governor's cost scale must be > 0")
        self.cost_scale = cost_scale  # calibrated costs x this (DEFAULT_COST_SCALE says why)
        self.cpu_seconds = cpu_seconds
        self.targets: dict[int, _Target] = {}
        self.decisions: deque[Decision] = deque(maxlen=history)
        self.counts: dict[str, int] = {}  # action -> decisions taken (the OTLP counter)
        self.ticks = 0

    # ---- sessions -----------------------------------------------------------------------------------
    def track(self, session, costs: dict[str, calibrate.ProbeCost] | None = None) -> None:
        """Governs `session`'s uprobes, weighed with `costs` (default: the session's calibration, and
        the documented defaults for a probe it has none for)."""
        costs = dict(costs if costs is not None else getattr(session, "calibration", {}) or {})
        for resolved in getattr(session, "resolved", []):
            if resolved.probe.name not in costs:
                fallback = calibrate.default_costs("not calibrated")
                durations = getattr(getattr(session, "options", None), "gemm_durations", False)
                costs[resolved.probe.name] = calibrate.probe_cost(resolved, fallback, durations)
        self.targets[session.pid] = _Target(session, session.pid, costs)

    def untrack(self, session) -> None:
        self.targets.pop(session.pid, None)

    def release_all(self) -> list[str]:
        """The governor is being turned off: re-attaches every probe it shed and forgets every target.
        Returns what could not be re-attached ("pid N probe: why"), each also logged."""
        failed = []
        for target in list(self.targets.values()):
            for name in list(target.shed):
                try:
                    ok, why = target.session.restore_probe(name), "re-attach refused"
                except Exception as exc:
                    ok, why = False, str(exc)
                if not ok:
                    failed.append(f"pid {target.pid} {name}: {why}")
                    self.log(f"governor: pid {target.pid} {name} stays detached: {why}")
        self.targets.clear()
        return failed

    def set_budget(self, budget: float) -> None:
        if budget <= 0:
            raise ValueError("the governor's budget must be > 0")
        self.budget = budget

    @staticmethod
    def _governed(session) -> list[str]:
        """The session's uprobes (attached or shed): what the governor may switch off and on."""
        names = [p.name for p in getattr(session, "attached_probes", []) if p.hook == "uprobe"]
        return names

    # ---- one tick -----------------------------------------------------------------------------------
    def tick(self, now_s: float | None = None) -> list[Decision]:
        """Samples every target, sheds / restores where needed; returns (and logs) the decisions."""
        now_s = time.monotonic() if now_s is None else now_s
        self.ticks += 1
        decisions: list[Decision] = []
        for target in list(self.targets.values()):
            try:
                decisions += self._tick_target(target, now_s)
            except Exception as exc:  # a target going away mid-tick: the caller untracks it
                target.error = str(exc)
        for decision in decisions:
            self.decisions.append(decision)
            self.counts[decision.action] = self.counts.get(decision.action, 0) + 1
            self.log(decision.line())
        return decisions

    def _sample(self, target: _Target, now_s: float) -> bool:
        """Adds a (time, counts, cpu) sample; updates rates and busy. False until the window spans enough."""
        counts: dict[str, int] = {}
        for (pid, probe, _step), value in target.session.live_totals().items():
            if pid == target.pid and probe < len(_NAMES):
                name = _NAMES[probe]
                counts[name] = counts.get(name, 0) + int(value[0])
        cpu = self.cpu_seconds(target.pid)
        if cpu is None:
            return False
        target.samples.append((now_s, counts, cpu))
        while len(target.samples) > 2 and now_s - target.samples[1][0] >= self.window_s:
            target.samples.popleft()
        first_t, first_counts, first_cpu = target.samples[0]
        span = now_s - first_t
        if span < self.min_span_s:
            return False
        target.rates = {
            name: max(count - first_counts.get(name, 0), 0) / span for name, count in counts.items()
        }
        target.busy = max(cpu - first_cpu, 0.0) / span
        return True

    def _cost_s(self, target: _Target, name: str) -> float:
        return target.costs[name].cost_ns * 1e-9 * self.cost_scale

    def _overhead(self, target: _Target, names) -> float:
        return sum(target.rates.get(n, 0.0) * self._cost_s(target, n) for n in names if n in target.costs)

    def _projected_rate(self, target: _Target, name: str) -> float:
        shed = target.shed[name]
        if shed.busy <= 0:
            return shed.rate_hz
        return shed.rate_hz * min(target.busy / shed.busy, 4.0)

    def _tick_target(self, target: _Target, now_s: float) -> list[Decision]:
        if not self._sample(target, now_s):
            return []
        session = target.session
        governed = [n for n in self._governed(session) if n in target.costs]
        active = [n for n in governed if n not in target.shed]
        overhead = self._overhead(target, active)
        target.useful = useful_work(overhead, target.busy)
        target.estimate = slowdown(overhead, target.useful)
        target.estimate_sum += target.estimate * target.busy
        target.estimate_weight += target.busy
        if target.estimate > self.budget and overhead >= self.min_overhead:
            return self._shed(target, now_s, active, overhead)
        return self._restore(target, now_s, active, overhead)

    def _shed(self, target: _Target, now_s: float, active: list[str], overhead: float) -> list[Decision]:
        decisions = []
        useful = target.useful  # unchanged by shedding: a shed probe's share leaves busy and overhead alike
        busy_left = target.busy  # the busy time expected without the probes shed so far (for restores)
        by_weight = sorted(
            active, key=lambda n: target.rates.get(n, 0.0) * target.costs[n].cost_ns, reverse=True
        )
        remaining = list(active)
        for name in by_weight:
            if slowdown(overhead, useful) <= self.budget:
                break
            rate = target.rates.get(name, 0.0)
            if rate <= 0:
                continue
            before = slowdown(overhead, useful)
            part = rate * self._cost_s(target, name)
            after = slowdown(max(overhead - part, 0.0), useful)
            last = len(remaining) == 1
            action = "shed-last" if last else "shed"
            reason = f"over the {self.budget:.2%} budget"
            if probe_bound(overhead, target.busy):
                reason += (
                    f"; probe-bound: the probes' estimated {overhead:.3f} cores >= the workload's "
                    f"{target.busy:.3f} busy cores, its own work taken as {MIN_USEFUL_SHARE:.0%} of them"
                )
            if last:
                reason += "; the last governed probe: pid now has no uprobe attached"
            try:
                ok = target.session.shed_probe(name)
            except Exception as exc:
                ok, reason = False, f"{reason}; detach failed: {exc}"
            if not ok:
                decisions.append(
                    self._decision(now_s, target, name, "shed-failed", before, before, reason, rate)
                )
                continue
            restored = target.restored_at.get(name)
            if restored is not None and now_s - restored < 2 * self.hold_s * 2 ** target.flaps.get(name, 0):
                target.flaps[name] = min(target.flaps.get(name, 0) + 1, 3)  # shed soon after a restore
            busy_left = max(busy_left - part, useful)
            target.shed[name] = _Shed(now_s, rate, busy_left)
            target.last_change[name] = now_s
            target.calm_since.pop(name, None)
            remaining.remove(name)
            overhead = max(overhead - part, 0.0)
            decisions.append(self._decision(now_s, target, name, action, before, after, reason, rate))
        target.estimate = slowdown(overhead, useful)
        return decisions

    def _restore(self, target: _Target, now_s: float, active: list[str], overhead: float) -> list[Decision]:
        """Restores at most one probe per tick: the one whose projected cost is smallest."""
        if not target.shed or now_s - target.last_restore_s < max(self.min_interval_s, self.window_s):
            return []
        projected = {name: self._projected_rate(target, name) for name in target.shed}
        order = sorted(
            target.shed, key=lambda n: (projected[n] * target.costs[n].cost_ns, target.costs[n].cost_ns)
        )
        for name in order:
            part = projected[name] * self._cost_s(target, name)
            with_it = slowdown(overhead + part, target.useful)
            if with_it > self.restore_below * self.budget:
                target.calm_since.pop(name, None)
                continue
            since = target.calm_since.setdefault(name, now_s)
            hold = self.hold_s * 2 ** target.flaps.get(name, 0)
            if now_s - since < hold or now_s - target.last_change.get(name, -1e18) < self.min_interval_s:
                continue
            before = target.estimate
            under = f"{self.restore_below:.0%} of the budget"
            reason = f"estimate with it stayed under {under} for {now_s - since:.0f} s"
            try:
                ok = target.session.restore_probe(name)
            except Exception as exc:
                ok, reason = False, f"re-attach failed: {exc}"
            if not ok:
                target.last_change[name] = now_s  # do not retry at once
                return [self._decision(now_s, target, name, "restore-failed", before, before, reason, 0.0)]
            del target.shed[name]
            target.calm_since.pop(name, None)
            target.last_change[name] = now_s
            target.restored_at[name] = now_s
            target.last_restore_s = now_s
            target.estimate = with_it
            return [self._decision(now_s, target, name, "restore", before, with_it, reason, projected[name])]
        return []

    def _decision(self, now_s, target, name, action, before, after, reason, rate) -> Decision:
        return Decision(
            now_s, time.strftime("%H:%M:%S"), target.pid, name, action, before, after, reason, rate,
            target.costs[name].cost_ns,
        )  # fmt: skip

    # ---- reporting ----------------------------------------------------------------------------------
    def target_state(self, pid: int) -> dict | None:
        """What `top` and the snapshot show for one pid."""
        target = self.targets.get(pid)
        if target is None:
            return None
        probes = {}
        for name, cost in target.costs.items():
            shed = target.shed.get(name)
            probes[name] = {
                "state": "shed" if shed else "on",
                "rate_hz": round(
                    self._projected_rate(target, name) if shed else target.rates.get(name, 0.0), 1
                ),
                "cost_ns": round(cost.cost_ns, 1),
                "ratio": round(cost.ratio, 3),
                "site_class": cost.site_class,
                "cost_source": cost.source,
            }
        return {
            "budget": self.budget,
            "estimate": target.estimate,
            "mean_estimate": target.estimate_sum / target.estimate_weight if target.estimate_weight else None,
            "busy_cores": target.busy,
            "shed": sorted(target.shed),
            "probes": probes,
            "decisions": [d.as_dict() for d in self.decisions if d.pid == pid][-10:],
        }

    def snapshot(self) -> dict:
        """Everything, JSON-ready: budget, per-pid state, recent decisions, decision counts."""
        return {
            "budget": self.budget,
            "ticks": self.ticks,
            "counts": dict(self.counts),
            "targets": {str(pid): self.target_state(pid) for pid in self.targets},
            "decisions": [d.as_dict() for d in self.decisions],
        }
