"""bench/harness.py: the interleaving order, the ratio and interval arithmetic on known inputs, the JSON
shape, and that a subprocess arm is charged its child's CPU time. No timing is asserted."""

from __future__ import annotations

import json
import math
import sys

import pytest

from bench.harness import (
    CPU,
    WALL,
    Arm,
    BenchError,
    Command,
    Comparison,
    Report,
    fmt,
    ratio_ci,
    schedule,
    summarize,
    verdict,
)


def test_schedule_interleaves_every_round_and_reverses_odd_rounds() -> None:
    assert schedule(["A", "B"], 4) == [(0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B"),
                                       (3, "B"), (3, "A")]  # fmt: skip
    assert [arm for _, arm in schedule(["A", "B", "C"], 2)] == ["A", "B", "C", "C", "B", "A"]


def test_run_calls_the_arms_in_schedule_order_after_unrecorded_warmup() -> None:
    calls: list[tuple[str, int]] = []

    def arm(name: str) -> Arm:
        return Arm(name, lambda ctx: calls.append((name, ctx.index)) or {"items": ctx.index + 1.0})

    report = Report("t", echo=False)
    made = report.compare("c", [arm("A"), arm("B")], rounds=3, warmup=1)
    assert calls == [("A", -1), ("B", -1), ("A", 0), ("B", 0), ("B", 1), ("A", 1), ("A", 2), ("B", 2)]
    assert made.order == [(0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B")]
    assert made.values("B", "items") == [1.0, 2.0, 3.0]


def test_until_adds_balanced_rounds_until_the_interval_is_narrow_enough() -> None:
    # B's ratio to A alternates 1.1 / 0.9 for four rounds, then is exactly 1: the interval narrows only
    # as rounds are added, so the number of rounds run says whether the stopping rule works.
    noise = [1.1, 0.9, 1.1, 0.9] + [1.0] * 40

    def a(ctx) -> dict:
        return {"x": 1.0}

    def b(ctx) -> dict:
        return {"x": noise[ctx.index]}

    arms = [Arm("A", a), Arm("B", b)]
    made = Report("t", echo=False).compare("c", arms, rounds=4, until=0.02, metrics=["x"], max_rounds=40)
    rounds = len(made.values("B", "x"))
    assert made.widest() <= 0.02
    assert rounds % 2 == 0 and 4 < rounds < 40
    shorter = Comparison("c", ["A", "B"], metrics=["x"])
    for index in range(rounds - 2):
        shorter.record("A", index, {"x": 1.0})
        shorter.record("B", index, {"x": noise[index]})
    assert shorter.widest() > 0.02  # it stopped at the first balanced count that was narrow enough
    capped = Report("t", echo=False).compare("c", arms, rounds=2, until=0.0, metrics=["x"], max_rounds=6)
    assert len(capped.values("B", "x")) == 6
    assert [index for index, _ in capped.order] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_until_ignores_a_figure_the_baseline_does_not_have() -> None:
    # the peers figure's "agent CPU" exists only in the agent's arm: it has no ratio, so it must not keep
    # `until` running to max_rounds while the ratios that exist are already exact
    def a(ctx) -> dict:
        return {"x": 1.0}

    def b(ctx) -> dict:
        return {"x": 1.0, "own": 0.5 + ctx.index}

    arms = [Arm("A", a), Arm("B", b)]
    made = Report("t", echo=False).compare(
        "c", arms, rounds=2, until=0.02, metrics=["x", "own"], max_rounds=10
    )
    assert len(made.values("B", "x")) == 2
    assert made.widest() == 0.0


def test_summary_is_min_median_max() -> None:
    assert summarize([3.0, 1.0, 2.0, 10.0]) == {"n": 4, "min": 1.0, "median": 2.5, "max": 10.0}


def test_ratio_is_the_geometric_mean_of_paired_ratios_with_a_t_interval_on_logs() -> None:
    arm, base = [2.0, 8.0], [1.0, 2.0]  # paired ratios 2 and 4: log mean = log(sqrt 8)
    result = ratio_ci(arm, base)
    assert result["n"] == 2
    assert result["ratio"] == pytest.approx(math.sqrt(8))
    logs = [math.log(2), math.log(4)]
    half = 12.706204736 * (abs(logs[1] - logs[0]) / math.sqrt(2)) / math.sqrt(2)  # t(0.975, 1)
    low, high = result["ci"]
    assert low == pytest.approx(math.exp(sum(logs) / 2 - half), rel=1e-6)
    assert high == pytest.approx(math.exp(sum(logs) / 2 + half), rel=1e-6)


def test_identical_ratios_give_a_zero_width_interval_and_one_pair_none() -> None:
    result = ratio_ci([3.0, 6.0, 9.0], [1.0, 2.0, 3.0])
    assert result["ratio"] == pytest.approx(3.0)
    assert result["ci"] == pytest.approx([3.0, 3.0])
    assert ratio_ci([5.0], [2.0]) == {"ratio": 2.5, "n": 1, "ci": None}
    assert ratio_ci([0.0], [2.0]) is None


def test_ratios_pair_by_round_not_by_position() -> None:
    report = Report("t", echo=False)
    made = report.comparison("c", ["base", "new"], baseline="base")
    for index, value in ((0, 1.0), (1, 2.0), (2, 4.0)):
        made.record("base", index, {"x": value})
    made.record("new", 2, {"x": 8.0})  # only round 2 of "new": pairs with base's 4.0
    made.record("new", 0, {"x": 3.0})  # round 0: with base's 1.0
    result = made.ratio("new", "x")
    assert result["n"] == 2
    assert result["ratio"] == pytest.approx(math.sqrt(2.0 * 3.0))


def test_verdict_says_worse_only_when_the_whole_interval_is_on_the_worse_side() -> None:
    assert verdict({"ratio": 0.9, "ci": [0.85, 0.95]}, "higher") == "worse"
    assert verdict({"ratio": 0.9, "ci": [0.85, 0.95]}, "lower") == "better"
    assert verdict({"ratio": 0.9, "ci": [0.7, 1.1]}, "higher") == "same"
    assert verdict({"ratio": 1.2, "ci": [1.1, 1.3]}, "lower") == "worse"
    assert verdict({"ratio": 1.2, "ci": None}, "lower") == ""
    assert verdict({"ratio": 1.2, "ci": [1.1, 1.3]}, None) == ""


def test_json_shape(tmp_path) -> None:
    import argparse

    path = tmp_path / "out.json"
    args = argparse.Namespace(rounds=2, json=str(path))
    report = Report("demo", args, echo=False)
    report.compare("pair", [Arm("A", lambda ctx: {"rate": 10.0}), Arm("B", lambda ctx: {"rate": 20.0})],
                   rounds=2, better={"rate": "higher"}, metrics=["rate"])  # fmt: skip
    report.note("a one-off figure")
    report.finish()
    data = json.loads(path.read_text())
    assert data["benchmark"] == "demo"
    assert data["options"] == {"rounds": 2}
    assert data["notes"] == ["a one-off figure"]
    (comparison,) = data["comparisons"]
    assert comparison["title"] == "pair" and comparison["baseline"] == "A"
    assert comparison["order"] == [[0, "A"], [0, "B"], [1, "B"], [1, "A"]]
    b = comparison["arms"]["B"]
    assert [sorted(s) for s in b["samples"]] == [sorted(["round", WALL, CPU, "rate"])] * 2
    assert sorted(b["summary"]) == sorted([WALL, CPU, "rate"])  # every figure, not only those shown
    assert b["summary"]["rate"] == {"n": 2, "min": 20.0, "median": 20.0, "max": 20.0}
    assert b["ratios"]["rate"]["ratio"] == pytest.approx(2.0)
    assert b["ratios"]["rate"]["ci"] == pytest.approx([2.0, 2.0])
    assert b["ratios"]["rate"]["verdict"] == "better"
    assert comparison["arms"]["A"]["ratios"] == {}


def test_table_lists_each_figure_and_arm_with_the_ratio() -> None:
    report = Report("t", echo=False)
    made = report.comparison("pair", ["A", "B"], metrics=["rate"])
    for index in range(2):
        made.record("A", index, {"rate": 100.0, WALL: 1.0})
        made.record("B", index, {"rate": 50.0, WALL: 1.0})
    text = made.table()
    assert "== pair (2 rounds, interleaved; ratio to 'A') ==" in text
    assert "(baseline)" in text and "0.500x [0.500, 0.500]" in text
    assert WALL not in text  # only the metrics asked for


def test_an_arm_times_only_its_timed_block_when_it_has_one() -> None:
    seen = {}

    def fn(ctx):
        with ctx.timed() as watch:
            pass
        seen["watch"] = watch
        return {}

    values = Arm("A", fn).once(0)
    assert values[WALL] == seen["watch"].wall and values[CPU] == seen["watch"].cpu


def test_a_command_arm_is_charged_its_childs_cpu_and_parses_its_figures() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass\nprint('n 7')"
    arm = Command("child", [sys.executable, "-c", burn], figures=lambda out: {"n": float(out.split()[1])})
    values = arm.once(0)
    assert values["n"] == 7.0
    assert values[CPU] >= 0.2  # the child's own CPU, not this process's (which only waited)


def test_a_failing_command_arm_raises() -> None:
    with pytest.raises(BenchError, match="exited 3"):
        Command("bad", [sys.executable, "-c", "import sys; sys.exit(3)"]).once(0)


def test_fmt_keeps_four_significant_figures_without_exponents() -> None:
    assert fmt(2_412_345.6) == "2,412,346"
    assert fmt(12.3456) == "12.35"
    assert fmt(0.0123456) == "0.01235"
    assert fmt(0.0) == "0"


def test_step_cost_names_each_drop_counter_group_and_they_add_up_to_the_total() -> None:
    from bench.step_cost import drop_figures

    drops = {"map_lost": 7, "map_corrupt": 1, "map_writer_dropped": 2, "ring_drops": 30, "agg_overflow": 4,
             "store_dropped": 100, "store_failed": 5, "sink_otlp_failed": 9}  # fmt: skip
    figures = drop_figures(drops)
    assert figures == {"agent: drops": 158, "drops: map lapped": 7, "drops: map rejected": 3,
                       "drops: kernel": 34, "drops: store queue full": 100, "drops: store failed": 5,
                       "drops: other sinks": 9}  # fmt: skip
    assert drop_figures({}) == dict.fromkeys(figures, 0)


def test_compare_says_each_round_on_stderr_as_it_finishes(capsys) -> None:
    """A long run shows its progress: one stderr line a round and arm, with the shown figures; stdout
    keeps only the table."""
    report = Report("t")
    calls = []
    arms = [Arm("A", lambda ctx: {"rate": 10.0, "cpu": 1.0}), Arm("B", lambda ctx: {"rate": 20.0})]
    report.compare("pair", arms, rounds=2, metrics=["rate"], progress=lambda c, i, n: calls.append((i, n)))
    out, err = capsys.readouterr()
    lines = [line.rsplit(" (", 1)[0] for line in err.splitlines()]
    assert lines == ["pair: round 1, A: rate 10", "pair: round 1, B: rate 20",
                     "pair: round 2, B: rate 20", "pair: round 2, A: rate 10"]  # fmt: skip
    assert calls == [(0, "A"), (0, "B"), (1, "B"), (1, "A")]  # the benchmark's own hook still runs
    assert "pair: round" not in out and "2.000x" in out
