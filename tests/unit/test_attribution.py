"""The attribution matrix on stores whose truth is known: a +0.2 factor, a null one, an interaction."""

from __future__ import annotations

import itertools
import json

import duckdb
import pytest
from llmobs.cli import main
from llmobs.diagnostics import attribution as at
from llmobs.store import synthetic_compare as sc
from llmobs.store.sink import DuckDBStore

JITTER, INTERACTION = 0.2, 0.3  # jitter on: +0.2 nats; tenant b x fmt text: +0.3 difference-in-differences


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """16 cells x 20 requests: loss = base + 0.2 jitter + 0.075 s_tenant s_fmt (s = +-1, so tenant and
    fmt have no main effect and a 0.3 interaction); template does nothing."""
    specs, seq = [], 0
    for rep in range(20):
        for j, p, t, f in itertools.product((0, 1), repeat=4):
            seq += 1
            shift = JITTER * j + INTERACTION / 4 * (1 if t == f else -1)
            labels = {"jitter": ("off", "on")[j], "template": ("v1", "v3")[p], "fmt": ("json", "text")[f]}
            specs.append(
                sc.RequestSpec(seq, prompt=rep, tenant=("a", "b")[t], labels=labels, loss_shift=shift)
            )
    path = tmp_path_factory.mktemp("attribution") / "a.duckdb"
    with DuckDBStore(path) as store:
        store.append(sc.tables(3, specs, 16, noise=0.4))
    return path


def test_the_true_factor_ranks_first_and_the_null_one_covers_zero(db):
    result = at.attribution(duckdb.connect(str(db), read_only=True), "loss")
    assert result.requests == 320 and result.cells == 16
    by = {f.factor: f for f in result.factors}
    first = result.factors[0]
    assert first.factor == "jitter" and first.rank == 1 and (first.level, first.reference) == ("on", "off")
    assert (
        first.ci[0] < first.effect < first.ci[1] and first.ci[0] < JITTER < first.ci[1] and first.significant
    )
    for null in ("template", "tenant", "fmt"):  # no main effect: each interval covers 0
        assert by[null].ci[0] < 0 < by[null].ci[1] and not by[null].significant
        assert abs(by[null].effect) < abs(first.effect)
    top = result.interactions[0]
    assert set(top.factors) == {"fmt", "tenant"} and top.significant
    assert top.ci[0] < INTERACTION < top.ci[1]
    assert all(not i.significant for i in result.interactions[1:])


def test_aliased_factors_merge_and_a_nested_one_is_not_separable(tmp_path):
    """variant and the model's quant split the requests the same way: one factor named by both; a
    label constant within each variant but coarser (family) cannot be told apart from it."""
    specs = []
    for i in range(60):
        v = ("fp32", "q4", "q4j")[i % 3]
        specs.append(
            sc.RequestSpec(
                i + 1,
                prompt=i // 3,
                model_id=f"m-{v}",
                loss_shift=0.3 * (v == "q4j"),
                labels={"variant": v, "family": "fp" if v == "fp32" else "int4"},
            )
        )
    path = tmp_path / "alias.duckdb"
    with DuckDBStore(path) as store:
        store.append(sc.tables(4, specs, 8, noise=0.1))
        factors = [
            (4, f"m-{v}", "quant", q, 1) for v, q in (("fp32", "none"), ("q4", "int4"), ("q4j", "int4-j3"))
        ]
        store.connection.executemany("INSERT INTO model_factors VALUES (?, ?, ?, ?, ?)", factors)
    result = at.attribution(duckdb.connect(str(path), read_only=True), "loss", resamples=200)
    names = [f.factor for f in result.factors]
    assert names == ["quant = variant", "family"]
    assert result.factors[0].level in ("int4-j3", "q4j") and result.factors[0].significant
    assert (
        result.factors[1].effect is None
        and result.factors[1].note == "not separable: nested in quant = variant"
    )


