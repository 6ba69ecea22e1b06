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

Everything the agent costs the workload is counted: the uprobes' traps, the host tracepoints' hits
(sched_switch, page faults, ioctl: default per-hit costs measured by bench.probes, TRACEPOINT_COST_NS)
and, when the cores are contended, the agent's own CPU (llmobs.governor.contention: the workload's
runqueue wait shared out by who held the cores), spread over the probes by hit rate:

    overhead = sum(rate_i * (cost_i * scale * stall + agent_per_hit))

`cost_i` is the probe's calibrated cost beyond what the probes staying attached already pay: uprobes at
the same address share one breakpoint (the kernel runs every consumer's handler on one trap), so a
second entry probe there (`thread_span` on `linear`'s site) costs its handler only, cost_ns - empty_ns,
and shedding it saves no more; the trap goes with the last probe at the site (marginal_ns).

`stall` is how many of the workload's cores one hit holds up. A torch workload at N intra-op threads keeps
N cores busy, and its threads meet at a barrier after every parallel op: a trap on the thread that issues
the ops (where the allocator, the GEMM entry points and the token loop's probes fire) stops the others
too, spinning or sleeping until it returns. Its wall-clock cost is then the trap's time over one core's
work, not over N: SmolLM2 at 2 threads measured 2.6% slower with every probe under a 1% budget the
estimate without this term said it kept (docs/governor.md, session 20). So

    stall = max(1, busy / (1 + traps))     the workload's own work in cores (traps = sum(rate_i * cost_i *
                                           scale) cores, each also held up on the stall - 1 others)

1 for a workload that keeps at most one core busy (the estimate is as before), N for one that keeps N
cores busy. Hits spread over independent threads stall nothing beyond their own: there the estimate is
N times too high until the governor's first shed, whose observed change (learned against the stalled
prediction) brings `scale` down by the same factor.

A uprobe is shed by detaching it (AttachSession.shed_probe); a tracepoint, which one program shares
among all its targets, by its switch word in the kernel (ProbeProgram.set_probe_enabled): off while any
target of that program has it shed. `scale` (the in-situ factor over the calibrated costs) starts at
`cost_scale` and is learned per target from what each shed or restore actually changed in the
workload's CPU per token step (llmobs.governor.learning).
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
from llmobs.governor import contention as contention_mod
from llmobs.governor import learning

DEFAULT_BUDGET = 0.01
# The prior of the in-situ factor over the calibrated costs: a hit inside a real workload costs more than
# in the calibration's tight loop (the trap path with cold caches and TLB, the workload's own code slower
# after each trap). Measured once by python -m bench.governor (2.7x on the tiny model, 1.9x on
# SmolLM2-135M; 2.3 their geometric mean); from there each target's factor is learned online from its
# own sheds and restores (llmobs.governor.learning). `--cost-scale`, overhead.cost_scale set the prior.
DEFAULT_COST_SCALE = 2.3
# Per-hit costs of the host tracepoints' programs on a target's event (bench.probes cost / the ab runs
# in docs/probes.md: the program's run time less an empty tracepoint's, this host); `source` "default".
# sched_switch: the switch-out (tag read, open) plus the switch-in (close, record). page_fault_user is
# thinned (probes.thin): its tagged hits skip the clock and the ring 63 times in 64, which took its run
# time over an empty program's from 131 to 78 ns in one run (bench.probes --only cost, session 18):
# 420 x 78 / 131.
TRACEPOINT_COST_NS = {"sched_switch": 550.0, "page_fault_user": 250.0, "ioctl": 600.0}
TRACEPOINT_EMPTY_NS = 25.0  # an empty tracepoint program's dispatch and run, the ratio's denominator
# The agent's CPU per event it handles, at most (decode, store, correlate: ~2.3 us per event measured end to
# end on the tiny model, issue 14): its CPU beyond hits x this is fixed work (snapshots, ticks) that
# shedding probes would not remove, so only this much of its competing CPU is put on the probes.
AGENT_EVENT_NS_MAX = 3000.0
STEP_SEQ_OFFSET = 24  # struct llmobs_ctx_cell.step_seq (bpf/c/llmobs_abi.h)
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
    cost_ns: float  # its calibrated cost beside the probes staying attached (marginal_ns)

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


