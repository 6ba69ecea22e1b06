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
