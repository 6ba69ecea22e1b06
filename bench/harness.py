"""The one benchmark harness: interleaved rounds of two or more arms, wall and CPU time, each arm's own
figures, min / median / max, ratios to a baseline arm with a 95% confidence interval, a printed table
and `--json PATH`.

    report = Report("ingest", args)                       # args: the benchmark's argparse namespace
    report.compare("decode", [Arm("ours", decode_ours), Arm("bpf.output", decode_bpf)], rounds=5,
                   baseline="bpf.output", better={"events/s": "higher"})
    report.finish()                                       # writes --json PATH if it was given

Interleaving: every round runs every arm once, and odd rounds run them in reverse (A B C | C B A | A B C
...), so drift of a shared machine (another job starting, thermal, caches) hits every arm alike and no
arm always goes first. Never A A A then B B B.

An arm is an in-process callable (`Arm`) or a subprocess command (`Command`). Each round of an arm
records `wall_s` (perf_counter) and `cpu_s`: user + system time of this process *and* of its reaped
children (getrusage RUSAGE_SELF + RUSAGE_CHILDREN), so a subprocess arm is charged the child's CPU
and an in-process arm that spawns helpers is charged theirs too. An in-process arm may narrow what
is timed to the part that matters with `with ctx.timed() as t:` (setup outside it is not counted)
and may return figures of its own for the round (events/s, spans/s, tokens/s, latency...):
{name: value}. A Command's figures come from its `figures(stdout) -> {name: value}` parser. Every
figure is aggregated like wall and CPU time.

Ratio and interval: for each figure, the rounds in which both the arm and the baseline have a value are
paired by round index; the ratio is the geometric mean of the paired ratios arm/baseline, and its 95%
interval is a Student t interval on the log ratios, exp(mean(log r) +- t(0.975, n-1) * sd / sqrt(n)).
Pairing removes the drift the two arms share; the log makes the interval multiplicative and keeps it
positive. One pair gives a ratio and no interval. With `better` (figure -> "higher" / "lower") the table
says "worse" only where the whole interval lies on the worse side: a change inside the noise is "same".

A benchmark whose interleaving is inside the measured thing (sampled and unsampled forward passes of one
generate() call) records its samples itself with `Comparison.record` and gets the same table and JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scipy import stats as _stats

WALL = "wall_s"
CPU = "cpu_s"
CI_METHOD = "geometric mean of paired ratios; 95% Student t interval on the log ratios"
Figures = Mapping[str, float]


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its reaped children (getrusage: microseconds,
    where os.times counts 10 ms ticks)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class Stopwatch:
    """Wall and CPU seconds of one `with` block (`.wall`, `.cpu`, set on exit)."""

    wall = 0.0
    cpu = 0.0

    def __enter__(self) -> Stopwatch:
        self._wall0, self._cpu0 = time.perf_counter(), cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._wall0
        self.cpu = cpu_seconds() - self._cpu0


class RoundContext:
    """What an in-process arm gets each round: its index, and `timed()` to narrow what is measured."""

    def __init__(self, index: int):
        self.index = index
        self.watch: Stopwatch | None = None

    @contextmanager
    def timed(self):
        if self.watch is not None:
            raise RuntimeError("an arm can time one block per round")
        self.watch = Stopwatch()
        with self.watch:
            yield self.watch


@dataclass
class Sample:
    round: int
    values: dict[str, float]


@dataclass
class Arm:
    """An in-process arm: `fn(ctx)` runs one round and may return its own figures."""

    name: str
    fn: Callable[[RoundContext], Figures | None]

    def once(self, index: int) -> dict[str, float]:
        ctx = RoundContext(index)
        whole = Stopwatch()
        with whole:
            figures = self.fn(ctx) or {}
        watch = ctx.watch or whole
        return {WALL: watch.wall, CPU: watch.cpu, **{k: float(v) for k, v in figures.items()}}


@dataclass
class Command:
    """A subprocess arm: `argv` run to completion each round (a non-zero exit is an error); `figures`
    parses its stdout into the round's own figures."""

    name: str
    argv: Sequence[str] | Callable[[int], Sequence[str]]
    env: Mapping[str, str] | None = None
    cwd: str | Path | None = None
    figures: Callable[[str], Figures] | None = None
    timeout: float = 600.0

    def once(self, index: int) -> dict[str, float]:
        argv = self.argv(index) if callable(self.argv) else self.argv
        env = None if self.env is None else {**os.environ, **self.env}
        with Stopwatch() as watch:
            done = subprocess.run(
                list(argv), env=env, cwd=self.cwd, capture_output=True, text=True, timeout=self.timeout
            )
        if done.returncode != 0:
            raise BenchError(f"arm {self.name!r} exited {done.returncode}: {done.stderr[-2000:]}")
        figures = self.figures(done.stdout) if self.figures else {}
        return {WALL: watch.wall, CPU: watch.cpu, **{k: float(v) for k, v in figures.items()}}