def marginal_ns(costs: dict[str, calibrate.ProbeCost], name: str, staying) -> float:
    """A hit of `name`'s calibrated cost beyond what the probes `staying` attached pay: its handler only
    (cost_ns - empty_ns) where one of them is an entry uprobe at the same address (one breakpoint, one
    trap for every consumer), else all of cost_ns."""
    cost = costs[name]
    if cost.site_class == "tracepoint" or cost.legs != "entry":
        return cost.cost_ns
    for other in staying:
        mate = costs.get(other) if other != name else None
        shares = mate is not None and mate.site == cost.site and mate.site_class != "tracepoint"
        if shares and mate.legs == "entry":
            return max(cost.cost_ns - cost.empty_ns, 0.0)
    return cost.cost_ns


def stall_cores(traps: float, busy: float) -> float:
    """The workload's cores a probe hit holds up: its own work in cores (its busy cores less the traps,
    counted once on the trapping thread and once on each core that waits), at least 1. `traps`: the
    active probes' scaled per-hit cost times their rates, in cores, before any stall."""
    return max(1.0, busy / (1.0 + max(traps, 0.0)))


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


def tracepoint_cost(probe) -> calibrate.ProbeCost:
    """The default per-hit cost of a host tracepoint probe (TRACEPOINT_COST_NS)."""
    site = "+".join(tracepoint for tracepoint, _ in probe.tracepoints) or probe.name
    legs = "entry+return" if probe.timed or probe.name == "sched_switch" else "entry"
    cost = TRACEPOINT_COST_NS.get(probe.name, 500.0)
    return calibrate.ProbeCost(probe.name, site, "tracepoint", legs, cost, TRACEPOINT_EMPTY_NS, "default")


