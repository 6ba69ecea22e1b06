"""The agent's own telemetry: what it saw, what it lost and where, what exporting failed, and what the
agent itself costs (CPU, RSS), sampled on demand (`SelfTelemetry.sample()`, about once a second).

Sources are registered as they come and go (attach sessions, pipelines, OTLP exporters, the governor);
a source that is removed has its final counts folded into the totals, so counters never go backwards
while targets come and go. Programs shared by several sessions (a daemon's fleet) have their kernel
counters counted once.

`agent_metrics(sample)` turns a sample into OTLP data points named llmobs.agent.* (sent by the OTLP
exporter's metrics path, llmobs.otlp.metrics.MetricsAggregator.set_agent_metrics).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from llmobs import clock
from llmobs.stagecpu import STAGES

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
# kernel counters of a program (bpf/c/llmobs_events.h LLMOBS_CTR_*) -> drop names
KERNEL_DROPS = {"ring_drops": "kernel_ring_full", "agg_overflow": "kernel_aggregates_full",
                "start_lost": "kernel_interval_lost"}  # fmt: skip
# Pipeline.drops() names -> drop names (user space: the agent's queues and the map reader; the workload's
# own publisher, which drops rather than blocks when its ring is full, reports through its map)
PIPELINE_DROPS = {"map_lost": "user_map_lapped", "map_corrupt": "user_map_corrupt",
                  "map_writer_dropped": "workload_map_full", "store_dropped": "user_writer_queue",
                  "store_failed": "user_store_failed"}  # fmt: skip
EXPORT_COUNTERS = ("spans_sent", "spans_failed", "spans_dropped", "attempts_failed", "metrics_failed")


def own_cpu_seconds(pid: int | str = "self") -> tuple[float, int]:
    """(utime + stime in seconds, thread count) of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        fields = handle.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK, int(fields[17])


def own_rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm", "rb") as handle:
        return int(handle.read().split()[1]) * _PAGE


