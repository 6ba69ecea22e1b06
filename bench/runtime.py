"""Before / after benchmark of issue 13's runtime refactor: two source trees of this project measured
side by side, interleaved round by round, on four figures:

  ingest    events/s: synthetic ring records through the agent's StoreWriter into a fresh DuckDB file
  attach    seconds from `attach --pid P --db X --duration D` starting to its first event, on a real
            tiny-model workload that is generating
  otlp      spans/s: a synthetic, correlated store exported by OtlpExporter over gRPC to a real rotel
            collector on loopback
  tokens    SmolLM2 tokens/s while `attach --pid P` (default flags, default profile) is attached

Each arm is a subprocess (bench/runtime_arm.py) with PYTHONPATH=<tree>/agent first, so it, the workload
and the agent it starts import that tree's `llmobs`, not the venv's editable install; every round's
`llmobs.__file__` is checked to lie in the tree. Rounds alternate before/after (ABBA), and the harness
gives each figure's ratio after/before with a 95% interval over the paired rounds: "worse" only when
the whole interval is on the worse side.

    .venv/bin/python -m bench.runtime [--baseline DIR] [--candidate DIR] [--rounds 3]
        [--only ingest,attach,otlp,tokens] [--tokens 16] [--json PATH]

--baseline defaults to a checkout of 50a5f84 (the commit before the refactor) at /tmp/llmobs-before,
made with `git worktree add` when missing; --candidate to this repository. Needs root (attach).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import BenchError, Command, Report, add_json_option

REPO = Path(__file__).resolve().parents[1]
BEFORE_COMMIT = "50a5f84"
DEFAULT_BASELINE = Path("/tmp/llmobs-before")
FIGURES = ("ingest", "attach", "otlp", "tokens")
BETTER = {"events/s": "higher", "events/CPU-s": "higher", "first event s": "lower", "spans/s": "higher",
          "spans/CPU-s": "higher", "tokens/s": "higher", "cpu_s": "lower"}  # fmt: skip
SHOWN = {"ingest": ["events/s", "events/CPU-s", "cpu_s"], "attach": ["first event s"],
         "otlp": ["spans/s", "spans/CPU-s"], "tokens": ["tokens/s", "cpu_s"]}  # fmt: skip


def selected_figures(parser: argparse.ArgumentParser, only: str, figures: tuple[str, ...]) -> list[str]:
    """The figures of a comma-separated --only; an unknown one is a usage error (parser.error)."""
    chosen = [f for f in only.split(",") if f]
    if unknown := set(chosen) - set(figures):
        parser.error(
            f"--only: unknown figure(s) {', '.join(sorted(unknown))} (choose from {', '.join(figures)})"
        )
    return chosen


def byte_compiled(*trees: Path) -> None:
    """Byte-compile each tree's agent package, as `pip install` does: a process started with
    PYTHONDONTWRITEBYTECODE=1 (this sandbox sets it) compiles every module whose .pyc is stale on every
    start, which a user's installed agent never does, and attach's start-up figures would carry it."""
    import compileall

    for tree in trees:
        if not compileall.compile_dir(str(tree / "agent"), quiet=1, workers=1):
            raise BenchError(f"byte-compiling {tree / 'agent'} failed")


def ensure_baseline(path: Path, commit: str = BEFORE_COMMIT) -> Path:
    """The tree to compare against: `git worktree add PATH COMMIT` unless PATH already holds one."""
    if not (path / "agent" / "llmobs" / "__init__.py").exists():
        # a worktree whose folder was deleted (a /tmp cleaned at boot) stays registered until pruned
        subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], check=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), commit],
                       check=True)  # fmt: skip
    return path


def tree_pythonpath(tree: Path) -> str:
    """PYTHONPATH with `tree`'s agent package first: a child imports that tree's llmobs, not the venv's
    editable install."""
    return os.pathsep.join([str(tree.resolve() / "agent"), *filter(None, [os.environ.get("PYTHONPATH")])])


def arm(name: str, tree: Path, figure: str, opts: dict, imported_from: dict[str, str]) -> Command:
    agent = str(tree.resolve() / "agent")
    env = {"PYTHONPATH": tree_pythonpath(tree)}
    # cwd = this repository: `-m bench.runtime_arm` is found there; it has no llmobs of its own at the top
    argv = [sys.executable, "-m", "bench.runtime_arm", figure, json.dumps({**opts, "tree": str(tree)})]

    def figures(stdout: str) -> dict:
        result = json.loads(stdout.strip().splitlines()[-1])
        imported = result.pop("llmobs")
        if not Path(imported).resolve().is_relative_to(Path(agent)):
            raise BenchError(f"arm {name!r} imported {imported}, not the tree's {agent}")
        imported_from.setdefault(name, imported)
        return {k: v for k, v in result.items() if isinstance(v, int | float)}

    return Command(name, argv, env=env, cwd=REPO, figures=figures, timeout=1800)


def otlp_collector(only: list[str], opts: dict, tmp: str, stack: contextlib.ExitStack):
    """A rotel collector for the otlp figure (its endpoint put into opts["otlp"]), and the progress hook
    that empties its debug log after each round (it grows by ~1 KB per span)."""
    rotel = None
    if "otlp" in only:
        from bench.rotel_harness import Rotel

        rotel = stack.enter_context(Rotel(Path(tmp)))
        opts["otlp"]["endpoint"] = rotel.grpc_endpoint

    def clear_rotel_log(comparison, index, name) -> None:
        if rotel is not None and rotel.logs:
            rotel.logs[-1].write_bytes(b"")

    return clear_rotel_log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", type=Path, help=f"the tree before (default: {DEFAULT_BASELINE})")
    parser.add_argument("--candidate", type=Path, default=REPO, help="the tree after (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(FIGURES), help="figures to measure")
    parser.add_argument("--events", type=int, default=1_000_000, help="ingest: events per round")
    parser.add_argument("--drain-events", type=int, default=20_000, help="ingest: events per ring drain")
    parser.add_argument("--duration", type=float, default=3.0, help="attach: --duration of the attach")
    parser.add_argument("--steps", type=int, default=20_000, help="otlp: token steps in the store")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2", help="tokens: model")
    parser.add_argument("--requests", type=int, default=2, help="tokens: requests per round")
    parser.add_argument("--tokens", type=int, default=16, help="tokens: tokens per request")
    add_json_option(parser)
    args = parser.parse_args(argv)
    only = selected_figures(parser, args.only, FIGURES)
    if {"attach", "tokens"} & set(only) and os.geteuid() != 0:
        print("error: attach and tokens attach eBPF probes\nhint: run as root, or --only ingest,otlp",
              file=sys.stderr)  # fmt: skip
        return 4
    baseline = ensure_baseline(args.baseline or DEFAULT_BASELINE)
    trees = {"before": baseline, "after": args.candidate}
    report = Report("runtime", args)
    report.note(f"before: {baseline}  after: {args.candidate}  ({args.rounds} interleaved rounds each)")
    opts = {"ingest": {"events": args.events, "drain_events": args.drain_events},
            "attach": {"duration": args.duration}, "otlp": {"steps": args.steps},
            "tokens": {"model": args.model, "requests": args.requests, "tokens": args.tokens}}  # fmt: skip
    imported: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as tmp, contextlib.ExitStack() as stack:
        clear_rotel_log = otlp_collector(only, opts, tmp, stack)

        for figure in only:
            arms = [arm(name, tree, figure, opts[figure], imported) for name, tree in trees.items()]
            report.compare(figure, arms, args.rounds, baseline="before", better=BETTER,
                           metrics=SHOWN[figure], progress=clear_rotel_log)  # fmt: skip
    for name, path in imported.items():
        report.note(f"{name}: every round imported llmobs from {path}")
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
