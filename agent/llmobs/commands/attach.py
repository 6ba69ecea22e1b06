"""`llmobs-agent attach --pid N`: attach the eBPF probes to a running PyTorch process.

Runs until Ctrl-C, SIGTERM, the end of --duration, or the target's exit; then detaches everything it
attached and prints a summary (events per probe, per step). `--db [PATH]` sends the events, the exact
aggregates and the token steps of the target's map into the DuckDB store (llmobs.pipeline: correlated
while attached and once at detach); `--out FILE` writes events and aggregates to Parquet.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from llmobs.diagnostics.detectors import add_detector_arguments, detector_config
from llmobs.errors import MissingLibrary

# The ring is submitted without wake-ups; the agent drains it every 20 ms while events flow fast, and
# every 50 ms while a drain brings less than 1% of the ring: fewer wake-ups of the agent, which on a busy
# host take a core from the workload. Not longer: a loss spike's anomaly row must be stored < 200 ms after
# the spike even at p99 (docs/diagnostics.md), and a sparse ring is exactly when the spike's step may wait
# a whole period (measured: scripts/bench_drain_idle.py, docs/daemon.md).
DRAIN_PERIOD_S = (0.02, 0.05)
GOVERNOR_TICK_S = 1.0  # the overhead governor and the agent's self-telemetry run once a second


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pid", type=int, help="the PyTorch process to attach to")
    parser.add_argument(
        "--profile",
        default="cpu,host",
        help="comma-separated probe profiles: cpu (linear layers), gemm (every BLAS sgemm_, opt-in), "
        "mem (alloc_cpu/free_cpu, opt-in: costly), host (off-CPU, page faults, /dev/nvidia* ioctls), "
        "cuda (libcuda/libcudart/libnccl). Default: cpu,host",
    )
    parser.add_argument(
        "--sample", type=int, default=1, metavar="N", help="export 1 in N events (default 1: all)"
    )
    parser.add_argument(
        "--sample-mode",
        choices=("trace", "cpu"),
        default="trace",
        help="trace: keep a request whole or not at all (hash of the trace id); cpu: per-CPU counter hash",
    )
    parser.add_argument(
        "--gemm-durations",
        action="store_true",
        help="time every GEMM (entry + return probes): about twice the per-hit cost, see docs/probes.md",
    )
    parser.add_argument("--duration", type=float, metavar="S", help="detach after S seconds")
    parser.add_argument(
        "--out", metavar="FILE", help="write sampled events to FILE (.parquet) and aggregates beside it"
    )
    parser.add_argument(
        "--db",
        nargs="?",
        const="",
        metavar="PATH",
        help="store events, exact totals and the map's token steps in the DuckDB store at PATH "
        "(default: $LLMOBS_DB or /var/lib/llmobs/llmobs.duckdb)",
    )
    parser.add_argument(
        "--otlp",
        metavar="ENDPOINT",
        help="also export the store over OTLP while attached (implies --db), e.g. http://127.0.0.1:4317; "
        "OTEL_EXPORTER_OTLP_* variables configure the rest (see `llmobs-agent otlp`)",
    )
    parser.add_argument(
        "--otlp-protocol", choices=("grpc", "http/protobuf"), help="OTLP protocol (default grpc, or env)"
    )
    parser.add_argument("--ebpf", action="store_true", help="print the BPF C that would be loaded, and exit")
    parser.add_argument(
        "--ioctl-paths",
        default="/dev/nvidia*",
        metavar="GLOB",
        help="device files whose ioctls the host profile times (default /dev/nvidia*)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=1.0,
        metavar="PCT",
        help="overhead budget: the estimated slowdown of the workload the probes may cause, in percent "
        "(default 1); above it the costliest uprobes are detached and re-attached when load drops. "
        "0 = governor off (see docs/governor.md)",
    )
    parser.add_argument(
        "--cost-scale",
        type=float,
        metavar="X",
        help="multiply the calibrated per-hit probe costs by X (default: the factor measured here, 2.3: a "
        "hit inside a workload costs more than in the calibration's loop; docs/governor.md)",
    )
    add_detector_arguments(parser)
    parser.add_argument("--status-interval", type=float, default=1.0, metavar="S", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from llmobs.bpf.profiles import parse_profiles

    try:
        profiles = parse_profiles(args.profile)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.sample < 1:
        print("error: --sample must be >= 1", file=sys.stderr)
        return 2
    try:
        args.detector_config = detector_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.budget <= 100:
        print("error: --budget must be a percentage between 0 (governor off) and 100", file=sys.stderr)
        return 2
    if args.cost_scale is not None and not 0 < args.cost_scale <= 100:
        print("error: --cost-scale must be a number in (0, 100]", file=sys.stderr)
        return 2
    if args.ebpf:
        return _print_ebpf(args, profiles)
    if args.pid is None:
        print("error: --pid is required", file=sys.stderr)
        return 2
    return _attach(args, profiles)


def _map_refusal(session) -> str | None:
    """Why the target's llmobs map was not used to tag events (None: it was, or there is none)."""
    from llmobs.bpf.session import context_cell_refusal

    if session.cell_address:
        return None
    try:
        return context_cell_refusal(session.pid, session.procfs.maps(session.pid))
    except OSError:
        return None  # the target is gone: the loop notices


