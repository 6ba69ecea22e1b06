"""Layer streams beyond attention (MLP output variance, kind 2), their module names, the anomaly
correlation matrix and root cause (llmobs.publisher.layers, llmobs.diagnostics.correlation/rootcause).

MLP variance is checked against a reference computed by hand from the tiny GPT-2's own MLP on the
hidden states of an independent forward pass; correlation and root cause on a DuckDB store crafted
with one stream that moves exactly with the anomalies."""

from __future__ import annotations

import os

import duckdb
import llmobs
import numpy as np
import pytest
import torch
from llmobs.diagnostics.correlation import correlation_matrix
from llmobs.diagnostics.rootcause import root_cause
from llmobs.pipeline import Pipeline
from llmobs.pipeline.sources import ShmSource
from llmobs.publisher.layers import LayerStreams, MlpVariance, mlp_modules
from llmobs.shm import layout
from llmobs.shm.names import parse_module_name
from llmobs.shm.reader import ShmReader
from llmobs.store import schema
from llmobs.store.sink import DuckDBStore
from publisher_fixtures import isolated_writer, tiny_gpt2

PROMPT_LEN, NEW_TOKENS = 5, 6


@pytest.fixture
def shm(tmp_path):
    yield from isolated_writer(tmp_path)


def _tiny():
    return tiny_gpt2(initializer_range=0.5)


def _by_hand(model, ids) -> np.ndarray:
    """[L, B]: per layer, the population variance over the 64 hidden dims of mlp(ln_2(h + attn)) at the
    last position, each block recomputed here from its parts (no hooks)."""
    out = []
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states  # input of each block
        for i, block in enumerate(model.transformer.h):
            h = hidden[i]
            attn = block.attn(block.ln_1(h))[0]
            mlp_out = block.mlp(block.ln_2(h + attn))[:, -1, :].double()
            mean = mlp_out.sum(-1, keepdim=True) / mlp_out.shape[-1]
            out.append((((mlp_out - mean) ** 2).sum(-1) / mlp_out.shape[-1]).numpy())
    return np.stack(out)


def _read(tmp_path):
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as r:
        steps = r.read_steps(0)
        return r.read_layers(0), steps, dict(r.names)


def test_mlp_variance_matches_a_reference_computed_by_hand(shm):
    model = _tiny()
    inst = llmobs.instrument(model, model_id="tiny", mlp_variance=MlpVariance(every=2))
    torch.manual_seed(1)
    ids = torch.randint(1, 256, (2, PROMPT_LEN))
    seqs = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0)  # fmt: skip
    layers, steps, names = _read(shm)
    inst.remove()
    assert inst.attention is None  # only the MLP stream was asked for
    assert sorted(set(layers.columns["step_seq"].tolist())) == [2, 4, 6]
    assert set(layers.columns["kind"].tolist()) == {layout.LAYER_MLP_VARIANCE}
    reference = _tiny()
    values = []
    for s in (2, 4, 6):
        expected = _by_hand(reference, seqs[:, : PROMPT_LEN + s - 1])
        at = layers.columns["step_seq"] == s
        got = np.full(expected.shape, np.nan)
        for layer, row, value in zip(layers.columns["layer"][at], layers.columns["batch_row"][at],
                                     layers.columns["value"][at], strict=True):  # fmt: skip
            got[layer, row] = value
        np.testing.assert_allclose(got, expected, rtol=2e-5)
        values.append(expected.ravel())
    assert np.ptp(np.concatenate(values)) > 0.01 * np.max(np.concatenate(values))  # rows/layers differ
    modules = sorted(filter(None, (parse_module_name(t) for t in names.values())))
    assert modules == [(2, 0, "transformer.h.0.mlp"), (2, 1, "transformer.h.1.mlp")]


