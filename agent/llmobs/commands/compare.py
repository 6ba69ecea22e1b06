"""`llmobs-agent compare --a SEL --b SEL`: two variants on the same traffic, per metric, with intervals.

Pairs the requests of A and B (shadow-scored, same prompt, or --by-intent same intent), then per metric
prints A, B, B - A, the relative difference, a paired-bootstrap interval of B - A and a FLAG when the
interval excludes 0 at --alpha and |relative| >= --threshold. docs/compare.md has the statistics.

Errors, one line each: a selector that matches nothing (19), no pairs (20), bad selector or option
(2), no store (11).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict

from llmobs.diagnostics import compare as cmp
from llmobs.errors import UsageError
from llmobs.store import default_db_path

EXAMPLES = """selectors (SEL; several joined by ',' must all hold):
  variant:NAME   model:ID   label:KEY=VALUE   time:START..END (-30m, ISO, or ns)   store:PATH
examples:
  llmobs-agent compare --a variant:fp32 --b variant:q4-jitter
  llmobs-agent compare --a label:template=v2 --b label:template=v3 --metric loss ttft --format json
  llmobs-agent compare --a time:-2h..-1h --b time:-1h.. --png /tmp/diff.png
  llmobs-agent compare --a variant:lora --b store:/tmp/other.duckdb,variant:qlora
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    parser.add_argument("--a", required=True, metavar="SEL", help="the baseline requests")
    parser.add_argument("--b", required=True, metavar="SEL", help="the requests compared with them")
    parser.add_argument("--db", help=f"the store (default: $LLMOBS_DB or {default_db_path()})")
    parser.add_argument(
        "--metric",
        nargs="+",
        choices=cmp.METRIC_GROUPS,
        metavar="M",
        help=f"only these metrics ({', '.join(cmp.METRIC_GROUPS)}; default: all)",
    )
    parser.add_argument("--alpha", type=float, default=0.05, help="significance level (default 0.05)")
    parser.add_argument(
        "--threshold", type=float, default=0.03, help="relative difference a flag needs (default 0.03 = 3%%)"
    )
    parser.add_argument("--bootstrap", type=int, default=2000, metavar="N", help="resamples (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default 0: reproducible)")
    parser.add_argument("--by-intent", action="store_true", help="also pair unmatched prompts by intent")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument("--png", metavar="PATH", help="plot the per-token loss difference (B - A) by step")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.alpha < 1:
        raise UsageError(f"--alpha must be in (0, 1), not {args.alpha}", hint="e.g. --alpha 0.05")
    if args.threshold < 0:
        raise UsageError(f"--threshold must be >= 0, not {args.threshold}", hint="e.g. --threshold 0.03")
    if args.bootstrap < 100:
        raise UsageError(f"--bootstrap must be at least 100, not {args.bootstrap}", hint="default 2000")
    sel_a, sel_b = cmp.parse_selector(args.a), cmp.parse_selector(args.b)
    result = cmp.compare(
        args.db or default_db_path(),
        sel_a,
        sel_b,
        metrics=tuple(args.metric or cmp.METRIC_GROUPS),
        alpha=args.alpha,
        threshold=args.threshold,
        resamples=args.bootstrap,
        seed=args.seed,
        by_intent=args.by_intent,
        per_step=bool(args.png),
    )
    png = None
    if args.png:
        from llmobs.report.compare_plot import write_png

        png = write_png(result, args.png)
    if args.format == "json":
        out = asdict(result)
        if png is not None:
            out["png"] = str(png)
        print(json.dumps(_finite(out), indent=1))
    else:
        print_table(result, sys.stdout)
        if args.png:
            print(f"png: {png}" if png else "png: none (no paired tokens to plot)")
    return 0


def _fmt(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("nats",):
        return f"{value:.4f}"
    if unit == "ms":
        return f"{value:.3f}"
    return f"{value:.4g}"


def _signed(value, unit: str) -> str:
    return "-" if value is None else ("+" if value >= 0 else "") + _fmt(value, unit)


def print_table(result: cmp.Comparison, out) -> None:
    w = out.write
    by = ", ".join(f"{v} {k}" for k, v in result.pairs["by"].items())
    w(
        f"A: {result.a['selector']} ({result.a['requests']} requests)   "
        f"B: {result.b['selector']} ({result.b['requests']} requests)\n"
    )
    w(f"pairs: {result.pairs['pairs']} ({by}); paired tokens: {result.pairs['token_pairs']}\n")
    b = result.bootstrap
    level = round(100 * (1 - b["alpha"]), 2)
    w(
        f"interval: {level:g}% percentile, Poisson bootstrap over {b['clusters']} prompts ({b['resamples']}"
        f" resamples, seed {b['seed']}); FLAG: interval excludes 0 and |rel| >= {100 * b['threshold']:g}%\n"
    )
    header = ("metric", "unit", "A", "B", "B-A", "rel", f"{level:g}% CI (B-A)", "p", "pairs", "")
    rows = []
    for m in result.metrics:
        ci = "-" if m.ci is None else f"[{_signed(m.ci[0], m.unit)}, {_signed(m.ci[1], m.unit)}]"
        rel = "-" if m.rel is None or not math.isfinite(m.rel) else f"{100 * m.rel:+.2f}%"
        p = "-" if m.p is None else ("<0.001" if m.p < 0.001 else f"{m.p:.3f}")
        rows.append(
            (
                m.label,
                m.unit or "-",
                _fmt(m.a, m.unit),
                _fmt(m.b, m.unit),
                _signed(m.diff, m.unit),
                rel,
                ci,
                p,
                str(m.pairs),
                "FLAG" if m.flagged else "",
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        w(
            "  ".join(c.ljust(widths[i]) if i < 2 else c.rjust(widths[i]) for i, c in enumerate(r)).rstrip()
            + "\n"
        )
    for m in result.metrics:
        if m.name == "loss":
            w(f"loss: {m.basis}\n")


def _finite(value):
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, str):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