class BenchError(RuntimeError):
    """A benchmark could not measure what it set out to (an arm failed)."""


def schedule(arms: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, arm) in run order: every arm once per round, odd rounds reversed."""
    order = []
    for index in range(rounds):
        names = arms if index % 2 == 0 else list(reversed(arms))
        order += [(index, name) for name in names]
    return order


def summarize(values: Sequence[float]) -> dict[str, float]:
    return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values)}


def ratio_ci(arm: Sequence[float], base: Sequence[float], level: float = 0.95) -> dict[str, Any] | None:
    """Geometric-mean ratio arm/base over paired values, with its t interval on the log ratios
    (None when no pair has two positive values)."""
    logs = [math.log(a / b) for a, b in zip(arm, base, strict=True) if a > 0 and b > 0]
    if not logs:
        return None
    mean = statistics.fmean(logs)
    result: dict[str, Any] = {"ratio": math.exp(mean), "n": len(logs), "ci": None}
    if len(logs) > 1:
        half = _stats.t.ppf(0.5 + level / 2, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
        result["ci"] = [math.exp(mean - half), math.exp(mean + half)]
    return result


def verdict(ratio: Mapping[str, Any] | None, better: str | None) -> str:
    """'better' / 'worse' when the whole interval is on that side of 1, else 'same'; '' if unknown."""
    if ratio is None or better is None or ratio["ci"] is None:
        return ""
    low, high = ratio["ci"]
    higher_wins = better == "higher"
    if low > 1:
        return "better" if higher_wins else "worse"
    if high < 1:
        return "worse" if higher_wins else "better"
    return "same"


@dataclass
class Comparison:
    """One set of arms measured together: their samples, and the summary and ratios made from them."""

    title: str
    arms: list[str]
    baseline: str | None = None
    better: dict[str, str] = field(default_factory=dict)
    metrics: list[str] | None = None  # which to show, in order (default: every one recorded)
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    order: list[tuple[int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.baseline is None and self.arms:
            self.baseline = self.arms[0]
        for arm in self.arms:
            self.samples.setdefault(arm, [])

    def record(self, arm: str, index: int, values: Figures) -> None:
        if arm not in self.samples:
            self.arms.append(arm)
            self.samples[arm] = []
        self.samples[arm].append(Sample(index, {k: float(v) for k, v in values.items()}))
        self.order.append((index, arm))

    def run(self, arms: Sequence[Arm | Command], rounds: int, warmup: int = 0, progress=None,
            until: float | None = None, max_rounds: int | None = None) -> Comparison:  # fmt: skip
        """`rounds` interleaved rounds; with `until` (a half-width in ratio points, 0.02 = +-2 points)
        more rounds, two at a time so the order stays balanced, until every shown figure's interval
        (each arm against the baseline) is that narrow, or `max_rounds` (default 30) were run."""
        by_name = {arm.name: arm for arm in arms}
        for _, name in schedule(list(by_name), warmup):
            by_name[name].once(-1)
        done, limit = 0, max_rounds or 30
        while True:
            for index, name in schedule(list(by_name), rounds)[done * len(by_name) :]:
                self.record(name, index, by_name[name].once(index))
                if progress is not None:
                    progress(self, index, name)
            done = rounds
            if until is None or self.widest() <= until or rounds >= limit:
                return self
            rounds = min(rounds + 2, limit)

    def widest(self) -> float:
        """The largest half-width, in ratio points, of the shown figures' intervals (inf without one)."""
        widths = [0.0]
        for metric in self.metric_names():
            if self.baseline is not None and not self.values(self.baseline, metric):
                continue  # a figure only the other arms have (the agent's CPU): there is no ratio to narrow
            for arm in self.arms:
                if arm == self.baseline or not self.values(arm, metric):
                    continue
                r = self.ratio(arm, metric)
                widths.append(math.inf if r is None or r["ci"] is None else (r["ci"][1] - r["ci"][0]) / 2)
        return max(widths)

    def metric_names(self, every: bool = False) -> list[str]:
        """The figures to show (`metrics`, if given), or with `every` all that were recorded."""
        if self.metrics is not None and not every:
            return list(self.metrics)
        seen: dict[str, None] = {}
        for arm in self.arms:
            for sample in self.samples[arm]:
                seen.update(dict.fromkeys(sample.values))
        return list(seen)

    def values(self, arm: str, metric: str) -> list[float]:
        return [s.values[metric] for s in self.samples[arm] if metric in s.values]

    def summary(self, arm: str, metric: str) -> dict[str, float] | None:
        values = self.values(arm, metric)
        return summarize(values) if values else None

    def median(self, arm: str, metric: str) -> float:
        return statistics.median(self.values(arm, metric))

    def ratio(self, arm: str, metric: str) -> dict[str, Any] | None:
        if self.baseline is None or arm == self.baseline:
            return None
        base = {s.round: s.values[metric] for s in self.samples[self.baseline] if metric in s.values}
        pairs = [(s.values[metric], base[s.round]) for s in self.samples[arm]
                 if metric in s.values and s.round in base]  # fmt: skip
        if not pairs:
            return None
        return ratio_ci([a for a, _ in pairs], [b for _, b in pairs])

    def to_json(self) -> dict[str, Any]:
        metrics = self.metric_names(every=True)
        return {
            "title": self.title,
            "baseline": self.baseline,
            "order": [list(step) for step in self.order],
            "ci_method": CI_METHOD,
            "arms": {
                arm: {
                    "samples": [{"round": s.round, **s.values} for s in self.samples[arm]],
                    "summary": {m: self.summary(arm, m) for m in metrics if self.summary(arm, m)},
                    "ratios": {
                        m: {**r, "verdict": verdict(r, self.better.get(m))}
                        for m in metrics
                        if (r := self.ratio(arm, m)) is not None
                    },
                }
                for arm in self.arms
            },
        }

    def table(self) -> str:
        """One row per metric and arm: min / median / max, and the ratio to the baseline [95% CI]."""
        metrics = self.metric_names()
        rounds = max((len(v) for v in self.samples.values()), default=0)
        width = max([len(m) for m in metrics] + [6]) + 2
        arm_width = max([len(a) for a in self.arms] + [3])
        head = f"== {self.title} ({rounds} rounds, interleaved"
        head += f"; ratio to {self.baseline!r}) ==" if len(self.arms) > 1 else ") =="
        lines = [head, f"  {'figure':<{width}} {'arm':<{arm_width}} {'min':>11} {'median':>11} {'max':>11}"
                 + ("   ratio [95% CI]" if len(self.arms) > 1 else "")]  # fmt: skip
        for metric in metrics:
            label = metric  # on the first row of each figure only
            for arm in self.arms:
                s = self.summary(arm, metric)
                if s is None:
                    continue
                row = f"  {label:<{width}} {arm:<{arm_width}} {fmt(s['min']):>11} {fmt(s['median']):>11}"
                label = ""
                row += f" {fmt(s['max']):>11}"
                r = self.ratio(arm, metric)
                if r is not None:
                    ci = f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]" if r["ci"] else "[n/a]"
                    row += f"   {r['ratio']:.3f}x {ci} {verdict(r, self.better.get(metric))}".rstrip()
                elif arm == self.baseline and len(self.arms) > 1:
                    row += "   (baseline)"
                lines.append(row)
        return "\n".join(lines)


