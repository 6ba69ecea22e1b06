"""What `llmobs-agent compare` costs on 1 M paired token steps (target: <= 1 s end to end).

    .venv/bin/python -m bench.compare_cost [--pairs 4000] [--tokens 250] [--rounds 5] [--bootstrap 2000]
                                           [--store PATH] [--json PATH]

The store is built once (and kept at --store): --pairs primaries of --tokens tokens each, every one
shadow-scored by a second variant (llmobs.store.synthetic_compare.shadow_pairs: 2 x pairs x tokens
token steps, each B token paired with an A token, plus request_labels), written by the real store
writer. Then, interleaved for --rounds:
- core: llmobs.diagnostics.compare.compare() in this process, every metric, --bootstrap resamples
  (attach, the per-request aggregate, pairing, token pairing, the bootstrap);
- cli: `python -m llmobs.cli compare --a variant:fp32 --b variant:q4-jitter --format json` as a
  subprocess: the whole command, interpreter start and imports included.
Printed: min / median / max wall and CPU per arm, and each median's ratio to the 1 s target.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import Arm, Command, Report, add_json_option

TARGET_S = 1.0
A, B = "variant:fp32", "variant:q4-jitter"


def build(path: Path, pairs: int, tokens: int) -> None:
    from llmobs.store import synthetic_compare
    from llmobs.store.sink import DuckDBStore

    t0 = time.perf_counter()
    tmp = path.with_suffix(".building")
    tmp.unlink(missing_ok=True)
    with DuckDBStore(tmp) as store:
        store.append(synthetic_compare.shadow_pairs(pairs, tokens, shift=0.05))
        store.checkpoint()
    tmp.rename(path)
    print(f"built {path}: {2 * pairs * tokens} token steps in {time.perf_counter() - t0:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4000)
    parser.add_argument("--tokens", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bootstrap", type=int, default=2000)
    parser.add_argument("--store", type=Path, help="where the store is kept (default: under $TMPDIR)")
    add_json_option(parser)
    args = parser.parse_args(argv)
    path = args.store or Path(tempfile.gettempdir()) / f"llmobs-compare-{args.pairs}x{args.tokens}.duckdb"
    if not path.exists():
        build(path, args.pairs, args.tokens)
    from llmobs.diagnostics import compare as cmp

    sel_a, sel_b = cmp.parse_selector(A), cmp.parse_selector(B)
    seen = {}

    def core(ctx):
        with ctx.timed():
            result = cmp.compare(path, sel_a, sel_b, resamples=args.bootstrap)
        seen["pairs"], seen["loss"] = result.pairs, result.metrics[0]
        return {"token_pairs": result.pairs["token_pairs"]}

    cli = Command(
        "cli",
        [
            sys.executable,
            "-m",
            "llmobs.cli",
            "compare",
            "--db",
            str(path),
            "--a",
            A,
            "--b",
            B,
            "--bootstrap",
            str(args.bootstrap),
            "--format",
            "json",
        ],
        env={"PYTHONPATH": os.pathsep.join(sys.path)},
        figures=lambda out: {"token_pairs": json.loads(out)["pairs"]["token_pairs"]},
    )
    report = Report("compare_cost", args)
    made = report.compare(
        f"compare on {args.pairs * args.tokens} paired token steps",
        [Arm("core", core), cli],
        rounds=args.rounds,
        warmup=1,
        metrics=["wall_s", "cpu_s", "token_pairs"],
    )
    for arm in ("core", "cli"):
        wall = made.median(arm, "wall_s")
        report.note(
            f"{arm}: median {wall:.3f} s wall, {made.median(arm, 'cpu_s'):.3f} s CPU ="
            f" {wall / TARGET_S:.2f}x the {TARGET_S:g} s target"
        )
    loss = seen["loss"]
    report.note(f"pairs {seen['pairs']}; loss B-A {loss.diff:+.4f} [{loss.ci[0]:+.4f}, {loss.ci[1]:+.4f}]")
    report.note(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end")
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
