"""Attention entropy per layer (map ABI v2 layer-stream ring): sampled by policy, exact, stored.

The tiny GPT-2 is given large random weights so its attention is far from uniform (a default random
init gives ~ln(K) everywhere, which would hide a wrong row or layer)."""

from __future__ import annotations

import os

import llmobs
import numpy as np
import pytest
import torch
from llmobs.pipeline import Pipeline
from llmobs.pipeline.sources import ShmSource
from llmobs.publisher.attention import AttentionEntropy, as_policy
from llmobs.shm import layout
from llmobs.shm.reader import ShmReader
from llmobs.store.sink import DuckDBStore
from publisher_fixtures import isolated_writer, tiny_gpt2

PROMPT_LEN, NEW_TOKENS = 5, 6


@pytest.fixture
def shm(tmp_path):
    yield from isolated_writer(tmp_path)


def _tiny():
    return tiny_gpt2(initializer_range=0.5)


def _generate(model, batch=2):
    torch.manual_seed(1)
    ids = torch.randint(1, 256, (batch, PROMPT_LEN))
    return model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0)  # fmt: skip


def _expected(model, seqs, step_seq):
    """Independently: the whole sequence so far through an eager copy with output_attentions=True."""
    length = PROMPT_LEN + step_seq - 1  # forward pass k (step_seq k) sees the prompt + k-1 new tokens
    with torch.no_grad():
        out = model(seqs[:, :length], output_attentions=True)
    assert len(out.attentions) == model.config.n_layer
    return torch.stack([torch.special.entr(a[:, :, -1, :]).sum(-1) for a in out.attentions])  # [L, B, H]


def _layers(tmp_path):
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as r:
        return r.read_layers(0), r.read_steps(0)


@pytest.mark.parametrize("per_head", [False, True])
def test_sampled_steps_carry_exact_per_layer_entropy(shm, per_head):
    model = _tiny()
    inst = llmobs.instrument(
        model, model_id="tiny", attention_entropy=AttentionEntropy(every=2, per_head=per_head)
    )
    seqs = _generate(model)
    assert model.config._attn_implementation == "sdpa"  # given back after each sampled pass
    layers, steps = _layers(shm)
    inst.remove()
    assert layers.lost == 0 and layers.corrupt == 0
    assert sorted(set(steps.columns["step_seq"].tolist())) == list(range(1, NEW_TOKENS + 1))
    sampled = sorted(set(layers.columns["step_seq"].tolist()))
    assert sampled == [2, 4, 6]  # step_seq % 2 == 0 only
    eager = _tiny()
    eager.set_attn_implementation("eager")
    spread = []
    for s in sampled:
        expected = _expected(eager, seqs, s)
        if not per_head:
            expected = expected.mean(-1, keepdim=True)
        at = layers.columns["step_seq"] == s
        got = np.full(expected.shape, np.nan, np.float32)
        heads = layers.columns["head"][at]
        for layer, row, head, value in zip(layers.columns["layer"][at], layers.columns["batch_row"][at],
                                           heads, layers.columns["value"][at], strict=True):  # fmt: skip
            got[layer, row, 0 if head == layout.HEAD_MEAN else head] = value
        assert (heads == layout.HEAD_MEAN).all() != per_head
        np.testing.assert_allclose(got, expected.numpy(), atol=1e-5, rtol=0)
        spread.append(expected.numpy().ravel())
    assert np.ptp(np.concatenate(spread)) > 0.1  # attention is not uniform: rows and layers differ
    assert set(layers.columns["kind"].tolist()) == {layout.LAYER_ATTENTION_ENTROPY}
    traces = {t for t in steps.columns["trace_id"]}
    assert set(layers.columns["trace_id"]) == traces and len(traces) == 2


def test_off_by_default_writes_nothing_and_installs_nothing(shm):
    model = _tiny()
    inst = llmobs.instrument(model, model_id="tiny")
    assert inst.attention is None and as_policy(0) is None and as_policy(3) == AttentionEntropy(every=3)
    _generate(model)
    layers, steps = _layers(shm)
    inst.remove()
    assert len(steps) == 2 * NEW_TOKENS and len(layers) == 0
    with ShmReader(os.getpid(), shm_dir=str(shm)) as r:
        assert r.header["layers_head"] == 0 and r.header["layers_dropped"] == 0


def test_forward_with_labels_samples_the_last_position(shm):
    model = _tiny()
    inst = llmobs.instrument(model, model_id="tiny", attention_entropy=1)
    ids = torch.randint(1, 256, (2, 7))
    with torch.no_grad():
        model(ids, labels=ids)
    layers, _ = _layers(shm)
    inst.remove()
    eager = _tiny()
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        out = eager(ids, output_attentions=True)
    expected = torch.stack([torch.special.entr(a[:, :, -1, :]).sum(-1).mean(-1) for a in out.attentions])
    np.testing.assert_allclose(layers.columns["value"], expected.reshape(-1).numpy(), atol=1e-5, rtol=0)


def test_the_store_receives_the_layer_streams_through_the_pipeline(shm, tmp_path):
    model = _tiny()
    inst = llmobs.instrument(model, model_id="tiny", attention_entropy=AttentionEntropy(every=2))
    _generate(model)
    inst.remove()
    pid = os.getpid()
    pipeline = Pipeline(DuckDBStore(tmp_path / "s.duckdb"), pid, owns_store=True, snapshot=False,
                        shm=ShmSource(pid, shm_dir=str(shm)))  # fmt: skip
    pipeline.poll()
    summary = pipeline.close()
    assert summary.rows_by_table["layer_streams"] == 3 * 2 * 2  # 3 sampled steps x 2 layers x 2 rows
    with ShmReader(pid, shm_dir=str(shm)) as r:
        mapped = r.read_layers(0).columns
    with DuckDBStore(tmp_path / "s.duckdb", read_only=True) as store:
        rows = store.connection.execute(
            "SELECT l.step_seq, l.trace_id, l.batch_row, l.layer, l.head, l.kind, l.value, t.token_id"
            " FROM layer_streams l JOIN token_steps t USING (pid, step_seq, batch_row)"
            " ORDER BY l.step_seq, l.layer, l.batch_row"
        ).fetchall()
    assert len(rows) == 12 and all(r[4] == -1 and r[5] == 1 for r in rows)
    order = np.lexsort((mapped["batch_row"], mapped["layer"], mapped["step_seq"]))
    assert [r[0] for r in rows] == mapped["step_seq"][order].tolist()
    assert [r[1] for r in rows] == [mapped["trace_id"][i] for i in order]
    np.testing.assert_array_equal(np.array([r[6] for r in rows], np.float32), mapped["value"][order])


def test_a_version_2_store_is_upgraded_to_3_and_keeps_its_rows(tmp_path):
    import duckdb
    from llmobs.store import schema

    conn = duckdb.connect(str(tmp_path / "v2.duckdb"))
    assert schema.migrate(conn, target=2) == [1, 2]
    conn.execute("INSERT INTO clock_fits VALUES (1, 0, 'realtime', 0, 5, 0, 1, 1, 3)")
    later = list(range(3, schema.LATEST_VERSION + 1))
    assert schema.migrate(conn) == later and schema.current_version(conn) == schema.LATEST_VERSION
    assert conn.execute("SELECT offset_ns FROM clock_fits").fetchall() == [(5,)]
    assert list(schema.table_columns(conn, "layer_streams")) == [
        "pid", "step_seq", "trace_id", "batch_row", "layer", "head", "kind", "value", "ts_ns",
    ]  # fmt: skip
    conn.close()
