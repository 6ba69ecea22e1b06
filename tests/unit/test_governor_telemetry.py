"""The agent's self-telemetry read from the real /proc/self, its OTLP encoding (llmobs.agent.*), and the
header line `top` prints from it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from llmobs.commands.top import agent_lines
from llmobs.governor import SelfTelemetry
from llmobs.governor.telemetry import agent_metrics, own_rss_bytes, top_fields


def vm_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def burn_cpu(seconds: float) -> None:
    """Spin until this process's own CPU clock advanced by `seconds` (a condition, not a sleep)."""
    end = time.process_time() + seconds
    x = 0
    while time.process_time() < end:
        x += 1


def test_cpu_rss_and_threads_come_from_proc_self() -> None:
    telemetry = SelfTelemetry()
    burn_cpu(0.3)
    first = telemetry.sample()
    assert first["cpu_percent"] > 0  # the CPU burnt since the telemetry started
    assert first["agent_pid"] > 0 and first["cpu_seconds"] >= 0.3
    assert abs(first["rss_bytes"] - vm_rss_bytes()) < 8 << 20
    ballast = bytearray(64 << 20)  # touched: +64 MiB resident
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    assert own_rss_bytes() - first["rss_bytes"] > 48 << 20
    release, started = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (started.set(), release.wait(10)))
    worker.start()
    started.wait(10)
    try:
        second = telemetry.sample()
        assert second["threads"] == first["threads"] + 1
    finally:
        release.set()
        worker.join()
    del ballast
    assert second["events"] == 0 and second["drops"] == {} and second["export"] is None


def test_idle_process_reads_near_zero_cpu() -> None:
    telemetry = SelfTelemetry()
    telemetry.sample()
    threading.Event().wait(0.3)  # idle on purpose: the thing measured, not a synchronisation
    assert telemetry.sample()["cpu_percent"] < 50


class _Counters:
    spans_sent, spans_failed, spans_dropped, attempts_failed, metrics_failed = 10, 4, 1, 2, 0
    last_error = "UNAVAILABLE"


class _Exporter:
    counters = _Counters()


def test_export_counters_survive_untracking() -> None:
    telemetry = SelfTelemetry()
    exporter = _Exporter()
    telemetry.track_exporter(exporter)
    assert telemetry.sample()["export"]["attempts_failed"] == 2
    telemetry.untrack_exporter(exporter)
    export = telemetry.sample()["export"]
    assert export["attempts_failed"] == 2 and export["spans_dropped"] == 1


SAMPLE = {
    "agent_pid": 7, "cpu_percent": 12.5, "rss_bytes": 300 << 20, "events": 1000, "events_sampled": 900,
    "drops": {"kernel_ring_full": 3, "user_writer_queue": 1}, "drops_kernel": 3, "drops_user": 1,
    "export": {"spans_sent": 5, "spans_failed": 0, "spans_dropped": 2, "attempts_failed": 4,
               "metrics_failed": 0, "last_error": None},
    "governor": {"budget": 0.01, "decisions": {"shed": 2}, "targets": {"42": {"estimate": 0.008,
                                                                             "shed": ["alloc_cpu"]}}},
}  # fmt: skip


def test_agent_metrics_are_llmobs_agent_points() -> None:
    points = {(p.name, p.attributes): p for p in agent_metrics(SAMPLE)}
    assert all(name.startswith("llmobs.agent.") for name, _ in points)
    assert points[("llmobs.agent.cpu.utilization", ())].value == pytest.approx(0.125)
    assert points[("llmobs.agent.cpu.utilization", ())].kind == "gauge"
    assert points[("llmobs.agent.drops", (("llmobs.drop.where", "kernel_ring_full"),))].value == 3
    assert points[("llmobs.agent.export.failures", ())].value == 4
    assert points[("llmobs.agent.governor.decisions", (("llmobs.governor.action", "shed"),))].value == 2
    assert points[("llmobs.agent.governor.shed_probes", (("process.pid", "42"),))].value == 1


def test_agent_metrics_encode_into_the_exporters_request() -> None:
    from llmobs.otlp.encoder import SpanIds
    from llmobs.otlp.metrics import MetricsAggregator

    aggregator = MetricsAggregator(SpanIds("prompt", b""), 0, 1, {"service.name": "t"})
    assert aggregator.encode(2) is None
    aggregator.set_agent_metrics(agent_metrics(SAMPLE))
    assert aggregator.agent_dirty
    request = aggregator.encode(2)
    metrics = {m.name: m for m in request.resource_metrics[0].scope_metrics[0].metrics}
    assert metrics["llmobs.agent.memory.rss"].gauge.data_points[0].as_double == 300 << 20
    drops = metrics["llmobs.agent.drops"].sum
    assert drops.is_monotonic and len(drops.data_points) == 2
    assert metrics["llmobs.agent.governor.slowdown"].gauge.data_points[0].as_double == pytest.approx(0.008)


def test_top_prints_one_header_line_per_agent() -> None:
    state = {"budget": 0.01, "estimate": 0.008, "shed": ["alloc_cpu", "free_cpu"],
             "decisions": [{"wall": "07:40:01", "action": "shed", "probe": "free_cpu"}]}  # fmt: skip
    rows = [{"pid": 42, "agent": top_fields(SAMPLE, state)}, {"pid": 43}]
    (line,) = agent_lines(rows)
    assert line.startswith("agent 7: cpu 12.5%  rss 300 MiB  events 1,000  drops kernel 3 user 1")
    assert "export failures 4" in line
    assert (
        "governor 1.00%: pid 42 est. slowdown 0.80%, shed alloc_cpu,free_cpu (last: 07:40:01 shed free_cpu)"
        in line
    )
    off = agent_lines([{"pid": 42, "agent": top_fields({**SAMPLE, "export": None}, None)}])[0]
    assert off.endswith("| governor off") and "export" not in off