def test_a_layer_read_with_nothing_new_reads_nothing_and_a_restarted_writer_is_still_caught(shm):
    """read_layers at the head returns no rows and the same cursor (the fast path of a target without
    layer streams) with the columns the full path gives; a cursor past the head is still an error."""
    model = _tiny()
    inst = llmobs.instrument(model, model_id="tiny", mlp_variance=MlpVariance(every=1))
    model.generate(torch.randint(1, 256, (1, PROMPT_LEN)), max_new_tokens=2, min_new_tokens=2,
                   do_sample=False, pad_token_id=0)  # fmt: skip
    inst.remove()
    from llmobs.shm.reader import MalformedMap

    with ShmReader(os.getpid(), shm_dir=str(shm)) as r:
        full = r.read_layers(0)
        assert len(full) > 0
        again = r.read_layers(full.next_cursor)
        assert len(again) == 0 and again.next_cursor == full.next_cursor and again.lost == again.corrupt == 0
        assert {k: (type(v), getattr(v, "dtype", None)) for k, v in again.columns.items()} == {
            k: (type(v), getattr(v, "dtype", None)) for k, v in full.columns.items()}  # fmt: skip
        with pytest.raises(MalformedMap, match="writer restarted"):
            r.read_layers(full.next_cursor + 1)


def test_layer_streams_policy_switches_both_and_unsampled_passes_install_nothing(shm):
    model = _tiny()
    inst = llmobs.instrument(model, model_id="tiny", layer_streams=LayerStreams(every=3))
    mlps = [m for _, m in mlp_modules(model)]
    seen_hooks = []

    def count_hooks(module, args, kwargs):
        seen_hooks.append(sum(len(m._forward_hooks) for m in mlps))

    model.register_forward_pre_hook(count_hooks, with_kwargs=True)  # runs after instrument's pre-hook
    torch.manual_seed(1)
    model.generate(torch.randint(1, 256, (1, PROMPT_LEN)), max_new_tokens=NEW_TOKENS,
                   min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)  # fmt: skip
    layers, _, names = _read(shm)
    inst.remove()
    assert seen_hooks == [0, 0, 2, 0, 0, 2]  # hooks only on the sampled passes (step_seq 3 and 6)
    assert all(not m._forward_hooks for m in mlps)
    kinds = {
        (int(s), int(k)) for s, k in zip(layers.columns["step_seq"], layers.columns["kind"], strict=True)
    }
    assert kinds == {(3, 1), (3, 2), (6, 1), (6, 2)}
    modules = {parse_module_name(t) for t in names.values()} - {None}
    assert (1, 1, "transformer.h.1.attn") in modules and (2, 0, "transformer.h.0.mlp") in modules
    with pytest.raises(ValueError):
        LayerStreams(every=0)
    with pytest.raises(TypeError):
        llmobs.instrument(_tiny(), layer_streams="often")


def test_the_pipeline_stores_mlp_streams_and_their_module_names(shm, tmp_path):
    model = _tiny()
    inst = llmobs.instrument(model, model_id="tiny", layer_streams=2)
    model.generate(torch.randint(1, 256, (2, PROMPT_LEN)), max_new_tokens=4, min_new_tokens=4,
                   do_sample=False, pad_token_id=0)  # fmt: skip
    inst.remove()
    pid = os.getpid()
    pipeline = Pipeline(DuckDBStore(tmp_path / "s.duckdb"), pid, owns_store=True, snapshot=False,
                        shm=ShmSource(pid, shm_dir=str(shm)))  # fmt: skip
    pipeline.poll()
    pipeline.close()
    with DuckDBStore(tmp_path / "s.duckdb", read_only=True) as store:
        conn = store.connection
        modules = conn.execute(
            "SELECT kind, layer, module FROM layer_modules ORDER BY kind, layer"
        ).fetchall()
        per_kind = conn.execute(
            "SELECT kind, count(*) FROM layer_streams GROUP BY kind ORDER BY kind"
        ).fetchall()
    assert modules == [(1, 0, "transformer.h.0.attn"), (1, 1, "transformer.h.1.attn"),
                       (2, 0, "transformer.h.0.mlp"), (2, 1, "transformer.h.1.mlp")]  # fmt: skip
    assert per_kind == [(1, 2 * 2 * 2), (2, 2 * 2 * 2)]  # 2 sampled steps x 2 layers x 2 rows, each kind


# --- correlation matrix and root cause on a crafted store -------------------------------------------

PID, STEPS, ANOMALOUS = 4242, 80, (12, 30, 47, 66)
TRACE = "ab" * 16