def _print_ebpf(args: argparse.Namespace, profiles: tuple[str, ...]) -> int:
    from llmobs.bpf.profiles import probes_of
    from llmobs.bpf.program import assemble
    from llmobs.bpf.session import AttachSession, Options

    probes = probes_of(profiles)
    if args.pid is not None:  # what this process would get: only the probes that resolve
        session = AttachSession(args.pid, Options(profiles=profiles))
        probes = session.plan(session.check_target())
        for skipped in session.skipped:
            print(f"/* skipped {skipped.probe.name}: {skipped.reason} */")
    print(assemble(probes))
    return 0


def _attach(args: argparse.Namespace, profiles: tuple[str, ...]) -> int:
    from llmobs.bpf.session import AttachSession, Options

    try:
        import bcc  # noqa: F401
    except ImportError as exc:
        raise MissingLibrary(f"bcc (python3-bpfcc) is not importable: {exc}") from exc
    from llmobs.bpf import report
    from llmobs.bpf.output import ParquetEventWriter, aggregates_table, companion_paths, write_summary

    options = Options(
        profiles=profiles,
        sample_n=args.sample,
        sample_mode=args.sample_mode,
        ioctl_paths=args.ioctl_paths,
        gemm_durations=args.gemm_durations,
        calibrate=args.budget > 0,
    )
    session = AttachSession(args.pid, options)
    stop = {"reason": None}

    def on_signal(signum, _frame):
        stop["reason"] = signal.Signals(signum).name

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    writer = pipeline = exporter = governor = telemetry = None
    otlp = _otlp_config(args)  # validated before attaching: a bad endpoint fails fast, with no probe left
    try:
        session.start()
        refused = _map_refusal(session)
        if refused:  # said once: the map's token steps are refused later with the same reason
            session.notes.append(f"the llmobs map does not tag events (they stay untracked): {refused}")
        report.attached(session)
        governor, telemetry = _start_governor(args, session)
        _remove_stale_maps()  # once attached: a refused attach prints its one error line and nothing else
        if args.db is not None or otlp is not None:
            pipeline = _open_pipeline(args, session)
        if otlp is not None:
            from llmobs.otlp import start_exporter

            exporter = start_exporter(pipeline.store, otlp)
            telemetry.track_exporter(exporter)
        if pipeline:
            telemetry.track_pipeline(pipeline)
        if args.out:
            writer = ParquetEventWriter(companion_paths(args.out)[0], args.sample)
        status = report.StatusLine(session, args.status_interval)
        deadline = time.monotonic() + args.duration if args.duration else None
        next_tick = time.monotonic() + GOVERNOR_TICK_S
        while stop["reason"] is None:
            events = session.poll()
            if writer:
                writer.submit(events)
            if pipeline:
                pipeline.poll(events)
            status.add(events)
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + GOVERNOR_TICK_S
                _govern(session, governor, telemetry, pipeline, exporter)
            if not session.target_alive():
                stop["reason"] = "target exited"
            elif deadline and time.monotonic() >= deadline:
                stop["reason"] = "duration reached"
            else:
                status.maybe_print()
                time.sleep(DRAIN_PERIOD_S[len(events) < session.ring_records // 100])
    finally:
        events, final = session.close()
        if writer:
            writer.submit(events)
            writer.close()
            session.stats.user_drops += writer.dropped
            final["counters"]["user_drops"] = session.stats.user_drops
        if pipeline:
            stored = pipeline.close(events, final, before_store_close=exporter.finish if exporter else None)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    status.finish()
    summary = report.summary(session, final, stop["reason"] or "stopped", status)
    if governor is not None:
        summary["governor"] = governor.snapshot()
        _print_governor(governor, session, sys.stderr)
    if telemetry is not None:
        summary["agent"] = telemetry.sample()
    report.print_summary(summary, sys.stderr)
    if pipeline:
        stored.print(sys.stderr)
    if exporter:
        c = exporter.counters
        print(
            f"otlp {otlp.resolved_endpoint()} ({otlp.protocol}): {c.spans_sent:,} spans sent, "
            f"{c.attempts_failed} failed attempts, {c.spans_dropped} dropped, metrics sent {c.metrics_sent}"
            + (f"; last error: {c.last_error}" if c.last_error else ""),
            file=sys.stderr,
        )
    if args.out:
        _events_path, aggregates_path, summary_path = companion_paths(args.out)
        import pyarrow.parquet as pq

        pq.write_table(aggregates_table(final["totals"]), aggregates_path)
        write_summary(summary_path, summary)
    return 0


def _start_governor(args: argparse.Namespace, session):
    """The overhead governor (unless --budget 0) and the agent's self-telemetry, tracking `session`."""
    from llmobs.governor import Governor, SelfTelemetry
    from llmobs.governor.calibrate import class_costs, describe

    governor = None
    if args.budget > 0:
        for line in describe(session.calibration, class_costs()):
            print(line, file=sys.stderr)
        scale = {} if args.cost_scale is None else {"cost_scale": args.cost_scale}
        governor = Governor(
            args.budget / 100.0, log=lambda line: print(line, file=sys.stderr, flush=True), **scale
        )
        governor.track(session)
    telemetry = SelfTelemetry(governor)
    telemetry.track_session(session)
    return governor, telemetry


def _govern(session, governor, telemetry, pipeline, exporter) -> None:
    """One governor tick and one self-telemetry sample, handed to `top` (snapshot) and OTLP (metrics)."""
    from llmobs.governor.telemetry import agent_metrics, top_fields

    try:
        if governor is not None:
            governor.tick()
        sample = telemetry.sample()
        if pipeline is not None:
            state = governor.target_state(session.pid) if governor is not None else None
            pipeline.live.agent = top_fields(sample, state)
        if exporter is not None:
            exporter.metrics.set_agent_metrics(agent_metrics(sample))
    except Exception as exc:  # the agent's own bookkeeping must never stop the data path
        note = f"governor/telemetry: {exc}"
        if note not in session.notes:
            session.notes.append(note)
            print(f"warning: {note}", file=sys.stderr)


def _print_governor(governor, session, stream) -> None:
    """What the governor did, when (seconds after attach), and its estimate at the end."""
    state = governor.target_state(session.pid) or {}
    mean = state.get("mean_estimate")
    decisions = [d for d in governor.decisions if d.pid == session.pid]
    print(
        f"governor (budget {governor.budget:.2%}): {len(decisions)} decision(s); estimated slowdown at "
        f"detach {state.get('estimate', 0.0):.2%}"
        + (f", mean {mean:.2%}" if mean is not None else "")
        + (f"; shed at detach: {', '.join(state['shed'])}" if state.get("shed") else ""),
        file=stream,
    )
    for d in decisions:
        after = d.at_s - session.stats.started_at
        print(
            f"  {d.wall} (+{after:.1f} s) {d.action} {d.probe}: {d.before:.2%} -> {d.after:.2%} ({d.reason})",
            file=stream,
        )


def _remove_stale_maps() -> None:
    """Housekeeping: a workload killed with SIGKILL cannot remove its map, and each one holds tmpfs
    memory (megabytes) until someone does; the agent is that someone."""
    from llmobs.shm.reader import remove_stale_maps

    try:
        removed = remove_stale_maps()
    except OSError:  # no /dev/shm, or not ours to list: nothing to tidy, nothing to report
        return
    if removed:
        print(f"removed {len(removed)} stale map(s) left by dead processes in /dev/shm", file=sys.stderr)


def _otlp_config(args: argparse.Namespace):
    """The OTLP settings when --otlp is given (flags > OTEL_EXPORTER_OTLP_* > defaults), else None."""
    if not args.otlp:
        return None
    from llmobs.otlp import resolve

    config = resolve({"endpoint": args.otlp, "protocol": args.otlp_protocol})
    if config.protocol == "grpc":
        config.grpc_target()  # raises the one-line config error now, not from the export thread
    return config


def _open_pipeline(args: argparse.Namespace, session):
    """The store sink for --db (PATH, or the default store when --db has no value)."""
    from llmobs.pipeline import Pipeline
    from llmobs.store import default_db_path

    return Pipeline.open(
        args.db or default_db_path(), args.pid, session=session, sample_ratio=args.sample,
        detector=args.detector_config,
    )  # fmt: skip