def fmt(value: float) -> str:
    """Four significant figures, thousands separated, without exponents for everyday magnitudes."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    decimals = max(0, 3 - int(math.floor(math.log10(magnitude))))
    return f"{value:.{min(decimals, 6)}f}"


class Report:
    """The comparisons of one benchmark run, printed as they finish and written to `--json PATH`."""

    def __init__(self, name: str, args: argparse.Namespace | None = None, echo: bool = True):
        self.name = name
        self.options = {k: v for k, v in vars(args).items() if k != "json"} if args is not None else {}
        self.json_path = getattr(args, "json", None)
        self.echo = echo
        self.comparisons: list[Comparison] = []
        self.notes: list[str] = []

    def comparison(self, title: str, arms: Iterable[str] = (), baseline: str | None = None,
                   better: Mapping[str, str] | None = None,
                   metrics: Sequence[str] | None = None) -> Comparison:  # fmt: skip
        """An empty comparison the benchmark fills with `record`; `show` prints it."""
        made = Comparison(title, list(arms), baseline, dict(better or {}), list(metrics) if metrics else None)
        self.comparisons.append(made)
        return made

    def compare(self, title: str, arms: Sequence[Arm | Command], rounds: int, *, baseline: str | None = None,
                better: Mapping[str, str] | None = None, metrics: Sequence[str] | None = None,
                warmup: int = 0, progress=None, until: float | None = None,
                max_rounds: int | None = None) -> Comparison:  # fmt: skip
        """Run `arms` interleaved for `rounds` (after `warmup` unrecorded rounds; with `until`, more
        rounds up to `max_rounds` until the intervals are that narrow: Comparison.run), print the table."""
        made = self.comparison(title, [a.name for a in arms], baseline, better, metrics)
        began = time.monotonic()

        def each_round(comparison: Comparison, index: int, name: str) -> None:
            if self.echo:  # a long run says where it is (stderr: stdout is the tables)
                shown = metrics or list(comparison.samples[name][-1].values)
                values = comparison.samples[name][-1].values
                figures = ", ".join(f"{m} {values[m]:.4g}" for m in shown if m in values)
                print(f"{title}: round {index + 1}, {name}: {figures} ({time.monotonic() - began:.0f} s)",
                      file=sys.stderr, flush=True)  # fmt: skip
            if progress is not None:
                progress(comparison, index, name)

        made.run(arms, rounds, warmup, each_round, until, max_rounds)
        self.show(made)
        return made

    def show(self, comparison: Comparison) -> None:
        if self.echo:
            print(comparison.table(), flush=True)

    def note(self, text: str) -> None:
        """A line the benchmark prints beside its tables (a one-off figure, a derived number)."""
        self.notes.append(text)
        if self.echo:
            print(text, flush=True)

    def to_json(self) -> dict[str, Any]:
        return {
            "benchmark": self.name,
            "options": {
                k: v if isinstance(v, int | float | str | bool | None) else str(v)
                for k, v in self.options.items()
            },  # fmt: skip
            "comparisons": [c.to_json() for c in self.comparisons],
            "notes": self.notes,
        }

    def finish(self) -> None:
        if self.json_path:
            Path(self.json_path).write_text(json.dumps(self.to_json(), indent=2) + "\n")
            if self.echo:
                print(f"wrote {self.json_path}")


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="also write every sample and summary as JSON here")