def test_query_attribution_cli_and_explain_names_the_levels(db, capsys):
    assert main(["query", "--db", str(db), "--attribution", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["factor"] for r in rows if r["kind"] == "factor"][0] == "jitter"
    assert main(["query", "--db", str(db), "--metric", "latency"]) == 2  # --metric needs --attribution
    capsys.readouterr()
    trace = sc.prompt_trace(0)
    seq = (
        duckdb.connect(str(db), read_only=True)
        .execute(
            "SELECT min(step_seq) FROM token_steps WHERE request_seq = 2"  # jitter off, template v1, fmt text
        )
        .fetchall()[0][0]
    )
    assert (
        main(["explain", "--db", str(db), "--trace", trace, "--step", "3", "--first-step-seq", str(seq)]) == 0
    )
    out = capsys.readouterr().out
    assert "factors of this request, as the attribution matrix ranks them (loss, 320 requests" in out
    assert "  1. jitter=off: on vs off +0." in out


VARIANT_EFFECT = 0.05  # the shadow variant's true effect in the paired store


@pytest.fixture(scope="module")
def paired(tmp_path_factory):
    """Shadow scoring on 12 prompts whose mean losses spread over 2 nats: per prompt two primaries
    (variant int4, a `batch` label x / y that changes nothing) and their shadows (variant int4-j, +0.05
    nats, `shadow_of` the primary): the same tokens and base losses within a prompt. A `template` label
    v1 / v3 is constant within each prompt (half of them each, balanced over the spread) and changes
    nothing."""
    prompts, specs = 12, []
    for i in range(prompts):
        spread = 2.0 * i / (prompts - 1)  # the prompt's own difficulty
        for b, batch in enumerate(("x", "y")):
            primary, labels = 1 + 4 * i + 2 * b, {"batch": batch, "template": ("v1", "v3")[i % 4 in (1, 2)]}
            shadow = {"variant": "int4-j", "shadow_of": primary, **labels}
            specs.append(sc.RequestSpec(primary, prompt=i, loss_shift=spread,
                                        labels={"variant": "int4", **labels}))  # fmt: skip
            specs.append(sc.RequestSpec(primary + 1, prompt=i, model_id="smollm2-j", shadow=True,
                                        loss_shift=spread + VARIANT_EFFECT, labels=shadow))  # fmt: skip
    path = tmp_path_factory.mktemp("paired") / "p.duckdb"
    with DuckDBStore(path) as store:
        store.append(sc.tables(5, specs, 16, noise=0.15))
    return path


def test_a_paired_design_is_blocked_by_prompt_and_its_interval_finds_the_variant(paired):
    conn = duckdb.connect(str(paired), read_only=True)
    result = at.attribution(conn, "loss")
    assert (result.design, result.blocks, result.requests) == ("blocked by prompt", 12, 48)
    by = {f.factor: f for f in result.factors}
    variant, batch, template = by["variant"], by["batch"], by["template"]
    assert (variant.level, variant.reference) == ("int4-j", "int4")
    assert variant.ci[0] > 0 and variant.ci[0] < VARIANT_EFFECT < variant.ci[1] and variant.significant
    assert variant.note == "" and batch.note == ""  # both vary within prompts: fitted within them
    assert batch.ci[0] < 0 < batch.ci[1] and not batch.significant and abs(batch.effect) < variant.effect
    # the template is constant within each prompt: the blocks absorb it, so it is fitted between
    # prompts (their 2-nat spread is its noise) and says so
    assert template.note == "between prompts: constant within each prompt, so not blocked"
    assert template.ci[0] < 0 < template.ci[1] and not template.significant
    assert "blocked by prompt (12 prompts with 2+ requests)" in at.summary(result)
    # the same data with requests as units: the prompts' 2-nat spread swamps the +0.05
    plain = at.attribution(conn, "loss", block_on_prompt=False)
    assert plain.design == "requests" and plain.blocks == 0
    unblocked = next(f for f in plain.factors if f.factor == "variant")
    assert unblocked.ci[0] < 0 < unblocked.ci[1] and not unblocked.significant
    assert unblocked.ci[1] - unblocked.ci[0] > 5 * (variant.ci[1] - variant.ci[0])


def test_without_repeated_prompts_the_design_stays_on_requests(tmp_path):
    """Every request on its own trace: no block has two requests, so nothing changes (the same numbers
    as with blocking off). Then the served requests' caller-given traces get prompt hashes, two
    requests (a, b) per prompt, as a mirror's two servers record them: 12 blocks."""
    specs = [sc.RequestSpec(i + 1, prompt=i, labels={"variant": "ab"[i % 2]}, loss_shift=0.3 * (i % 2),
                            finish_reason="stop") for i in range(24)]  # fmt: skip
    path = tmp_path / "single.duckdb"
    with DuckDBStore(path) as store:
        store.append(sc.tables(6, specs, 8, noise=0.1))
    with duckdb.connect(str(path), read_only=True) as conn:
        result, plain = at.attribution(conn, "loss"), at.attribution(conn, "loss", block_on_prompt=False)
    assert (result.design, result.blocks) == ("requests", 0)
    assert [(f.factor, f.effect, f.ci) for f in result.factors] == [
        (f.factor, f.effect, f.ci) for f in plain.factors
    ]
    assert "blocked" not in at.summary(result) and "bootstrap over requests" in at.summary(result)
    with duckdb.connect(str(path)) as conn:
        conn.execute("UPDATE request_events SET trace_from_caller = true,"
                     " prompt_hash = printf('%016x', (request_seq - 1) // 2)")  # fmt: skip
        result = at.attribution(conn, "loss")
    assert (result.design, result.blocks, result.requests) == ("blocked by prompt", 12, 24)
    assert result.factors[0].factor == "variant" and result.factors[0].note == ""  # fitted within blocks
