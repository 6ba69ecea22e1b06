"""An incremental correlate's CPU as the store grows: the same 2 s window of a 20k steps/s server (16 rows
a pass, requests of 64 passes, random trace ids) at the end of stores of increasing size, before / after.

Why: the agent correlates every few seconds while attached, over the last few seconds of steps; a run
whose cost grows with everything stored before its window would, at a server's rate, grow without
bound over an attach (at 20k steps/s a store gains 72 M token steps an hour).

For each --sizes (token steps stored), one DuckDB file is built with SQL (token_steps, and the requests
an earlier run would have left for the steps before the window); then each tree's
`llmobs.pipeline.correlate.correlate(since=the window's start)` runs in its own process on that file
(rounds interleaved, bench/harness.py), and the CPU of the call alone is the figure. Every run rewrites
the window's rows the same way, so the arms see the same store; each run's requests table is digested and
the digests must agree (printed).

    .venv/bin/python -m bench.correlate_scale --baseline TREE [--candidate TREE] [--sizes 1200000,6000000]
        [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.harness import Command, Report, add_json_option

REPO = Path(__file__).resolve().parents[1]
RATE, ROWS, SPAN = 20_000, 16, 64  # steps/s, rows a pass, passes a request
WINDOW_STEPS = 2 * RATE
T0 = 10_000_000_000
PID = 4242
PASS_NS = 1_000_000_000 * ROWS // RATE

# row i: pass i // ROWS of request (pass // SPAN, row), step pass % SPAN; trace ids random (md5)
INSERT_STEPS = f"""
INSERT INTO token_steps (pid, step_seq, batch_row, trace_id, step, t_start_ns, t_end_ns, latency_ns, loss,
    tenant, tokens_in_pass)
SELECT {PID}, 1 + p, i % {ROWS}, md5((p // {SPAN} * {ROWS} + i % {ROWS})::VARCHAR), p % {SPAN},
    {T0} + p * {PASS_NS}, {T0} + p * {PASS_NS} + {PASS_NS * 9 // 10}, {PASS_NS * 9 // 10}, 1.0,
    'tenant-' || (i % 4), 1
FROM (SELECT i, i // {ROWS} AS p FROM range($lo, $hi) r(i))
"""
EARLIER_REQUESTS = """
INSERT INTO requests (pid, trace_id, first_step_seq, tenant, t_start_ns, t_end_ns, tokens, mean_loss)
SELECT pid, trace_id, min(step_seq - step), any_value(tenant), min(t_start_ns), max(t_end_ns), count(*),
    avg(loss)
FROM token_steps WHERE t_start_ns < $since GROUP BY pid, trace_id
"""
CHILD = """
import hashlib, json, sys, time
import duckdb
import llmobs
from llmobs.pipeline.correlate import correlate
conn = duckdb.connect(sys.argv[1])
began = time.process_time()
stats = correlate(conn, since_ns=int(sys.argv[2]), pid=int(sys.argv[3]))
cpu = time.process_time() - began
rows = conn.execute("SELECT * FROM requests ORDER BY ALL").fetchall()
digest = int(hashlib.sha1(repr(rows).encode()).hexdigest()[:12], 16)
figures = {"correlate cpu s": cpu, "requests": stats.requests}
print(json.dumps({**figures, "digest": digest, "llmobs": llmobs.__file__}))
"""


def build(path: Path, steps: int) -> int:
    """The store of `steps` token steps; returns the window's start (ns)."""
    sys.path.insert(0, str(REPO / "agent"))
    import duckdb
    from llmobs.store import schema

    conn = duckdb.connect(str(path))
    schema.migrate(conn)
    window = steps - WINDOW_STEPS
    since = T0 + window // ROWS * PASS_NS
    conn.execute(INSERT_STEPS, {"lo": 0, "hi": steps})
    conn.execute(EARLIER_REQUESTS, {"since": since})
    conn.close()
    return since


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the tree before (its agent/ is imported)")
    parser.add_argument("--candidate", default=str(REPO))
    parser.add_argument(
        "--sizes", default="1200000,6000000,18000000", help="token steps stored, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=3)
    add_json_option(parser)
    args = parser.parse_args(argv)
    trees = {"before": Path(args.baseline).resolve(), "after": Path(args.candidate).resolve()}
    for tree in trees.values():
        if not (tree / "agent" / "llmobs" / "__init__.py").is_file():
            print(
                f"error: {tree} is not an llmobs-agent source tree (no agent/llmobs/__init__.py)",
                file=sys.stderr,
            )
            print("hint: a checkout or `git archive` copy of this repository (--baseline /tmp/llmobs-main)",
                  file=sys.stderr)  # fmt: skip
            return 2
    try:
        sizes = [int(size) for size in args.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) <= WINDOW_STEPS:
        print(f"error: --sizes {args.sizes!r}: each a whole number of token steps above {WINDOW_STEPS:,}",
              file=sys.stderr)  # fmt: skip
        print(
            "hint: the window is the last 2 s at 20k steps/s; e.g. --sizes 1200000,6000000", file=sys.stderr
        )
        return 2
    report = Report("correlate_scale", args)
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="llmobs-correlate-scale-") as tmp:
            path = Path(tmp) / "store.duckdb"
            since = build(path, size)
            digests: dict[str, set[int]] = {name: set() for name in trees}

            def figures(stdout: str, name: str, digests: dict = digests) -> dict:
                data = json.loads(stdout.strip().splitlines()[-1])
                digests[name].add(data.pop("digest"))
                imported = Path(data.pop("llmobs")).resolve()
                if not imported.is_relative_to(trees[name]):  # an installed llmobs, not the tree's
                    raise SystemExit(f"error: arm {name!r} imported {imported}, not {trees[name]}'s llmobs")
                return data

            arms = [
                Command(
                    name,
                    [sys.executable, "-c", CHILD, str(path), str(since), str(PID)],
                    env={"PYTHONPATH": f"{tree}/agent"},
                    figures=lambda out, name=name: figures(out, name),
                )
                for name, tree in trees.items()
            ]
            report.compare(
                f"correlate of the last {WINDOW_STEPS:,} steps, {size:,} stored", arms, args.rounds,
                baseline="before", better={"correlate cpu s": "lower"},
            )  # fmt: skip
            agree = len(set().union(*digests.values())) == 1
            report.note(
                f"  requests after every run identical across arms and rounds: {'yes' if agree else 'NO'}"
            )
    report.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