def _crafted(path, cause=(2, 2), downstream: float = 0.0):
    """A store: 4 layers x (attention entropy, MLP variance), one row per step; the `cause` stream
    (kind, layer) jumps on exactly the anomalous steps, every other stream is noise; with downstream
    > 0 the next layer's MLP variance jumps too, by that factor of the cause's jump."""
    rng = np.random.default_rng(7)
    conn = duckdb.connect(str(path))
    schema.migrate(conn)
    rows = []
    for step in range(1, STEPS + 1):
        for kind in (1, 2):
            for layer in range(4):
                value = 1.0 + 0.05 * rng.standard_normal()
                if step in ANOMALOUS and (kind, layer) == cause:
                    value += 2.0
                if step in ANOMALOUS and downstream and (kind, layer) == (cause[0], cause[1] + 1):
                    value += 2.0 * downstream
                rows.append((PID, step, TRACE, 0, layer, -1, kind, value, step))
    conn.executemany("INSERT INTO layer_streams VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    for step in ANOMALOUS:
        conn.execute(
            "INSERT INTO anomalies (ts_ns, pid, step_seq, trace_id, kind, score) VALUES (?, ?, ?, ?, ?, ?)",
            [step, PID, step, TRACE, "loss_mad", 9.0],
        )
    for kind, what in ((1, "self_attn"), (2, "mlp")):
        for layer in range(4):
            conn.execute("INSERT INTO layer_modules VALUES (?, ?, ?, ?, 0)",
                         [PID, kind, layer, f"model.layers.{layer}.{what}"])  # fmt: skip
    return conn


def test_the_stream_that_moves_with_the_anomalies_tops_the_matrix(tmp_path):
    conn = _crafted(tmp_path / "c.duckdb")
    matrix = correlation_matrix(conn, PID)
    assert len(matrix) == 8
    top = matrix[0]
    assert (top.kind, top.layer, top.module) == (2, 2, "model.layers.2.mlp")
    assert top.n == STEPS and top.n_anomalous == len(ANOMALOUS)
    assert top.r > 0.95 and top.d > 4  # d in units of the whole stream's sd, spikes included
    assert all(abs(m.r) < 0.5 for m in matrix[1:])
    conn.execute("DELETE FROM anomalies")
    assert all(m.r is None and m.n_anomalous == 0 for m in correlation_matrix(conn, PID))


def test_root_cause_names_the_module_that_moves_with_the_anomalies(tmp_path):
    conn = _crafted(tmp_path / "c.duckdb", cause=(1, 1))
    cause = root_cause(conn, PID, ANOMALOUS[2], TRACE)
    assert cause is not None and cause.module == "model.layers.1.self_attn"
    assert cause.kind == 1 and cause.layer == 1 and cause.z > 10 and cause.r > 0.95
    assert "model.layers.1.self_attn" in cause.evidence[0] and "robust z" in cause.evidence[0]
    assert root_cause(conn, PID, 10_000, TRACE) is None  # no streams on that step
    assert root_cause(conn, 1, ANOMALOUS[2], TRACE) is None  # another process


def test_root_cause_prefers_the_upstream_layer_when_the_fault_propagates(tmp_path):
    # the layer after the cause deviates 1.5x as much (a grown residual stream): still the cause is named
    conn = _crafted(tmp_path / "c.duckdb", cause=(2, 1), downstream=1.5)
    cause = root_cause(conn, PID, ANOMALOUS[1], TRACE)
    assert cause.module == "model.layers.1.mlp"
    assert any("model.layers.2.mlp" in line for line in cause.evidence)


def test_query_prints_the_anomaly_correlation_matrix(tmp_path, capsys):
    from llmobs.cli import main

    _crafted(tmp_path / "c.duckdb").close()
    assert (
        main(["query", "--db", str(tmp_path / "c.duckdb"), "--anomaly-correlation", "--format", "csv"]) == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split(",")[:5] == ["kind", "stream", "layer", "head", "module"]
    assert lines[1].split(",")[:5] == ["2", "mlp_variance", "2", "-1", "model.layers.2.mlp"]