class SelfTelemetry:
    """Counters and gauges of this agent process; `sample()` returns them as one JSON-ready dict."""

    def __init__(self, governor=None):
        self.governor = governor
        self.sessions: list = []
        self.pipelines: list = []
        self.exporters: list = []
        self._retired = {"events": 0, "events_sampled": 0, "drops": {}, "export": {}}
        self._last = (time.monotonic(), *own_cpu_seconds())
        self.samples = 0

    # ---- sources ---------------------------------------------------------------------------------------
    def track_session(self, session) -> None:
        self.sessions.append(session)

    def untrack_session(self, session, final: dict | None = None) -> None:
        """Stop reading `session`; its last counts (or `final` from session.close()) stay in the totals."""
        if session not in self.sessions:
            return
        self.sessions.remove(session)
        events = sum(int(v[0]) for v in (final or {}).get("totals", {}).values()) if final else 0
        if not final:
            events = self._session_events(session)
        self._retired["events"] += events
        self._retired["events_sampled"] += int(session.stats.sampled)
        counters = (final or {}).get("counters") or self._safe_counters(session)
        if not getattr(session.options, "shared", False):  # a shared program's counters outlive it
            self._add(self._retired["drops"], self._kernel_drops(counters))
        self._add(self._retired["drops"], {"user_ring_decode": int(counters.get("user_drops", 0))})

    def track_pipeline(self, pipeline) -> None:
        self.pipelines.append(pipeline)

    def untrack_pipeline(self, pipeline) -> None:
        if pipeline in self.pipelines:
            self.pipelines.remove(pipeline)
            self._add(self._retired["drops"], self._pipeline_drops(pipeline))

    def track_exporter(self, exporter) -> None:
        self.exporters.append(exporter)

    def untrack_exporter(self, exporter) -> None:
        if exporter in self.exporters:
            self.exporters.remove(exporter)
            self._add(self._retired["export"], self._export_counts(exporter))

    # ---- reading ---------------------------------------------------------------------------------------
    @staticmethod
    def _add(into: dict, values: dict) -> None:
        for key, value in values.items():
            into[key] = into.get(key, 0) + value

    @staticmethod
    def _safe_counters(session) -> dict:
        try:
            return session.counters()
        except Exception:
            return {}

    @staticmethod
    def _session_events(session) -> int:
        try:
            if hasattr(session, "probe_counts"):  # O(probes + live keys), not every step's totals
                return sum(
                    int(n) for (pid, _probe), n in session.probe_counts().items() if pid == session.pid
                )
            return sum(int(v[0]) for key, v in session.live_totals().items() if key[0] == session.pid)
        except Exception:
            return 0

    @staticmethod
    def _kernel_drops(counters: dict) -> dict:
        return {name: int(counters.get(key, 0)) for key, name in KERNEL_DROPS.items()}

    @staticmethod
    def _pipeline_drops(pipeline) -> dict:
        try:
            drops = pipeline.drops()
        except Exception:
            return {}
        return {name: int(drops.get(key, 0)) for key, name in PIPELINE_DROPS.items()}

    @staticmethod
    def _export_counts(exporter) -> dict:
        counters = exporter.counters
        return {name: int(getattr(counters, name, 0)) for name in EXPORT_COUNTERS}

    def _anomaly_lag(self) -> dict:
        """The live detectors' lag (llmobs.diagnostics.live): the worst pipeline's last step-end-to-row
        latency, and the rows committed later than the target, so a falling-behind agent says so."""
        lanes = [p.anomalies for p in self.pipelines if getattr(p, "anomalies", None) is not None]
        if not lanes:
            return {}
        return {"anomaly_lag_s": max(lane.lag_ns for lane in lanes) / 1e9,
                "anomaly_rows_late": sum(lane.counters.late for lane in lanes)}  # fmt: skip

    def sample(self) -> dict:
        """One reading: own CPU % (since the previous sample) and RSS, events, drops, export, governor."""
        now = time.monotonic()
        cpu_s, threads = own_cpu_seconds()
        last_t, last_cpu, _ = self._last
        cpu_percent = 100.0 * (cpu_s - last_cpu) / max(now - last_t, 1e-6)
        self._last = (now, cpu_s, threads)
        self.samples += 1
        drops = dict(self._retired["drops"])
        events = self._retired["events"]
        sampled = self._retired["events_sampled"]
        seen_programs: set[int] = set()
        for session in self.sessions:
            events += self._session_events(session)
            sampled += int(session.stats.sampled)
            counters = self._safe_counters(session)
            self._add(drops, {"user_ring_decode": int(counters.get("user_drops", 0))})
            program = getattr(session, "program", None)
            if program is not None and id(program) not in seen_programs:  # once per shared program
                seen_programs.add(id(program))
                self._add(drops, self._kernel_drops(counters))
        for pipeline in self.pipelines:
            self._add(drops, self._pipeline_drops(pipeline))
        export = dict(self._retired["export"])
        last_error = None
        for exporter in self.exporters:
            self._add(export, self._export_counts(exporter))
            last_error = exporter.counters.last_error or last_error
        result = {
            "ts_ns": clock.monotonic_ns(),
            "agent_pid": os.getpid(),
            "cpu_percent": round(cpu_percent, 2),
            "cpu_seconds": round(cpu_s, 3),
            "rss_bytes": own_rss_bytes(),
            "threads": threads,
            "targets": len(self.sessions),
            "events": events,
            "events_sampled": sampled,
            "drops": drops,
            "drops_kernel": sum(v for k, v in drops.items() if k.startswith("kernel_")),
            "drops_user": sum(v for k, v in drops.items() if not k.startswith("kernel_")),
            "export": {**{name: 0 for name in EXPORT_COUNTERS}, **export, "last_error": last_error}
            if self.exporters or export
            else None,
            "stage_cpu": STAGES.snapshot(),  # cumulative CPU by stage (llmobs.stagecpu)
            **self._anomaly_lag(),
        }
        if self.governor is not None:
            snap = self.governor.snapshot()
            result["governor"] = {
                "budget": snap["budget"],
                "decisions": snap["counts"],
                "targets": {
                    pid: {"estimate": state["estimate"], "shed": state["shed"]}
                    for pid, state in snap["targets"].items()
                },
            }
        return result


