"""One round of one figure of bench/runtime.py or bench/footprint.py, run against the source tree under test.

    PYTHONPATH=<tree>/agent:<repo root> python bench/runtime_arm.py FIGURE '<json options>'

bench/runtime.py starts this with the tree's `agent/` ahead of everything on PYTHONPATH, so `import
llmobs` here, and in every process started from here (the workload, `python -m llmobs.cli attach`),
is that tree's package and not the venv's editable install; the last stdout line is a JSON object
with the figure and `llmobs` (the file imported), which runtime.py checks against the tree.

Only interfaces both layouts have are used: the CLI, scripts/workload.py, DuckDBStore, StoreWriter,
EventDecoder, the synthetic generators, OtlpExporter; a module that moved (correlate) is imported
from its new place first, then its old one.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llmobs

from bench.procstat import RssSampler, cpu_seconds
from bench.ready_child import ReadyChild, read_line

FIRST_EVENT = re.compile(r"first event ([\d.]+) s after the agent started")


def ingest(opts: dict) -> dict:
    """Synthetic ring records through the agent's StoreWriter into a fresh DuckDB file: events/s from
    the first submit until everything is committed (queue large enough that nothing drops)."""
    from llmobs.store import DuckDBStore
    from llmobs.store.ingest import EventDecoder
    from llmobs.store.writer import StoreWriter

    from bench.ingest import PROBE_NAMES, drain, ring_bytes

    count = max(opts["events"] // opts["drain_events"], 1)
    drains = [drain(ring_bytes(opts["drain_events"], seed=i)) for i in range(count)]
    with tempfile.TemporaryDirectory(prefix="llmobs-rt-ingest-") as tmp:
        store = DuckDBStore(Path(tmp) / "ingest.duckdb", threads=1)
        writer = StoreWriter(store, EventDecoder(PROBE_NAMES), queue_items=count + 1)
        began, cpu0 = time.perf_counter(), time.process_time()
        for events in drains:
            writer.submit(events)
        if not writer.flush(timeout=600):
            raise SystemExit("error: the store writer did not flush")
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu0
        writer.close()
        stored = sum(store.count(t) for t in ("mem_events", "gpu_ops", "host_events"))
        store.close()
    if stored != count * opts["drain_events"] or writer.counters.dropped_rows:
        raise SystemExit(f"error: stored {stored} of {count * opts['drain_events']} events")
    return {"events/s": stored / wall, "events/CPU-s": stored / cpu}


def _correlate():
    try:
        from llmobs.pipeline import correlate
    except ImportError:  # the layout before the refactor
        from llmobs import correlate
    return correlate


def otlp(opts: dict) -> dict:
    """A store of synthetic token steps (with events, correlated) exported by OtlpExporter over gRPC to
    the rotel collector runtime.py runs on loopback: spans/s of the export alone. With opts["store"] =
    "agent" the export reads the store as a running agent opens it (`attach --otlp`, `run`: one DuckDB
    thread, its memory cap; llmobs.store.sink.agent_store where the tree has it), else as `llmobs-agent
    otlp --db` does (DuckDB's defaults)."""
    from llmobs import clock
    from llmobs.otlp.config import resolve
    from llmobs.otlp.delivery import OtlpExporter
    from llmobs.store import DuckDBStore, synthetic

    with tempfile.TemporaryDirectory(prefix="llmobs-rt-otlp-") as tmp:
        path = Path(tmp) / "otlp.duckdb"
        store = DuckDBStore(path)
        steps = synthetic.token_steps(
            4242, max(opts["steps"] // 100, 1), 100, batch_rows=4,
            start_ns=max(clock.monotonic_ns() - 300_000_000_000, 1_000_000_000),
        )  # fmt: skip
        store.append({"token_steps": steps, "events": synthetic.events_for_steps(steps)})
        _correlate().correlate(store.connection)
        if opts.get("store") == "agent":
            from llmobs.store import sink

            store.close()
            store = sink.agent_store(path) if hasattr(sink, "agent_store") else DuckDBStore(path)
        # the tree's own default batch (512 before session 10, 2,048 since): each arm as it ships
        config = resolve({"endpoint": opts["endpoint"], "protocol": "grpc"}, env={})
        exporter = OtlpExporter(store.connection.cursor(), config, None)
        began, cpu0 = time.perf_counter(), time.process_time()
        counters = exporter.run(give_up_after_s=60)
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu0
        exporter.shutdown()
        store.close()
    if counters.spans_sent <= 0:
        raise SystemExit("error: no span was sent")
    return {"spans/s": counters.spans_sent / wall, "spans/CPU-s": counters.spans_sent / cpu,
            "CPU ms/1k spans": 1e6 * cpu / counters.spans_sent, "spans": counters.spans_sent}  # fmt: skip


class Workload(ReadyChild):
    """scripts/workload.py of this tree, loaded and waiting for "go" on stdin (its --ready-fd pipe says
    when it is ready); the last stdout line is its JSON summary (tokens_per_s)."""

    def __init__(self, tree: Path, *args: str):
        super().__init__([sys.executable, str(tree / "scripts" / "workload.py"), *args])

    def finish(self, timeout: float = 900) -> dict:
        out, _ = self.proc.communicate(timeout=timeout)
        return json.loads(out.decode().strip().splitlines()[-1])


def _attach(pid: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llmobs.cli", "attach", "--pid", str(pid), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip


def _wait_for(proc: subprocess.Popen, needle: bytes, timeout: float = 300) -> bytes:
    text, deadline = b"", time.monotonic() + timeout
    fd = proc.stderr.fileno()
    while needle not in text:
        readable, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        chunk = os.read(fd, 65536) if readable else b""
        if not chunk:
            raise SystemExit(f"error: attach printed no {needle!r}: {text.decode()[-2000:]}")
        text += chunk
    return text


def attach_latency(opts: dict) -> dict:
    """A tiny-model workload generating without end; `attach --pid P --db X --duration D` (default
    profiles; opts["db"] False: without --db) started on it: seconds from the attach process's start
    (interpreter start-up and imports included) to its first event, from its own summary line, and the
    most RSS the attach held over its run (sampled every 0.1 s)."""
    tree = Path(opts["tree"])
    workload = Workload(tree, "--model", "tiny", "--requests", "0", "--max-new-tokens", "8", "--threads", "1")
    try:
        workload.go()
        with tempfile.TemporaryDirectory(prefix="llmobs-rt-attach-") as tmp:
            store = ("--db", f"{tmp}/a.duckdb") if opts.get("db", True) else ()
            agent = _attach(workload.pid, *store, "--duration", str(opts["duration"]))
            with RssSampler(agent.pid) as rss:
                _, err = agent.communicate(timeout=300)
        if agent.returncode != 0:
            raise SystemExit(f"error: attach exited {agent.returncode}: {err.decode()[-2000:]}")
        match = FIRST_EVENT.search(err.decode())
        if not match:
            raise SystemExit(f"error: attach saw no event: {err.decode()[-2000:]}")
    finally:
        workload.close()
    return {"first event s": float(match.group(1)), "RSS max MB": max(rss.samples) / 2**20}


def tokens(opts: dict) -> dict:
    """SmolLM2 generating --requests x --tokens while `attach --pid P` (default flags; with opts["db"],
    `--db` a fresh store, as the issue measures the default `attach --db`) is attached: the workload's
    own tokens/s (from "go" to its last token). Peer arms (bench/footprint.py's peers figure):
    opts["mode"] "forward" (teacher-forced forward passes of opts["forward_tokens"]), opts["instrument"]
    False (no llmobs in the workload: the no-tool arm), opts["torch_profiler"] (the workload under
    torch.profiler) and opts["warmup"] (requests before the clock); with them, CPU per token: the
    workload's own, and the agent's over the same span."""
    if opts.get("db") and opts.get("agent", True):
        with tempfile.TemporaryDirectory(prefix="llmobs-rt-tokens-") as tmp:
            flags = (*opts.get("flags", ()), "--db", f"{tmp}/t.duckdb")
            return tokens({**opts, "db": False, "flags": flags})
    tree = Path(opts["tree"])
    args = ["--model", opts["model"], "--requests", str(opts["requests"]), "--max-new-tokens",
            str(opts["tokens"]), "--threads", str(opts.get("threads", 1))]  # fmt: skip
    if opts.get("mode", "generate") != "generate":  # flags a tree before the peers figure does not have
        args += ["--mode", opts["mode"], "--forward-tokens", str(opts["forward_tokens"])]
    args += ["--warmup", str(opts["warmup"])] if opts.get("warmup") else []
    args += ["--no-instrument"] if not opts.get("instrument", True) else []
    args += ["--torch-profiler"] if opts.get("torch_profiler") else []
    workload = Workload(tree, *args)
    agent, agent_cpu = None, None
    try:
        if opts.get("agent", True):  # False: the workload alone, the no-agent arm of a slowdown
            agent = _attach(workload.pid, *opts.get("flags", ()))
            _wait_for(agent, b"attached in")
        workload.go()
        if opts.get("warmup"):  # its "clock" line: the measured requests begin
            read_line(workload.ready_r, 900, who="the workload's warm-up")
        if agent is not None:
            agent_cpu = cpu_seconds(agent.pid)
        summary = workload.finish()
        if agent is not None:
            agent_cpu = cpu_seconds(agent.pid) - agent_cpu  # the span of the requests, not the detach
            agent.send_signal(signal.SIGINT)
            _, err = agent.communicate(timeout=300)
            if agent.returncode != 0:
                raise SystemExit(f"error: attach exited {agent.returncode}: {err.decode()[-2000:]}")
    finally:
        workload.close()
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait(timeout=30)
    figures = {"tokens/s": summary["tokens_per_s"]}
    if "cpu_s" in summary:
        figures["workload CPU ms/token"] = 1e3 * summary["cpu_s"] / summary["tokens"]
    if agent_cpu is not None:
        figures["agent CPU ms/token"] = 1e3 * agent_cpu / summary["tokens"]
    return figures


def resident(opts: dict) -> dict:
    """The agent's resident set on bench/soak.py's paced libc10 target: `attach --profile mem --db X
    --overhead-budget 0` (every event stored, nothing shed) sampled from /proc once a second, first while
    the target waits (idle: nothing to drain), then while it makes `rate` events/s for `seconds`.
    With opts["agent"] "run": the daemon (`run --profile mem --command <target> --overhead-budget 0`)
    with two such targets making rate / 2 events/s each (the issue's "run with two targets").
    Figures: RSS idle (the last idle sample), RSS at rate (the largest sample in the second half of the
    loaded phase, when DuckDB's buffers have filled), the anonymous and file parts of the idle one, and
    the agent's CPU as % of a core under load."""
    from bench.procstat import cpu_seconds, rss_bytes, rss_parts
    from bench.soak import build_target, libc10_path

    daemon = opts.get("agent") == "run"
    with tempfile.TemporaryDirectory(prefix="llmobs-rt-rss-") as tmp:
        binary = build_target(Path(tmp))
        count = 2 if daemon else 1
        pairs = opts["rate"] / 2 / count  # each alloc_cpu/free_cpu pair is two mem events
        targets = [
            subprocess.Popen(
                [str(binary), str(libc10_path()), str(pairs), str(opts["seconds"] + 60)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )  # fmt: skip
            for _ in range(count)
        ]
        agent = None
        try:
            for target in targets:
                assert target.stdout.readline().strip() == b"ready"
            if daemon:
                agent = _run(binary, tmp)
                for target in targets:
                    _wait_for(agent, f"attach pid {target.pid} ".encode())
            else:
                agent = _attach(
                    targets[0].pid, "--profile", "mem", "--db", f"{tmp}/r.duckdb", "--overhead-budget", "0"
                )
                _wait_for(agent, b"attached in")
            idle = []
            for _ in range(int(opts["idle_s"])):
                time.sleep(1.0)  # pacing the samples, not synchronising
                idle.append(rss_bytes(agent.pid))
            idle_parts = rss_parts(agent.pid)
            for target in targets:
                target.stdin.write(b"go\n")
                target.stdin.flush()
            loaded, cpu0, began = [], cpu_seconds(agent.pid), time.monotonic()
            loaded_parts = []
            for _ in range(int(opts["seconds"])):
                time.sleep(1.0)
                loaded.append(rss_bytes(agent.pid))
                loaded_parts.append(rss_parts(agent.pid))
            cpu_pct = 100 * (cpu_seconds(agent.pid) - cpu0) / (time.monotonic() - began)
            agent.send_signal(signal.SIGTERM if daemon else signal.SIGINT)  # run drains on SIGTERM
            _, err = agent.communicate(timeout=300)
            if agent.returncode != 0:
                raise SystemExit(f"error: {'run' if daemon else 'attach'} exited {agent.returncode}: "
                                 f"{err.decode()[-2000:]}")  # fmt: skip
        finally:
            for target in targets:
                target.kill()
                target.wait(timeout=30)
            if agent is not None and agent.poll() is None:
                agent.kill()
                agent.wait(timeout=30)
    mb = 1 / (1 << 20)
    half = len(loaded) // 2
    peak = half + max(range(len(loaded) - half), key=lambda i: loaded[half + i])  # the at-rate sample
    return {"RSS idle MB": idle[-1] * mb, "RSS at rate MB": loaded[peak] * mb,
            "RSS idle: anon MB": idle_parts["RssAnon"] * mb, "RSS idle: file MB": idle_parts["RssFile"] * mb,
            "RSS at rate: anon MB": loaded_parts[peak]["RssAnon"] * mb,
            "RSS at rate: file MB": loaded_parts[peak]["RssFile"] * mb, "agent CPU %": cpu_pct}  # fmt: skip


def _run(binary: Path, tmp: str) -> subprocess.Popen:
    """`llmobs-agent run` selecting the processes of `binary` (bench/soak.py's daemon command), its store
    and run dir in `tmp`, no other config (LLMOBS_CONFIG empty)."""
    argv = [sys.executable, "-m", "llmobs.cli", "run", "--db", f"{tmp}/r.duckdb", "--profile", "mem",
            "--command", re.escape(str(binary)), "--interval", "0.5", "--run-dir", f"{tmp}/run",
            "--overhead-budget", "0"]  # fmt: skip
    env = dict(os.environ, LLMOBS_CONFIG="")
    env.pop("NOTIFY_SOCKET", None)
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)


FIGURES = {"ingest": ingest, "otlp": otlp, "attach": attach_latency, "tokens": tokens, "rss": resident}


def main() -> int:
    figure, opts = sys.argv[1], json.loads(sys.argv[2])
    result = FIGURES[figure](opts)
    print(json.dumps({**result, "llmobs": llmobs.__file__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
