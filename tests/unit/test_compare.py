"""`llmobs-agent compare` on real DuckDB stores with known effects: pairing, metrics, intervals, errors."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from llmobs.cli import main
from llmobs.diagnostics import compare as cmp
from llmobs.errors import ExitCode
from llmobs.store import synthetic_compare as sc
from llmobs.store import views
from llmobs.store.sink import DuckDBStore

PAIRS, TOKENS, SHIFT = 60, 16, 0.2


@pytest.fixture(scope="module")
def shadow_db(tmp_path_factory):
    path = tmp_path_factory.mktemp("compare") / "shadow.duckdb"
    with DuckDBStore(path) as store:
        store.append(sc.shadow_pairs(PAIRS, TOKENS, shift=SHIFT))
    return path


def _compare(capsys, *argv) -> tuple[int, str, str]:
    code = main(["compare", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_shadow_pairs_flag_the_loss_shift_on_the_same_tokens(shadow_db, capsys):
    code, out, _ = _compare(
        capsys, "--db", str(shadow_db), "--a", "variant:fp32", "--b", "variant:q4-jitter", "--format", "json"
    )
    assert code == 0
    result = json.loads(out)
    assert result["pairs"] == {"pairs": PAIRS, "by": {"shadow": PAIRS}, "token_pairs": PAIRS * TOKENS}
    loss = next(m for m in result["metrics"] if m["name"] == "loss")
    truth = (
        duckdb.connect(str(shadow_db), read_only=True)
        .execute("SELECT avg(loss) FILTER (NOT shadow), avg(loss) FILTER (shadow) FROM token_steps")
        .fetchall()[0]
    )
    assert loss["a"] == pytest.approx(truth[0], rel=1e-6) and loss["b"] == pytest.approx(truth[1], rel=1e-6)
    assert loss["ci"][0] < loss["diff"] < loss["ci"][1] and loss["ci"][0] < SHIFT < loss["ci"][1]
    assert loss["ci"][0] > 0 and loss["flagged"] and loss["p"] == 0.0
    for name in ("ttft", "tpot_p50", "tpot_p99"):  # a shadow's latency is its scoring pass: not compared
        latency = next(m for m in result["metrics"] if m["name"] == name)
        assert (latency["diff"], latency["pairs"], latency["flagged"]) == (None, 0, False)


def test_the_bootstrap_is_deterministic_and_centred(shadow_db):
    a, b = cmp.parse_selector("variant:fp32"), cmp.parse_selector("variant:q4-jitter")
    one = cmp.compare(shadow_db, a, b, metrics=("loss",), resamples=500)
    two = cmp.compare(shadow_db, a, b, metrics=("loss",), resamples=500)
    assert one.metrics[0].ci == two.metrics[0].ci  # fixed seed
    other = cmp.compare(shadow_db, a, b, metrics=("loss",), resamples=500, seed=1)
    assert other.metrics[0].ci != one.metrics[0].ci
    w = cmp.bootstrap_weights(1000, 400, 0)
    assert w.shape == (1000, 400) and abs(w.mean() - 1) < 0.01 and abs(w.var() - 1) < 0.02  # Poisson(1)


def test_windowed_quantiles_equal_the_full_cumulative_count():
    rng = np.random.default_rng(3)
    values = rng.gamma(2.0, 1.0, size=500)
    w = cmp.bootstrap_weights(500, 300, 4)
    points, reps = cmp._weighted_quantiles(values, w, (0.5, 0.95, 0.99))
    v = np.sort(values)
    assert list(points) == [v[249], v[474], v[494]]  # inverted CDF: the ceil(q n)-th smallest
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(w[order].astype(np.int64), axis=0)
    for i, q in enumerate((0.5, 0.95, 0.99)):
        k = (cum < q * cum[-1]).sum(axis=0)
        assert np.array_equal(reps[i], v[np.minimum(k, 499)])


def test_prompt_pairs_across_stores_served_metrics_and_work(tmp_path, capsys):
    """Two stores (store: selector), same prompts, different tokens: loss per request by prompt; TTFT,
    time per token, error rate from request_events; allocations per token from pass_shares."""
    a_specs, b_specs = [], []
    for i in range(40):
        a_specs.append(
            sc.RequestSpec(
                i + 1,
                prompt=i,
                labels={"variant": "lora"},
                latency_ns=2_000_000,
                finish_reason="stop",
                allocations_per_token=10,
            )
        )
        b_specs.append(
            sc.RequestSpec(
                i + 1,
                prompt=i,
                labels={"variant": "qlora"},
                latency_ns=3_000_000,
                finish_reason="error" if i % 4 == 0 else "stop",
                allocations_per_token=12,
            )
        )
    a_db, b_db = tmp_path / "a.duckdb", tmp_path / "b.duckdb"
    with DuckDBStore(a_db) as store:
        store.append(sc.tables(1, a_specs, 8, seed=1))
    with DuckDBStore(b_db) as store:
        b = sc.tables(1, b_specs, 8, seed=1)
        steps = b["token_steps"]  # other tokens: no token pairs, only prompts
        i = steps.schema.get_field_index("target_id")
        b["token_steps"] = steps.set_column(i, "target_id", pa.array(steps["target_id"].to_numpy() + 1))
        store.append(b)
    code, out, _ = _compare(
        capsys,
        "--db",
        str(a_db),
        "--a",
        "variant:lora",
        "--b",
        f"store:{b_db},variant:qlora",
        "--format",
        "json",
    )
    assert code == 0
    result = json.loads(out)
    assert result["pairs"] == {"pairs": 40, "by": {"prompt": 40}, "token_pairs": 0}
    metrics = {m["name"]: m for m in result["metrics"]}
    assert metrics["loss"]["basis"].startswith("per-request mean loss, 40 pairs")
    assert metrics["loss"]["diff"] == pytest.approx(0, abs=1e-6)  # same base losses and noise seed
    assert metrics["tpot_p50"]["a"] == pytest.approx(2.001) and metrics["tpot_p50"]["b"] == pytest.approx(
        3.001
    )
    assert metrics["tpot_p99"]["flagged"] and metrics["tpot_p99"]["ci"] == [pytest.approx(1.0)] * 2
    assert metrics["error_rate"]["a"] == 0 and metrics["error_rate"]["b"] == 0.25
    assert metrics["error_rate"]["flagged"]
    assert metrics["allocations_per_token"]["a"] == 10 and metrics["allocations_per_token"]["b"] == 12
    assert metrics["gpu_per_token"]["a"] == pytest.approx(2 * 4 / 3 / 8 + 2 * 7 / 3 / 8, rel=1e-3)


def test_png_of_the_per_token_difference(shadow_db, tmp_path, capsys):
    png = tmp_path / "diff.png"
    code, out, _ = _compare(
        capsys,
        "--db",
        str(shadow_db),
        "--a",
        "variant:fp32",
        "--b",
        "variant:q4-jitter",
        "--metric",
        "loss",
        "--png",
        str(png),
    )
    assert code == 0 and f"png: {png}" in out and "FLAG" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("a", "b", "code", "message"),
    [
        (
            "variant:fp32",
            "variant:nope",
            ExitCode.NO_MATCH,
            "error: no request matches B (variant:nope): A 'variant:fp32' matched 60 request(s),"
            " B 'variant:nope'"
            " matched 0",
        ),
        (
            "label:template=v9",
            "variant:nope",
            ExitCode.NO_MATCH,
            "error: no request matches A (label:template=v9) and B (variant:nope):"
            " A 'label:template=v9' matched 0"
            " request(s), B 'variant:nope' matched 0",
        ),
        (
            "variant:fp32",
            "variant:fp32,label:template=v3",
            ExitCode.NO_PAIRS,
            "error: A 'variant:fp32' matched 60 request(s) and B 'variant:fp32,label:template=v3' matched 30,"
            " but"
            " none of A pairs with one of B (no common prompt or shadow)",
        ),
        (
            "variant:fp32",
            "colour:red",
            ExitCode.USAGE,
            "error: selector 'colour:red': 'colour:red' is not KIND:VALUE",
        ),
        (
            "time:-5m",
            "variant:x",
            ExitCode.USAGE,
            "error: selector 'time:-5m': time needs START..END, not '-5m'",
        ),
    ],
)
def test_errors_are_one_line_with_their_exit_code(shadow_db, capsys, a, b, code, message):
    got, out, err = _compare(capsys, "--db", str(shadow_db), "--a", a, "--b", b)
    lines = err.strip().splitlines()
    assert got == code and out == "" and len(lines) == 2
    assert lines[0] == message and lines[1].startswith("hint: ")


def test_time_selector_relative_to_the_stores_newest_request(shadow_db, capsys):
    code, out, _ = _compare(
        capsys,
        "--db",
        str(shadow_db),
        "--a",
        "variant:fp32,time:-1h..",
        "--b",
        "variant:q4-jitter,time:..0",
        "--metric",
        "loss",
    )
    assert code == ExitCode.NO_MATCH  # every request started after monotonic 0 ns: B is empty


def test_request_variants_view_uses_the_label_else_the_model(tmp_path):
    specs = [
        sc.RequestSpec(1, prompt=1, model_id="m1", labels={"variant": "lora"}),
        sc.RequestSpec(2, prompt=2, model_id="m2"),
    ]
    path = tmp_path / "v.duckdb"
    with DuckDBStore(path) as store:
        store.append(sc.tables(5, specs, 2))
        rows = store.connection.execute(f"SELECT * FROM ({views.request_variants()}) ORDER BY 2").fetchall()
    assert rows == [(5, 1, sc.prompt_trace(1), "lora", "m1"), (5, 2, sc.prompt_trace(2), "m2", "m2")]


def test_by_intent_pairs_paraphrases_that_share_no_prompt(tmp_path, capsys):
    """Different prompts (trace ids), the same intent: paired only with --by-intent, each with the B
    request of its own intent cluster (3 of B's intents match nothing in A: 7 pairs, not 10)."""
    specs = [sc.RequestSpec(i + 1, prompt=i, labels={"variant": "v2"}) for i in range(10)]
    specs += [sc.RequestSpec(20 + i, prompt=100 + i, labels={"variant": "v3"}) for i in range(10)]
    path = tmp_path / "intent.duckdb"
    with DuckDBStore(path) as store:
        store.append(sc.tables(2, specs, 6))
        rows = []
        for i in range(10):
            minhash = f"{i:04x}" * 36  # MINHASH_K u16 values (docs/shm-abi.md)
            rows.append((2, i + 1, sc.prompt_trace(i), f"t{i}", i, minhash, f"act{i}", "json", "", 1))
            action = f"act{i}" if i < 7 else f"other{i}"
            rows.append((2, 20 + i, sc.prompt_trace(100 + i), f"t{i}", i, minhash, action, "json", "", 1))
        store.connection.executemany(
            "INSERT INTO request_intents VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows
        )
    argv = (
        "--db",
        str(path),
        "--a",
        "variant:v2",
        "--b",
        "variant:v3",
        "--metric",
        "loss",
        "--format",
        "json",
    )
    assert _compare(capsys, *argv)[0] == ExitCode.NO_PAIRS
    code, out, err = _compare(capsys, *argv, "--by-intent")
    assert err == ""
    assert code == 0 and json.loads(out)["pairs"] == {"pairs": 7, "by": {"intent": 7}, "token_pairs": 0}


def test_a_primary_without_targets_pairs_on_its_chosen_tokens(tmp_path):
    """A primary step with no target (target_id -1: a served decode) pairs with the shadow's step whose
    target is the primary's token (token_id)."""
    tables = sc.shadow_pairs(10, 4, shift=0.1)
    steps = tables["token_steps"]
    primary = np.logical_not(steps["shadow"].to_numpy(zero_copy_only=False))
    target = np.where(primary, -1, steps["target_id"].to_numpy())
    i = steps.schema.get_field_index("target_id")
    tables["token_steps"] = steps.set_column(i, "target_id", pa.array(target.astype(np.int32)))
    path = tmp_path / "served.duckdb"
    with DuckDBStore(path) as store:
        store.append(tables)
    result = cmp.compare(path, cmp.parse_selector("variant:fp32"), cmp.parse_selector("variant:q4-jitter"),
                         metrics=("loss",), resamples=200)  # fmt: skip
    assert result.pairs["token_pairs"] == 40 and result.metrics[0].basis == "40 paired tokens in 10 pairs"


def test_pairs_of_one_prompt_are_resampled_together(tmp_path):
    """A prompt sent twice (or under two labels that change nothing: greedy decoding gives the same
    tokens) is one observation, not two: the bootstrap draws prompts, each with all its pairs. The same
    prompts once each, or each twice with identical tokens, give the same point and the same interval."""

    def store(copies: int) -> Path:
        specs = []
        for prompt in range(12):
            for copy in range(copies):
                seq = 1 + 2 * (prompt * copies + copy)
                shift = 0.05 * (prompt % 4)  # B - A differs from prompt to prompt: a real interval
                specs.append(sc.RequestSpec(seq, prompt=prompt, labels={"variant": "a"}))
                specs.append(sc.RequestSpec(seq + 1, prompt=prompt, shadow=True, loss_shift=shift,
                                            labels={"variant": "b", "shadow_of": seq}))  # fmt: skip
        path = tmp_path / f"x{copies}.duckdb"
        with DuckDBStore(path) as s:
            s.append(sc.tables(7, specs, 8, noise=0.0))
        return path

    a, b = cmp.parse_selector("variant:a"), cmp.parse_selector("variant:b")
    once = cmp.compare(store(1), a, b, metrics=("loss",), resamples=400)
    twice = cmp.compare(store(2), a, b, metrics=("loss",), resamples=400)
    assert (once.pairs["pairs"], twice.pairs["pairs"]) == (12, 24)
    assert once.bootstrap["clusters"] == twice.bootstrap["clusters"] == 12
    one, two = once.metrics[0], twice.metrics[0]
    assert two.diff == pytest.approx(one.diff, abs=1e-9) and two.ci == pytest.approx(one.ci, abs=1e-6)
    assert one.ci[0] < one.diff < one.ci[1]