def top_fields(sample: dict, governor_state: dict | None) -> dict:
    """The compact `agent` field of a `top` snapshot (llmobs.pipeline.live.LiveStats.agent): own CPU,
    RSS, events, drops, export failures, and the governor's state for that pid (None: governor off)."""
    fields = {key: sample[key] for key in ("agent_pid", "cpu_percent", "rss_bytes", "events",
                                            "drops_kernel", "drops_user")}  # fmt: skip
    fields["export_failures"] = sample["export"]["attempts_failed"] if sample.get("export") else None
    for key in ("anomaly_lag_s", "anomaly_rows_late"):
        if key in sample:
            fields[key] = sample[key]
    if sample.get("stage_cpu") is not None:
        fields["stage_cpu"] = sample["stage_cpu"]
    fields["governor"] = None
    if governor_state is not None:
        last = (governor_state.get("decisions") or [None])[-1]
        fields["governor"] = {
            "budget": governor_state["budget"],
            "estimate": governor_state["estimate"],
            "shed": governor_state["shed"],
            "last": f"{last['wall']} {last['action']} {last['probe']}" if last else None,
        }
    return fields


@dataclass(frozen=True)
class AgentPoint:
    """One OTLP data point of the agent's own metrics."""

    name: str
    kind: str  # gauge | sum (cumulative, monotonic)
    unit: str
    description: str
    attributes: tuple[tuple[str, str], ...]
    value: float


def agent_metrics(sample: dict) -> list[AgentPoint]:
    """The llmobs.agent.* data points of one sample (what `attach --otlp` and the daemon export)."""
    points: list[AgentPoint] = []

    def add(name: str, kind: str, unit: str, description: str, value: float, attrs=()) -> None:
        points.append(AgentPoint(name, kind, unit, description, tuple(attrs), float(value)))

    add("llmobs.agent.cpu.utilization", "gauge", "1", "Agent CPU time per second (1 = one core)",
        sample["cpu_percent"] / 100.0)  # fmt: skip
    add("llmobs.agent.memory.rss", "gauge", "By", "Agent resident memory", sample["rss_bytes"])
    add("llmobs.agent.events", "sum", "{event}", "Probe events counted (exact)", sample["events"])
    add("llmobs.agent.events.sampled", "sum", "{event}", "Probe events shipped to the agent",
        sample["events_sampled"])  # fmt: skip
    for where, count in sorted(sample["drops"].items()):
        add("llmobs.agent.drops", "sum", "{event}", "Events lost, by where", count,
            [("llmobs.drop.where", where)])  # fmt: skip
    if sample.get("anomaly_lag_s") is not None:
        add("llmobs.agent.anomaly_lag", "gauge", "s", "Step end to its anomaly row committed (the last row)",
            sample["anomaly_lag_s"])  # fmt: skip
        add("llmobs.agent.anomaly.late", "sum", "{row}", "Anomaly rows committed later than 200 ms",
            sample["anomaly_rows_late"])  # fmt: skip
    export = sample.get("export")
    if export:
        add("llmobs.agent.export.failures", "sum", "{attempt}", "OTLP export attempts that failed",
            export["attempts_failed"])  # fmt: skip
        add("llmobs.agent.export.spans_dropped", "sum", "{span}", "Spans the collector rejected for good",
            export["spans_dropped"])  # fmt: skip
    governor = sample.get("governor")
    if governor:
        for action, count in sorted(governor["decisions"].items()):
            add("llmobs.agent.governor.decisions", "sum", "{decision}", "Overhead governor actions", count,
                [("llmobs.governor.action", action)])  # fmt: skip
        for pid, state in sorted(governor["targets"].items()):
            attrs = [("process.pid", str(pid))]
            add("llmobs.agent.governor.slowdown", "gauge", "1", "Estimated slowdown by the probes",
                state["estimate"], attrs)  # fmt: skip
            add("llmobs.agent.governor.shed_probes", "gauge", "{probe}", "Probes the governor has detached",
                len(state["shed"]), attrs)  # fmt: skip
    return points
