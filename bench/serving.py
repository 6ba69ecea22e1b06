"""Tokens/s of the serving workload over real HTTP: no llmobs vs the publisher vs the publisher + `attach`.

    .venv/bin/python -m bench.serving [--rounds 4] [--clients 4] [--requests 2] [--tokens 32] [--json PATH]

Three servers (`python -m llmobs.workloads.serve`, SmolLM2 by default, continuous batching on the CPU) are
started once and held, idle between their turns: `--no-instrument` (no llmobs at all), instrumented (the
publisher only), and instrumented with `llmobs-agent attach --pid P --db` (default profile, as root; it
attaches before the arm's round and detaches after it, outside the timed part). Each round runs every arm
once, interleaved (bench/harness.py: A B C | C B A ...): --clients concurrent openai clients of two tenants
(llmobs.workloads.clients), each sending --requests streamed chat completions of --tokens tokens.

Figures per round: tokens/s (completion tokens over the clients' wall time), the server's CPU per token
(utime + stime from /proc: steadier than wall time on a shared machine), the clients' TTFT p50, the token
steps the publisher wrote into the map during the round (its steps_head, read with llmobs.shm.reader: a 0
says the engine's steps are not published), and for the attach arm the agent's CPU seconds. Ratios are to
the no-llmobs arm, with 95% intervals.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from llmobs.workloads import clients

from bench.harness import Arm, Report, add_json_option
from bench.held_server import HeldServer
from bench.procstat import cpu_seconds

NONE, PUBLISHER, ATTACH = "no llmobs", "publisher", "publisher + attach"
TENANTS = ("tenant-a", "tenant-b")


class Agent:
    """`llmobs-agent attach --pid P ...` for one round; its stderr drained by a thread (a full pipe would
    stall the agent and flatter its cost), "attached in" awaited with a bound."""

    def __init__(self, pid: int, db: str, extra: list[str]):
        argv = [sys.executable, "-m", "llmobs.cli", "attach", "--pid", str(pid), "--db", db, *extra]
        self.db = db
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)  # fmt: skip
        self.attached = threading.Event()
        self.log: list[bytes] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            if b"attached in" in line:
                self.attached.set()
        self.attached.set()  # it exited: wake the waiter, which checks

    def wait_attached(self, timeout: float = 180.0) -> None:
        if not self.attached.wait(timeout) or self.proc.poll() is not None:
            tail = b"".join(self.log[-30:]).decode(errors="replace")
            raise RuntimeError(f"the agent did not attach (exit {self.proc.poll()}): {tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def steps_head(server: HeldServer) -> int | None:
    """Token steps the server's publisher has written into its map so far (None without a map)."""
    if not server.ready.get("map"):
        return None
    from llmobs.shm.reader import ShmReader

    with ShmReader(server.pid) as reader:
        return int(reader.refresh()["steps_head"])


def serving_arm(name: str, server: HeldServer, args, attach: bool, store_dir: str) -> Arm:
    def once(ctx) -> dict[str, float]:
        agent = None
        if attach:
            agent = Agent(server.pid, os.path.join(store_dir, f"attach-{ctx.index}.duckdb"), args.attach_args)
            agent.wait_attached()
        try:
            steps0, server_cpu0 = steps_head(server), cpu_seconds(server.pid)
            agent_cpu0 = cpu_seconds(agent.proc.pid) if agent else 0.0
            with ctx.timed():
                records, wall = clients.run_clients(
                    server.base_url, threads=args.clients, tenants=TENANTS, requests=args.requests,
                    max_tokens=args.tokens, stream=True, model=server.model,
                )  # fmt: skip
            server_cpu = cpu_seconds(server.pid) - server_cpu0
            agent_cpu = cpu_seconds(agent.proc.pid) - agent_cpu0 if agent else None
            steps1 = steps_head(server)
        finally:
            if agent is not None:
                agent.stop()
                if args.keep_store:  # the agent's detach summary (events by probe, CPU by stage) beside it
                    with open(agent.db + ".log", "wb") as log:
                        log.write(b"".join(agent.log))
        failed = [r["error"] for r in records if r["error"]]
        if failed:
            raise RuntimeError(f"{name}: {len(failed)} request(s) failed, e.g. {failed[0]}")
        tokens = sum(r["completion_tokens"] or 0 for r in records)
        figures = {"tokens/s": tokens / wall, "server CPU ms/token": 1000.0 * server_cpu / max(tokens, 1),
                   "TTFT p50 s": clients.percentile([r["ttft_s"] for r in records], 50) or 0.0}  # fmt: skip
        if steps0 is not None:
            figures["steps published"] = steps1 - steps0
            figures["steps/token"] = (steps1 - steps0) / max(tokens, 1)
        if agent_cpu is not None:
            figures["agent CPU s"] = agent_cpu
        return figures

    return Arm(name, once)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1, help="unrecorded rounds first (every arm once each)")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (two tenants)")
    p.add_argument("--requests", type=int, default=2, help="requests per client per round")
    p.add_argument("--tokens", type=int, default=32, help="max_tokens of every request")
    p.add_argument("--threads", type=int, default=0, help="torch threads of each server (0 = torch default)")
    p.add_argument("--no-attach", action="store_true", help="leave out the attach arm (it needs root)")
    p.add_argument("--attach-args", default="", help="extra `attach` arguments, e.g. '--profile cpu'")
    p.add_argument("--keep-store", metavar="DIR", default=None,
                   help="keep the attach arm's stores (and each agent's stderr, .log) in DIR")  # fmt: skip
    add_json_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.attach_args = args.attach_args.split()
    if not args.no_attach and os.geteuid() != 0:
        print("error: the attach arm attaches eBPF probes, which needs root", file=sys.stderr)
        print("hint: sudo .venv/bin/python -m bench.serving, or --no-attach for the publisher alone",
              file=sys.stderr)  # fmt: skip
        return 2
    report = Report("serving", args)
    common = ["--model", args.model, "--threads", str(args.threads)]
    store_dir = args.keep_store or tempfile.mkdtemp(prefix="llmobs-bench-serving.")
    if args.keep_store:
        os.makedirs(store_dir, exist_ok=True)
    try:
        with contextlib.ExitStack() as held:
            servers = [(NONE, held.enter_context(HeldServer(*common, "--no-instrument")), False),
                       (PUBLISHER, held.enter_context(HeldServer(*common)), False)]  # fmt: skip
            if not args.no_attach:
                servers.append((ATTACH, held.enter_context(HeldServer(*common)), True))
            for _, server, _ in servers:  # the engine is made on a server's first request
                clients.run_clients(server.base_url, threads=1, requests=1, max_tokens=2, model=server.model)
            report.note(f"servers ({args.model}, continuous batching, CPU): "
                        + ", ".join(f"{n} pid {s.pid}" for n, s, _ in servers))  # fmt: skip
            arms = [serving_arm(n, s, args, a, store_dir) for n, s, a in servers]
            report.compare(
                f"{args.clients} clients x {args.requests} requests x {args.tokens} tokens, streamed",
                arms, args.rounds, baseline=NONE, warmup=args.warmup,
                better={"tokens/s": "higher", "server CPU ms/token": "lower", "TTFT p50 s": "lower"},
            )  # fmt: skip
    finally:
        if not args.keep_store:
            shutil.rmtree(store_dir, ignore_errors=True)
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
