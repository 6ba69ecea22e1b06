"""The agent's self-telemetry read from the real /proc/self, its OTLP encoding (llmobs.agent.*), and the
header line `top` prints from it."""

from __future__ import annotations

import functools
import os
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


def _cpu_now() -> float:
    """This process's user + system CPU seconds as the kernel's times(2) reports them: the same
    accounting /proc/self/stat exposes, read through another interface."""
    t = os.times()
    return t.user + t.system


def _bracketed_sample(
    telemetry: SelfTelemetry, spend
) -> tuple[dict, dict, tuple[float, float, float, float]]:
    """Two samples around `spend()`, each between two reads of os.times() and the monotonic clock:
    (first, second, (inner cpu, outer cpu, inner wall, outer wall)). Whatever the sampler measured
    between its two readings must lie between the inner and the outer interval."""
    w0, c0 = time.monotonic(), _cpu_now()
    first = telemetry.sample()
    c1, w1 = _cpu_now(), time.monotonic()
    spend()
    w2, c2 = time.monotonic(), _cpu_now()
    second = telemetry.sample()
    c3, w3 = _cpu_now(), time.monotonic()
    return first, second, (c2 - c1, c3 - c0, w2 - w1, w3 - w0)


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_cpu_percent_is_the_cpu_spent_between_samples(busy: bool) -> None:
    telemetry = SelfTelemetry()
    # busy: burn 0.3 s of CPU; idle: wait on purpose (the thing measured, not a synchronisation)
    spend = functools.partial(burn_cpu, 0.3) if busy else functools.partial(threading.Event().wait, 0.3)
    first, second, (cpu_in, cpu_out, wall_in, wall_out) = _bracketed_sample(telemetry, spend)
    measured = second["cpu_seconds"] - first["cpu_seconds"]
    assert cpu_in - 0.001 <= measured <= cpu_out + 0.001  # cpu_seconds is rounded to 1 ms
    assert 100 * cpu_in / wall_out - 0.01 <= second["cpu_percent"] <= 100 * cpu_out / wall_in + 0.01
    if busy:  # 0.3 s of CPU burnt between the inner reads (times(2) counts it in 10 ms ticks): the
        assert cpu_in > 0.25 and second["cpu_percent"] > 0  # bound above fails a sampler stuck at 0


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


def test_a_falling_behind_anomaly_lane_shows_in_top_and_over_otlp() -> None:
    """The live detectors' lag (llmobs.diagnostics.live): a gauge and a counter, and top's header line."""
    lagging = {**SAMPLE, "anomaly_lag_s": 0.35, "anomaly_rows_late": 6}
    points = {p.name: p for p in agent_metrics(lagging)}
    lag, late = points["llmobs.agent.anomaly_lag"], points["llmobs.agent.anomaly.late"]
    assert (lag.kind, lag.value, late.kind, late.value) == ("gauge", 0.35, "sum", 6)
    assert "llmobs.agent.anomaly_lag" not in {p.name for p in agent_metrics(SAMPLE)}  # detectors off
    (line,) = agent_lines([{"pid": 42, "agent": top_fields(lagging, None)}])
    assert "anomaly lag 350 ms (6 rows late)" in line