@dataclass
class _Target:
    session: object
    pid: int
    costs: dict[str, calibrate.ProbeCost]
    scale: float = DEFAULT_COST_SCALE  # the in-situ factor, learned (llmobs.governor.learning)
    samples: deque = field(default_factory=deque)  # (t, {probe: count}, cpu_s, steps, wait_s)
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
    step_rate: float = 0.0  # token steps per second over the window
    wait: float = 0.0  # the workload's runqueue wait over the window (cores' worth)
    agent_cores: float = 0.0  # the agent's CPU competing with this workload (contention.agent_share)
    agent_per_hit_s: float = 0.0  # ... spread over every hit the agent handles
    stall: float = 1.0  # the workload's cores one hit holds up (stall_cores), this tick
    ready: bool = False  # this tick's sample spans enough of a window
    last_action_s: float = -1e18  # the last shed or restore (a learning window must not straddle one)
    pending: learning.Pending | None = None
    learned: list = field(default_factory=list)  # the last few learned samples (observed / predicted)
    mem_fd: int | None = None  # /proc/PID/mem, for the context cell's step_seq


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
        learn_scale: bool = True,
        contention: contention_mod.Contention | None | str = "auto",
        tracepoints: bool = True,
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
        self.targets: dict[int, _Target] = {}
        self.cost_scale = cost_scale  # the prior of every target's learned scale (DEFAULT_COST_SCALE)
        self.learn_scale = learn_scale
        self.cpu_seconds = cpu_seconds
        # the agent's own CPU as a cost: read from this process and /proc unless the workload's CPU is
        # itself synthetic (a test's cpu_seconds), where a real reading would mean nothing
        if contention == "auto":
            contention = contention_mod.Contention() if cpu_seconds is process_cpu_seconds else None
        self.contention = contention
        self._agent_samples: deque = deque()  # (t, agent cpu s, host busy s)
        self.agent_cores = 0.0
        self.host_cores = 0.0
        self.tracepoints = tracepoints  # govern the host tracepoints (their switch words) too
        self._tracepoint_holders: dict[tuple[int, str], set[int]] = {}  # (program, probe) -> pids shedding
        self.decisions: deque[Decision] = deque(maxlen=history)
        self.counts: dict[str, int] = {}  # action -> decisions taken (the OTLP counter)
        self.ticks = 0

    @property
    def cost_scale(self) -> float:
        return self._cost_scale

    @cost_scale.setter
    def cost_scale(self, value: float) -> None:
        """A new prior: every target starts learning again from it."""
        if not value > 0:
            raise ValueError("the governor's cost scale must be > 0")
        self._cost_scale = value
        for target in self.targets.values():
            target.scale, target.pending = value, None

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
        for probe in getattr(session, "attached_probes", []):
            if probe.hook == "tracepoint" and probe.name not in costs:
                costs[probe.name] = tracepoint_cost(probe)
        self.targets[session.pid] = _Target(session, session.pid, costs, scale=self.cost_scale)

    def untrack(self, session) -> None:
        """Forgets a target; a tracepoint it had switched off is switched on again unless another target
        of the same program still has it shed (the program may be gone already: nothing to do then)."""
        target = self.targets.pop(session.pid, None)
        if target is not None and target.mem_fd is not None:
            os.close(target.mem_fd)
        for name in list(target.shed) if target is not None else ():
            if self._is_tracepoint(target, name):
                try:
                    self._switch_tracepoint(target, name, True)
                except Exception as exc:
                    self.log(f"governor: pid {target.pid} {name}: not switched on again at untrack: {exc}")

    def release_all(self) -> list[str]:
        """The governor is being turned off: re-attaches every probe it shed and forgets every target.
        Returns what could not be re-attached ("pid N probe: why"), each also logged."""
        failed = []
        for target in list(self.targets.values()):
            for name in list(target.shed):
                try:
                    ok, why = self._switch_on(target, name), "re-attach refused"
                except Exception as exc:
                    ok, why = False, str(exc)
                if not ok:
                    failed.append(f"pid {target.pid} {name}: {why}")
                    self.log(f"governor: pid {target.pid} {name} stays detached: {why}")
            if target.mem_fd is not None:
                os.close(target.mem_fd)
        self.targets.clear()
        return failed

    def set_budget(self, budget: float) -> None:
        if budget <= 0:
            raise ValueError("the governor's budget must be > 0")
        self.budget = budget

    def _governed(self, session) -> list[str]:
        """The session's uprobes and, where its program has switch words, its tracepoints (attached or
        shed): what the governor may switch off and on."""
        switchable = self.tracepoints and hasattr(getattr(session, "program", None), "set_probe_enabled")
        return [
            p.name for p in getattr(session, "attached_probes", [])
            if p.hook == "uprobe" or (p.hook == "tracepoint" and switchable)
        ]  # fmt: skip

    @staticmethod
    def _is_tracepoint(target: _Target, name: str) -> bool:
        cost = target.costs.get(name)
        return cost is not None and cost.site_class == "tracepoint"

    def _switch_tracepoint(self, target: _Target, name: str, enabled: bool) -> bool:
        """A tracepoint's word is per program, shared by its targets: off while any of them sheds it."""
        program = target.session.program
        holders = self._tracepoint_holders.setdefault((id(program), name), set())
        if enabled:
            holders.discard(target.pid)
            if not holders:
                program.set_probe_enabled(name, True)
        else:
            holders.add(target.pid)
            program.set_probe_enabled(name, False)
        return True

    def _switch_off(self, target: _Target, name: str) -> bool:
        if self._is_tracepoint(target, name):
            return self._switch_tracepoint(target, name, False)
        return target.session.shed_probe(name)

    def _switch_on(self, target: _Target, name: str) -> bool:
        if self._is_tracepoint(target, name):
            return self._switch_tracepoint(target, name, True)
        return target.session.restore_probe(name)

    # ---- one tick -----------------------------------------------------------------------------------
    def tick(self, now_s: float | None = None) -> list[Decision]:
        """Samples every target, sheds / restores where needed; returns (and logs) the decisions."""
        now_s = time.monotonic() if now_s is None else now_s
        self.ticks += 1
        decisions: list[Decision] = []
        self._sample_agent(now_s)
        for target in list(self.targets.values()):
            try:
                target.ready = self._sample(target, now_s)
            except Exception as exc:  # a target going away mid-tick: the caller untracks it
                target.ready, target.error = False, str(exc)
        self._share_agent_cost()
        for target in list(self.targets.values()):
            try:
                decisions += self._tick_target(target, now_s) if target.ready else []
            except Exception as exc:
                target.error = str(exc)
        for decision in decisions:
            self.decisions.append(decision)
            self.counts[decision.action] = self.counts.get(decision.action, 0) + 1
            self.log(decision.line())
        return decisions

    def _sample(self, target: _Target, now_s: float) -> bool:
        """Adds a (time, counts, cpu, steps, wait) sample; updates rates, busy, steps/s and runqueue wait.
        False until the window spans enough."""
        counts: dict[str, int] = {}
        steps = 0
        cell_steps = self._cell_steps(target)
        if hasattr(target.session, "probe_counts"):  # O(probes + live keys), not every step's totals
            for (pid, probe), n in target.session.probe_counts().items():
                if pid == target.pid and probe < len(_NAMES):
                    counts[_NAMES[probe]] = counts.get(_NAMES[probe], 0) + int(n)
            steps = cell_steps or target.session.totals_overview()[2]  # else the newest step counted
        else:
            for (pid, probe, step), value in target.session.live_totals().items():
                if pid == target.pid and probe < len(_NAMES):
                    name = _NAMES[probe]
                    counts[name] = counts.get(name, 0) + int(value[0])
                    steps = max(steps, step)  # the context cell's step_seq: token steps so far
            steps = cell_steps or steps
        cpu = self.cpu_seconds(target.pid)
        if cpu is None:
            return False
        wait = self.contention.wait(target.pid) if self.contention is not None else None
        target.samples.append((now_s, counts, cpu, steps, wait))
        while len(target.samples) > 2 and now_s - target.samples[1][0] >= self.window_s:
            target.samples.popleft()
        first_t, first_counts, first_cpu, first_steps, first_wait = target.samples[0]
        span = now_s - first_t
        if span < self.min_span_s:
            return False
        target.rates = {
            name: max(count - first_counts.get(name, 0), 0) / span for name, count in counts.items()
        }
        target.busy = max(cpu - first_cpu, 0.0) / span
        target.step_rate = max(steps - first_steps, 0) / span
        waited = wait is not None and first_wait is not None
        target.wait = max(wait - first_wait, 0.0) / span if waited else 0.0
        self._learn(target, now_s, cpu, steps)
        return True

    @staticmethod
    def _cell_steps(target: _Target) -> int | None:
        """The workload's token steps from its context cell (step_seq, /proc/PID/mem): counted even when
        every probe that tags events with the step is shed. None without a cell or where unreadable."""
        address = getattr(target.session, "cell_address", 0)
        if not isinstance(address, int) or not address:
            return None
        try:
            if target.mem_fd is None:
                target.mem_fd = os.open(f"/proc/{target.pid}/mem", os.O_RDONLY)
            raw = os.pread(target.mem_fd, 8, address + STEP_SEQ_OFFSET)
        except OSError:
            return None
        return int.from_bytes(raw, "little") if len(raw) == 8 else None

    def _sample_agent(self, now_s: float) -> None:
        """The agent's and the host's busy cores over the window (for contention.agent_share)."""
        if self.contention is None:
            return
        try:
            agent, host = self.contention.tick()
        except (OSError, ValueError):
            return
        self._agent_samples.append((now_s, agent, host))
        while len(self._agent_samples) > 2 and now_s - self._agent_samples[1][0] >= self.window_s:
            self._agent_samples.popleft()
        first_t, first_agent, first_host = self._agent_samples[0]
        span = now_s - first_t
        if span > 0:
            self.agent_cores = max(agent - first_agent, 0.0) / span
            self.host_cores = max(host - first_host, 0.0) / span

    def _share_agent_cost(self) -> None:
        """Each target's share of the agent's CPU (what its runqueue wait says the agent took from it),
        spread over every hit the agent handles, of all targets: the agent's work is per event."""
        ready = [t for t in self.targets.values() if t.ready]
        hits = sum(t.rates.get(n, 0.0) for t in ready for n in self._governed(t.session) if n not in t.shed)
        per_event = min(1.0, hits * AGENT_EVENT_NS_MAX * 1e-9 / self.agent_cores) if self.agent_cores else 0
        for target in ready:
            target.agent_cores = per_event * contention_mod.agent_share(
                target.wait, self.agent_cores, self.host_cores, target.busy
            )
            target.agent_per_hit_s = target.agent_cores / hits if hits > 0 else 0.0

    @staticmethod
    def _cost_s(target: _Target, ns: float) -> float:
        """What one hit costs the workload: its calibrated cost `ns` (marginal_ns), scaled, on each core
        it holds up, plus its share of the agent's competing CPU."""
        return ns * 1e-9 * target.scale * target.stall + target.agent_per_hit_s

    @staticmethod
    def _calibrated(target: _Target, names: list[str]) -> float:
        """The probes `names` together at their calibrated costs, unscaled (CPU-s per s): a shared site's
        trap is counted once, on the first of them."""
        costs = target.costs
        return sum(
            target.rates.get(n, 0.0) * marginal_ns(costs, n, names[:i]) * 1e-9 for i, n in enumerate(names)
        )

    def _overhead(self, target: _Target, names) -> float:
        names = [n for n in names if n in target.costs]
        agent = target.agent_per_hit_s * sum(target.rates.get(n, 0.0) for n in names)
        return self._calibrated(target, names) * target.scale * target.stall + agent

    # ---- learning the in-situ scale -------------------------------------------------------------------
    def _learn(self, target: _Target, now_s: float, cpu: float, steps: float) -> None:
        """Completes a pending observation once a whole window has passed since its action."""
        pending = target.pending
        if pending is None or now_s - pending.at_s < self.window_s:
            return
        target.pending = None
        after = learning.Window(cpu - pending.cpu_at, steps - pending.steps_at)
        sample = learning.learned_sample(pending, after)
        if sample is None:
            return
        before = target.scale
        target.scale = learning.updated_scale(target.scale, sample)
        target.learned = [*target.learned[-4:], round(sample, 3)]
        self.log(
            f"governor: pid {target.pid} cost scale {before:.2f} -> {target.scale:.2f} (this action's "
            f"observed/predicted {sample:.2f}; CPU per step {pending.before.cpu_per_step * 1e3:.3f} -> "
            f"{after.cpu_per_step * 1e3:.3f} ms)"
        )

    def _observe(self, target: _Target, now_s: float, sign: float, switched: dict[str, tuple]) -> None:
        """Starts an observation of an action that switched `switched` (probe -> its rate and its marginal
        calibrated cost, ns), if its before window is clean (no other action in it) and the workload
        makes token steps."""
        clean = now_s - target.last_action_s >= self.window_s and target.pending is None
        target.pending = None  # an action inside a pending observation's window spoils it
        target.last_action_s = now_s
        if not (self.learn_scale and clean and target.step_rate > 0 and len(target.samples) >= 2):
            return
        first_t, _counts, first_cpu, first_steps, _wait = target.samples[0]
        _t, _counts, cpu, steps, _wait = target.samples[-1]
        unscaled = target.stall * sum(rate * ns * 1e-9 for rate, ns in switched.values())
        target.pending = learning.Pending(
            now_s, sign, unscaled / target.step_rate,
            learning.Window(cpu - first_cpu, steps - first_steps), cpu, steps,
        )  # fmt: skip

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
        if not governed:
            return []
        active = [n for n in governed if n not in target.shed]
        target.stall = stall_cores(self._calibrated(target, active) * target.scale, target.busy)
        overhead = self._overhead(target, active)
        # the hits are charged to the workload's busy time, the agent's competing CPU is not (it is wait)
        in_busy = overhead - target.agent_per_hit_s * sum(target.rates.get(n, 0.0) for n in active)
        target.useful = useful_work(in_busy, target.busy)
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
        weight = {n: target.rates.get(n, 0.0) * marginal_ns(target.costs, n, active) for n in active}
        by_weight = sorted(active, key=weight.__getitem__, reverse=True)
        remaining = list(active)
        for name in by_weight:
            if slowdown(overhead, useful) <= self.budget:
                break
            rate = target.rates.get(name, 0.0)
            if rate <= 0:
                continue
            before = slowdown(overhead, useful)
            ns = marginal_ns(target.costs, name, [n for n in remaining if n != name])
            part = rate * self._cost_s(target, ns)
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
            if target.agent_cores > 0:
                reason += (
                    f"; the agent's own CPU competing: {target.agent_cores:.3f} cores "
                    f"(workload waited {target.wait:.3f} cores on the runqueue)"
                )
            try:
                ok = self._switch_off(target, name)
            except Exception as exc:
                ok, reason = False, f"{reason}; detach failed: {exc}"
            if not ok:
                decisions.append(
                    self._decision(now_s, target, name, "shed-failed", before, before, reason, rate, ns)
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
            decisions.append(self._decision(now_s, target, name, action, before, after, reason, rate, ns))
        target.estimate = slowdown(overhead, useful)
        switched = {d.probe: (d.rate_hz, d.cost_ns) for d in decisions if d.action in ("shed", "shed-last")}
        if switched:
            self._observe(target, now_s, +1.0, switched)
        return decisions

    def _restore(self, target: _Target, now_s: float, active: list[str], overhead: float) -> list[Decision]:
        """Restores at most one probe per tick: the one whose projected cost is smallest."""
        if not target.shed or now_s - target.last_restore_s < max(self.min_interval_s, self.window_s):
            return []
        projected = {name: self._projected_rate(target, name) for name in target.shed}
        marginal = {name: marginal_ns(target.costs, name, active) for name in target.shed}
        order = sorted(target.shed, key=lambda n: (projected[n] * marginal[n], marginal[n]))
        for name in order:
            part = projected[name] * self._cost_s(target, marginal[name])
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
                ok = self._switch_on(target, name)
            except Exception as exc:
                ok, reason = False, f"re-attach failed: {exc}"
            if not ok:
                target.last_change[name] = now_s  # do not retry at once
                return [
                    self._decision(
                        now_s, target, name, "restore-failed", before, before, reason, 0.0, marginal[name]
                    )
                ]
            del target.shed[name]
            target.calm_since.pop(name, None)
            target.last_change[name] = now_s
            target.restored_at[name] = now_s
            target.last_restore_s = now_s
            target.estimate = with_it
            self._observe(target, now_s, -1.0, {name: (projected[name], marginal[name])})
            rate, ns = projected[name], marginal[name]
            return [self._decision(now_s, target, name, "restore", before, with_it, reason, rate, ns)]
        return []

    def _decision(self, now_s, target, name, action, before, after, reason, rate, cost_ns) -> Decision:
        return Decision(
            now_s, time.strftime("%H:%M:%S"), target.pid, name, action, before, after, reason, rate, cost_ns,
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
            "cost_scale": round(target.scale, 3),
            "stall_cores": round(target.stall, 2),
            "learned": list(target.learned),
            "step_rate": round(target.step_rate, 2),
            "agent_cores": round(target.agent_cores, 4),
            "runqueue_wait_cores": round(target.wait, 4),
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
