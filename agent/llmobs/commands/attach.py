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
import threading
import time

from llmobs.errors import MissingLibrary, UsageError
from llmobs.settings import (
    BY_KEY,
    add_detector_arguments,
    add_flags,
    detector_config,
    flag,
    flag_values,
    parse_value,
    replay_flags,
    replay_options,
)
from llmobs.shm.presence import ReaderPresence

HINT = "see `llmobs-agent attach --help`"

# The settings attach shares with `run` (llmobs.settings): the same parsers, and the same units.
PROFILE = flag(
    "probes.profiles",
    help="comma-separated probe profiles: cpu (linear layers), gemm (every BLAS sgemm_, opt-in), "
    "mem (alloc_cpu/free_cpu, opt-in: costly), host (off-CPU, page faults, /dev/nvidia* ioctls), "
    "cuda (libcuda/libcudart/libnccl). Default: cpu,host",
)
SAMPLE = flag("probes.sample_n", help="export 1 in N events (default 1: all)")
SAMPLE_MODE = flag(
    "probes.sample_mode",
    help="trace: keep a request whole or not at all (hash of the trace id); cpu: per-CPU counter hash "
    "(default trace)",
)
THIN = flag(
    "probes.thin",
    help="linear and page_fault_user ship 1 in N of a step's events; their per-step counts stay exact "
    "(default 64; 1: every event)",
)
IOCTL_PATHS = flag(
    "probes.ioctl_paths",
    option="--ioctl-paths",
    help="device files whose ioctls the host profile times (default /dev/nvidia*)",
)
OVERHEAD_BUDGET = flag(
    "overhead.budget",
    help="overhead budget: the estimated slowdown of the workload the probes may cause, a fraction "
    "(default 0.01, i.e. 1%); above it the costliest uprobes are detached and re-attached when load "
    "drops. 0 = governor off (see docs/governor.md)",
)
COST_SCALE = flag(
    "overhead.cost_scale",
    help="the prior of the factor over the calibrated per-hit probe costs (default 2.3, measured here: a "
    "hit inside a workload costs more than in the calibration's loop); the governor starts at X and "
    "learns the factor from its own sheds and restores (docs/governor.md)",
)
CPU_PRIORITY = flag(
    "overhead.cpu_priority",
    help="idle (default): once attached, the agent's threads run under SCHED_IDLE, only on CPU the "
    "workload leaves (if it leaves none, the agent falls behind and its losses are counted); normal: "
    "the priority it was started with (docs/governor.md)",
)
SETTING_FLAGS = (PROFILE, SAMPLE, SAMPLE_MODE, THIN, IOCTL_PATHS, OVERHEAD_BUDGET, COST_SCALE, CPU_PRIORITY)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pid", type=int, help="the PyTorch process to attach to")
    add_flags(parser, (PROFILE, SAMPLE, SAMPLE_MODE, THIN))
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
    add_flags(parser, (IOCTL_PATHS, OVERHEAD_BUDGET))
    parser.add_argument(
        "--budget", metavar="PCT", help="deprecated: the overhead budget in percent; use --overhead-budget"
    )
    add_flags(parser, (COST_SCALE, CPU_PRIORITY))
    add_detector_arguments(parser)
    add_flags(parser, replay_flags())
    # unset: 1 s on a TTY, 10 s otherwise (report.StatusLine)
    parser.add_argument("--status-interval", type=float, metavar="S", help=argparse.SUPPRESS)
    # the exporter's rollup_wait_s (docs/otlp.md; unset: its default, 20 s), which has no flag or variable:
    # a test that is not about the spans' rollup attributes sends each step once settled with 0
    parser.add_argument("--otlp-rollup-wait", type=float, metavar="S", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    profiles = _validate(args)
    if args.ebpf:
        return _print_ebpf(args, profiles)
    if args.pid is None:
        raise UsageError(
            "--pid is required", hint="name the process: `llmobs-agent attach --pid PID` (`pgrep -a python`)"
        )
    return _attach(args, profiles)


def _validate(args: argparse.Namespace) -> tuple[str, ...]:
    """attach's settings parsed by the settings table's parsers (one vocabulary and one unit with `run`),
    written back into the `args` fields the attach loop reads; returns the probe profiles."""
    values = flag_values(args, SETTING_FLAGS, hint=HINT)
    budget = _overhead_budget(args, values["overhead.budget"])
    args.profile = ",".join(values["probes.profiles"])
    args.sample = values["probes.sample_n"]
    args.sample_mode = values["probes.sample_mode"]
    args.thin = values["probes.thin"]
    args.ioctl_paths = values["probes.ioctl_paths"]
    args.cost_scale = values["overhead.cost_scale"]
    args.cpu_priority = values["overhead.cpu_priority"]
    args.overhead_budget = budget  # a fraction, as overhead.budget
    try:
        args.detector_config = detector_config(args)
    except ValueError as exc:
        raise UsageError(str(exc), hint=HINT) from None
    args.replay = replay_options(flag_values(args, replay_flags(), hint=HINT))
    if args.replay is not None and ((args.db is None and not args.otlp) or args.detector_config is None):
        raise UsageError(
            "--replay-on-anomaly replays flagged tokens into the store: it needs --db and the detectors on",
            hint="add --db [PATH] (and leave --detector on)",
        )
    return values["probes.profiles"]


def _overhead_budget(args: argparse.Namespace, fraction: float) -> float:
    """--overhead-budget F (parsed already), or the deprecated --budget PCT converted to a fraction."""
    if args.budget is None:
        return fraction
    if args.overhead_budget is not None:
        raise UsageError(
            "--budget and --overhead-budget both given", hint="give only --overhead-budget F (0.01 is 1%)"
        )
    try:
        raw = float(args.budget) / 100.0
    except ValueError:
        raw = args.budget  # not a number: the setting's parser says so
    hint = "--budget is deprecated: use --overhead-budget F, a fraction (0.01 is 1%)"
    fraction = parse_value(BY_KEY["overhead.budget"], raw, f"flag --budget {args.budget}", hint)
    warning = f"warning: --budget is deprecated; use --overhead-budget {fraction:g} (a fraction)"
    print(warning, file=sys.stderr)
    return fraction


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
    import importlib.util

    from llmobs.bpf.session import AttachSession, Options

    # found, not imported: bcc compiles in a child process (llmobs.bpf.compile); libbcc never loads here
    if importlib.util.find_spec("bcc") is None:
        raise MissingLibrary("bcc (python3-bpfcc) is not importable: no module named 'bcc'")
    from llmobs.bpf import report
    from llmobs.bpf.output import ParquetEventWriter, aggregates_table, companion_paths, write_summary
    from llmobs.runtime import Agent, Task

    budget = args.overhead_budget
    options = Options(
        profiles=profiles,
        sample_n=args.sample,
        sample_mode=args.sample_mode,
        thin=args.thin,
        ioctl_paths=args.ioctl_paths,
        gemm_durations=args.gemm_durations,
        calibrate=budget > 0,
    )
    session = AttachSession(args.pid, options)
    stop = {"reason": None}
    detached = []

    def on_signal(signum, _frame):
        stop["reason"] = signal.Signals(signum).name

    def on_detach(gone) -> None:  # the target exited: the runtime detached it, attach is done
        detached.append(gone)
        stop["reason"] = stop["reason"] or "target exited"

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    otlp = _otlp_config(args)  # validated before attaching: a bad endpoint fails fast, with no probe left
    agent = store = status = presence = opening = None
    try:
        if args.db is not None or otlp is not None:  # before attaching: a target that exits at once
            presence = ReaderPresence.announce()  # leaves its unread steps for us (llmobs.shm.presence)
            opening = _StoreOpening(args.db)
        session.start()
        refused = _map_refusal(session)
        if refused:  # said once: the map's token steps are refused later with the same reason
            session.notes.append(f"the llmobs map does not tag events (they stay untracked): {refused}")
        report.attached(session)
        if budget > 0:
            _print_calibration(session)
        pipeline = exporter = None
        if opening is not None:
            store, opening = opening.result(), None
            pipeline = _open_pipeline(args, session, store)
        if otlp is not None:
            from llmobs.otlp import start_exporter

            exporter = start_exporter(store, otlp)
        status = report.StatusLine(session, args.status_interval)
        sinks = [status]
        if args.out:
            sinks.append(ParquetEventWriter(companion_paths(args.out)[0], args.sample, thin=args.thin))
        agent = Agent(
            store=store, owns_store=True, exporter=exporter, budget=budget, cost_scale=args.cost_scale,
            log=lambda line: print(line, file=sys.stderr, flush=True), on_detach=on_detach,
            presence=presence, cpu_priority=args.cpu_priority,
        )  # fmt: skip
        store = presence = None  # the agent closes them now
        agent.add(session, pipeline, sinks=sinks)
        _say_swept(agent.sweep_maps().removed)  # once attached: a refused attach prints only its error line
        tasks = [Task(0.0, lambda _now: status.maybe_print())]
        if args.duration:
            deadline = time.monotonic() + args.duration
            tasks.append(Task(0.0, lambda now: now >= deadline and stop.update(reason="duration reached")))
        agent.run(lambda: stop["reason"], tasks)
    finally:
        if agent is not None:
            agent.close(stop["reason"] or "stopped")
        else:  # a failure before the runtime took the session: nothing may stay attached or open
            session.close()
            if opening is not None:
                opening.discard()
            if store is not None:
                store.shutdown()
            if presence is not None:
                presence.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    gone = detached[0]
    final = gone.final
    status.finish()
    summary = report.summary(session, final, stop["reason"] or "stopped", status)
    if agent.governor is not None:
        summary["governor"] = agent.governor.snapshot()
        if gone.governor_state is not None:  # untracked at detach: its state as it was then
            summary["governor"]["targets"][str(session.pid)] = gone.governor_state
        _print_governor(agent.governor, session, gone.governor_state, sys.stderr)
    if agent.telemetry is not None:
        summary["agent"] = agent.telemetry.sample()
    report.print_summary(summary, sys.stderr)
    if gone.summary is not None:
        gone.summary.store_error = gone.summary.store_error or agent.store_error
        gone.summary.print(sys.stderr)
    if agent.stage_cpu is not None:
        from llmobs.stagecpu import per_step_table

        _print_degrades(agent.stage_cpu["counts"], sys.stderr)

        for line in per_step_table(agent.stage_cpu, agent.stage_cpu["counts"].get("token_steps", 0)):
            print(line, file=sys.stderr)
    if agent.exporter is not None:
        c = agent.exporter.counters
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


def _print_calibration(session) -> None:
    """The probes' measured per-hit costs, which the governor weighs hit rates with."""
    from llmobs.bpf.calibrate import class_costs, describe

    for line in describe(session.calibration, class_costs()):
        print(line, file=sys.stderr)


def _print_governor(governor, session, state: dict | None, stream) -> None:
    """What the governor did, when (seconds after attach), and its estimate at the end (`state`: the
    target's state as the runtime read it just before the governor forgot the target)."""
    state = state or governor.target_state(session.pid) or {}
    mean, stall = state.get("mean_estimate"), state.get("stall_cores", 1.0)
    decisions = [d for d in governor.decisions if d.pid == session.pid]
    print(
        f"governor (budget {governor.budget:.2%}): {len(decisions)} decision(s); estimated slowdown at "
        f"detach {state.get('estimate', 0.0):.2%}"
        + (f", mean {mean:.2%}" if mean is not None else "")
        + (f"; each hit stalls {stall:.1f} busy cores" if stall > 1.05 else "")
        + (f"; shed at detach: {', '.join(state['shed'])}" if state.get("shed") else ""),
        file=stream,
    )
    for d in decisions:
        after = d.at_s - session.stats.started_at
        print(
            f"  {d.wall} (+{after:.1f} s) {d.action} {d.probe}: {d.before:.2%} -> {d.after:.2%} ({d.reason})",
            file=stream,
        )


def _print_degrades(counts: dict, stream) -> None:
    """Where the agent did less, visibly, to keep its own cost down (issue 14): one line when any."""
    parts = []
    if counts.get("correlate_stretched"):
        parts.append(
            f"correlate runs put off {counts['correlate_stretched']:,} time(s) (their CPU above its share)"
        )
    if counts.get("correlate_put_off"):
        parts.append(
            f"correlate runs put off {counts['correlate_put_off']:,} more time(s) (no one awaited rollups)"
        )
    if counts.get("map_reads_deferred"):
        parts.append(
            f"map reads deferred {counts['map_reads_deferred']:,} time(s) (held to the next map period)"
        )
    if counts.get("hand_offs_deferred"):
        parts.append(
            f"token steps held for the store {counts['hand_offs_deferred']:,} time(s) (handed on within a"
            " second, scored at once)"
        )
    if parts:
        print("degraded to save CPU: " + "; ".join(parts), file=stream)
    if counts.get("store_headroom_retries"):
        later = counts.get("store_cap_restores_deferred", 0)
        print(
            f"store: {counts['store_headroom_retries']:,} statement(s) ran out of the DuckDB memory cap and"
            " were run again with more (store/sink.py HEADROOM_MEMORY_LIMIT)"
            + (f"; the cap was put back later {later:,} time(s) (memory still in use)" if later else ""),
            file=stream,
        )
    if counts.get("store_reopened_invalidated"):
        print(
            f"store: DuckDB invalidated the database {counts['store_reopened_invalidated']:,} time(s) (a"
            " checkpoint ran out of its memory cap); reopened, the failed statement run again",
            file=stream,
        )


def _say_swept(removed: int) -> None:
    """Housekeeping: a workload killed with SIGKILL cannot remove its map; each holds tmpfs memory
    (megabytes) until someone removes it: the agent. (attach observes one pid: other processes' maps
    are removed unread; the daemon stores what its selectors would have observed.)"""
    if removed:
        print(f"removed {removed} stale map(s) left by dead processes in /dev/shm", file=sys.stderr)


def _otlp_config(args: argparse.Namespace):
    """The OTLP settings when --otlp is given (flags > OTEL_EXPORTER_OTLP_* > defaults), else None."""
    if not args.otlp:
        return None
    from llmobs.otlp import resolve

    config = resolve(
        {"endpoint": args.otlp, "protocol": args.otlp_protocol, "rollup_wait_s": args.otlp_rollup_wait}
    )
    if config.protocol == "grpc":
        config.grpc_target()  # raises the one-line config error now, not from the export thread
    return config


class _StoreOpening:
    """The store for --db (PATH, or the default store when --db has no value), its DuckDB memory capped,
    opened in a thread while the probes load and attach: importing the pipeline (DuckDB, pyarrow: ~0.25 s
    of CPU) and opening the file took 0.4-0.6 s on a loaded host, after the probes and before the first
    drain; the probe load is mostly the kernel's verifier and map allocation (ctypes drops the GIL), so
    the two overlap. result() re-raises the opening's error in the caller's thread."""

    def __init__(self, db: str | None):
        self._db = db
        self._store = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._open, name="llmobs-store-open", daemon=True)
        self._thread.start()

    def _open(self) -> None:
        try:
            import llmobs.pipeline  # noqa: F401  (imported here, off the path to the first event)
            from llmobs.store.sink import agent_store

            self._store = agent_store(self._db)
        except BaseException as exc:  # a StoreError, a bug: raised again by result()
            self._error = exc

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._store

    def discard(self) -> None:
        """Waits for the opening and closes what it opened (the attach failed)."""
        self._thread.join()
        if self._store is not None:
            self._store.shutdown()


def _open_pipeline(args: argparse.Namespace, session, store):
    """The target's pipeline into `store` (which the caller closes if this raises)."""
    from llmobs.pipeline import Pipeline

    return Pipeline(store, args.pid, session=session, sample_ratio=args.sample, thin=args.thin,
                    detector=args.detector_config, replay=args.replay)  # fmt: skip
