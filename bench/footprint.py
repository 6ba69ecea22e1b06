"""The footprint benchmark (issue 14): this tree against the previous release (main before the footprint
work, commit 6bfae97), side by side in one run, interleaved round by round, each ratio with its 95%
interval; with --until, rounds are added two at a time until every interval is at most that wide.

  rss       the agent's resident set on a paced libc10 target (bench/soak.py's), `attach --profile mem
            --db X --overhead-budget 0`: idle (the target waiting) and at --rate events/s, plus its CPU
  rss-run   the same for the daemon with two such targets (`run --profile mem --command <target>
            --overhead-budget 0`), each making half of --rate: the issue's "run with two targets"
  attach    seconds from `attach --pid P --db X` starting to its first event (tiny workload generating),
            and the most RSS it held in its 3 s
  attach-nostore  the same without --db (the status line and the summary only: no store, no pipeline)
  otlp      agent CPU ms per 1,000 spans exported over gRPC to a real rotel collector, and spans/s
            (the store read as a running agent opens it: one DuckDB thread, its memory cap)
  ingest    synthetic ring records decoded and stored in DuckDB: events/s and events per CPU-second
  slowdown  SmolLM2 tokens/s with no agent, with the previous release's `attach` and with this one's
            (default profile, `--db` a fresh store: the issue's "default attach --db"; --no-store
            attaches without one), at 1 and 2 torch threads: ratios to no agent
  peers     the issue's peer comparison, on this tree: SmolLM2 generating (greedy, --peer-tokens) and
            running teacher-forced forward passes (--forward-passes of 81 tokens), at 1 and 2 torch
            threads, with no tool (the workload without llmobs), under torch.profiler (CPU activities,
            its stop() after the clock), instrumented alone and under llmobs (instrumented + the
            default `attach --db`): tokens/s as ratios to no tool, and CPU ms per token of the workload
            and of the agent. The steady state: each arm first runs its work --peer-warmup times over
            outside the clock (4-8 s; the agent is attached through it, its governor's first decisions
            come ~3 s after attach). --peer-modes / --peer-threads narrow it; --peer-before TREE adds
            that tree's agent as "llmobs before"; --peer-no-store adds "llmobs, no store" (instrumented +
            `attach` without --db: the store's share of the agent's cost)

The per-hit probe cost (bench/probes.py --only cost), the governor's measured-vs-budget table
(bench/governor.py), the agent's CPU per token step by stage (bench/step_cost.py) and the 30-minute soak
(bench/soak.py --minutes 30 --rate 50000) are their own benchmarks: each is one configuration or needs
its own interleaving; docs/reliability.md and the closing note of issue 14 give their runs.

    .venv/bin/python -m bench.footprint [--only rss,rss-run,attach,attach-nostore,otlp,ingest,slowdown]
        [--rounds 4] [--until 0.02 --max-rounds 12] [--rate 10000] [--seconds 40] [--json PATH]

Needs root (attach). --baseline defaults to /tmp/llmobs-main, made with `git worktree add` when missing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import Report, add_json_option
from bench.runtime import REPO, arm, byte_compiled, ensure_baseline, otlp_collector, selected_figures

PREVIOUS_RELEASE = "6bfae97"  # the worktree made when none is there (the tree before issue 14)
DEFAULT_BASELINE = Path("/tmp/llmobs-main")
FIGURES = ("rss", "rss-run", "attach", "attach-nostore", "otlp", "ingest", "slowdown", "peers")
BETTER = {"RSS idle MB": "lower", "RSS at rate MB": "lower", "RSS idle: anon MB": "lower",
          "RSS idle: file MB": "lower", "RSS at rate: anon MB": "lower", "RSS at rate: file MB": "lower",
          "agent CPU %": "lower", "first event s": "lower", "RSS max MB": "lower",
          "CPU ms/1k spans": "lower", "spans/s": "higher", "events/s": "higher", "events/CPU-s": "higher",
          "tokens/s": "higher", "workload CPU ms/token": "lower", "agent CPU ms/token": "lower"}  # fmt: skip
SHOWN = {"rss": ["RSS idle MB", "RSS at rate MB", "RSS idle: anon MB", "RSS idle: file MB",
                 "RSS at rate: anon MB", "RSS at rate: file MB", "agent CPU %"],
         "rss-run": ["RSS idle MB", "RSS at rate MB", "RSS idle: anon MB", "RSS idle: file MB",
                     "RSS at rate: anon MB", "RSS at rate: file MB", "agent CPU %"],
         "attach": ["first event s", "RSS max MB"], "attach-nostore": ["first event s", "RSS max MB"],
         "otlp": ["CPU ms/1k spans", "spans/s"], "ingest": ["events/s", "events/CPU-s"],
         "slowdown": ["tokens/s"],
         "peers": ["tokens/s", "workload CPU ms/token", "agent CPU ms/token"]}  # fmt: skip
# The peers figure's arms (bench/runtime_arm.py tokens): the workload alone, not instrumented; the peer a
# user compares the agent with; the publisher alone (llmobs.instrument, no agent: its in-process share);
# the agent as a user runs it (llmobs.instrument + `attach --db`)
PEER_ARMS = {"no tool": {"instrument": False, "agent": False},
             "torch.profiler": {"instrument": False, "agent": False, "torch_profiler": True},
             "instrument only": {"agent": False},
             "llmobs": {"db": True}}  # fmt: skip
FORWARD_TOKENS = 81  # the teacher-forced forward


def tree_commit(tree: Path) -> str:
    """The short commit a worktree is at (what its arm measures), or "?" outside git."""
    done = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "?"


def peers(report: Report, args: argparse.Namespace, imported: dict, rounds: dict) -> None:
    """The peers figure: for each workload and thread count, no tool / torch.profiler / instrument only /
    llmobs (instrument + attach --db), interleaved."""
    for mode in _listed(args.peer_modes, ("generate", "forward"), "--peer-modes"):
        for threads in (int(n) for n in _listed(args.peer_threads, ("1", "2"), "--peer-threads")):
            if mode == "generate":
                work = {"requests": 1, "tokens": args.peer_tokens}
            else:
                work = {"requests": args.forward_passes, "tokens": 1, "forward_tokens": FORWARD_TOKENS}
            warmup = args.peer_warmup * work["requests"]
            base = {"model": "smollm2", "mode": mode, "threads": threads, "warmup": warmup, **work}
            arms = [arm(name, args.candidate, "tokens", {**base, **extra}, imported)
                    for name, extra in PEER_ARMS.items()]  # fmt: skip
            if args.peer_no_store:  # the same agent without the store: what --db adds
                arms.append(arm("llmobs, no store", args.candidate, "tokens", base, imported))
            if args.peer_before:  # the agent of another tree (the previous commit) beside this one's
                arms.append(arm("llmobs before", args.peer_before, "tokens", {**base, "db": True}, imported))
            title = f"peers, {mode}, {threads} thread(s)"
            report.compare(title, arms, baseline="no tool", better=BETTER, metrics=SHOWN["peers"], **rounds)


def _listed(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    """A comma-separated choice among `allowed`, in the order given; SystemExit names a bad one."""
    chosen = [item.strip() for item in text.split(",") if item.strip()]
    bad = [item for item in chosen if item not in allowed]
    if bad or not chosen:
        raise SystemExit(f"error: {option} takes {', '.join(allowed)}, not {text!r}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--baseline", type=Path, help=f"the previous release's tree (default: {DEFAULT_BASELINE})"
    )
    parser.add_argument("--candidate", type=Path, default=REPO, help="this tree (default: this repository)")
    parser.add_argument("--only", default=",".join(FIGURES), help="figures to measure")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (at least)")
    parser.add_argument("--until", type=float, help="add rounds until every interval is +- this (0.02)")
    parser.add_argument("--max-rounds", type=int, default=12, help="with --until: at most this many rounds")
    parser.add_argument("--rate", type=int, default=10_000, help="rss: probe events/s while loaded")
    parser.add_argument("--seconds", type=int, default=40, help="rss: seconds loaded")
    parser.add_argument("--idle-s", type=int, default=8, help="rss: seconds idle before the load")
    parser.add_argument("--events", type=int, default=1_000_000, help="ingest: events per round")
    parser.add_argument("--steps", type=int, default=20_000, help="otlp: token steps in the store")
    parser.add_argument("--tokens", type=int, default=24, help="slowdown: tokens per request")
    parser.add_argument("--requests", type=int, default=2, help="slowdown: requests per round")
    parser.add_argument("--no-store", action="store_true", help="slowdown: attach without --db")
    parser.add_argument("--peer-tokens", type=int, default=64, help="peers: tokens generated per round")
    parser.add_argument("--forward-passes", type=int, default=16, help="peers: forward passes per round")
    parser.add_argument("--peer-modes", default="generate,forward", help="peers: the workloads measured")
    parser.add_argument("--peer-threads", default="1,2", help="peers: the torch thread counts measured")
    parser.add_argument("--peer-before", type=Path,
                        help="peers: also an 'llmobs before' arm, the agent of this tree (a worktree of "
                             "an earlier commit, built): this tree's change, ratio to ratio")  # fmt: skip
    parser.add_argument("--peer-no-store", action="store_true",
                        help="peers: also 'llmobs, no store' (`attach` without --db)")  # fmt: skip
    parser.add_argument("--peer-warmup", type=int, default=2,
                        help="peers: the measured work this many times over before the clock")  # fmt: skip
    add_json_option(parser)
    args = parser.parse_args(argv)
    only = selected_figures(parser, args.only, FIGURES)
    if {"rss", "rss-run", "attach", "attach-nostore", "slowdown", "peers"} & set(only) and os.geteuid() != 0:
        print("error: rss, rss-run, attach, attach-nostore, slowdown and peers attach eBPF probes\n"
              "hint: run as root, or --only otlp,ingest", file=sys.stderr)  # fmt: skip
        return 4
    baseline = ensure_baseline(args.baseline or DEFAULT_BASELINE, PREVIOUS_RELEASE)
    trees = {"before": baseline, "after": args.candidate}
    byte_compiled(*trees.values())
    report = Report("footprint", args)
    report.note(f"before: {baseline} ({tree_commit(baseline)})  after: {args.candidate}")
    opts = {"rss": {"rate": args.rate, "seconds": args.seconds, "idle_s": args.idle_s},
            "rss-run": {"rate": args.rate, "seconds": args.seconds, "idle_s": args.idle_s, "agent": "run"},
            "attach": {"duration": 3.0}, "attach-nostore": {"duration": 3.0, "db": False},
            "otlp": {"steps": args.steps, "store": "agent"},
            "ingest": {"events": args.events, "drain_events": 20_000}}  # fmt: skip
    rounds = {"rounds": args.rounds, "until": args.until, "max_rounds": args.max_rounds}
    imported: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-footprint-") as tmp, contextlib.ExitStack() as stack:
        clear_rotel_log = otlp_collector(only, opts, tmp, stack)

        for figure in only:
            if figure == "slowdown":
                for threads in (1, 2):
                    base = {
                        "model": "smollm2",
                        "requests": args.requests,
                        "tokens": args.tokens,
                        "threads": threads,
                        "db": not args.no_store,
                    }
                    arms = [arm("none", args.candidate, "tokens", {**base, "agent": False}, {})]
                    arms += [arm(name, tree, "tokens", base, imported) for name, tree in trees.items()]
                    report.compare(f"slowdown, {threads} thread(s)", arms, baseline="none", better=BETTER,
                                   metrics=SHOWN[figure], **rounds)  # fmt: skip
                continue
            if figure == "peers":
                peers(report, args, imported, rounds)
                continue
            measured = figure.split("-")[0]  # rss-run and attach-nostore: rss and attach, other options
            arms = [arm(name, tree, measured, opts[figure], imported) for name, tree in trees.items()]
            report.compare(figure, arms, baseline="before", better=BETTER, metrics=SHOWN[figure],
                           progress=clear_rotel_log, **rounds)  # fmt: skip
    for name, path in imported.items():
        report.note(f"{name}: every round imported llmobs from {path}")
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
