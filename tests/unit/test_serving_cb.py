"""Continuous batching (transformers' ContinuousBatchingManager, the real engine on the CPU): every
generated token of every request is a token step of its own request, with its own step index, position
and a loss equal to an independent teacher-forced recomputation; mixed passes, prefill chunks, prefix
sharing, cancellation and a failing forward."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import llmobs  # noqa: E402
from llmobs.publisher import request as publisher  # noqa: E402
from llmobs.shm.hashing import trace_hex, trace_id, trace_words  # noqa: E402
from llmobs.shm.reader import ShmReader  # noqa: E402

from tests.unit.publisher_fixtures import isolated_writer  # noqa: E402

pytestmark = pytest.mark.unit
TIMEOUT_S = 120  # the engine thread answers within this (a hung engine fails the test, it never sleeps it)


@pytest.fixture
def shm(tmp_path):
    yield from isolated_writer(tmp_path)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)  # fmt: skip
    config._attn_implementation = "sdpa"  # paged SDPA: the continuous-batching path that runs on a CPU
    return LlamaForCausalLM(config).eval()


def _configs(max_new_tokens: int, **cb):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    return gen, ContinuousBatchingConfig(**cb)


def _read(shm_dir):
    with ShmReader(os.getpid(), shm_dir=str(shm_dir)) as r:
        steps = r.read_steps(0)
        events = r.read_request_events(0)
    assert steps.lost == 0 and steps.corrupt == 0 and events.corrupt == 0
    return steps.rows(), [{k: events.columns[k][i] for k in events.columns} for i in range(len(events))]


def _by_request(rows):
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(row["request_id"], []).append(row)
    return out


def _teacher_forced_losses(model, prompt, generated) -> np.ndarray:
    """-log p(generated[k] | prompt + generated[:k]) from one ordinary forward pass (no paged cache)."""
    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    p = len(prompt)
    return np.array([-lp[p - 1 + k, t].item() for k, t in enumerate(generated)])


def _check_request(model, steps, prompt, generated):
    """The token steps of one request: consecutive step index, positions, its trace id, its tokens, and
    losses equal to the independent recomputation."""
    steps = sorted(steps, key=lambda r: r["step"])
    assert [r["step"] for r in steps] == list(range(len(generated)))
    assert [r["token_id"] for r in steps] == list(generated)
    assert [r["position"] for r in steps] == [len(prompt) + k for k in range(len(generated))]
    assert {r["trace_id"] for r in steps} == {trace_hex(*trace_words(trace_id(prompt)))}
    assert all(r["tokens_in_pass"] == 1 for r in steps[1:])
    assert [r["step_seq"] for r in steps] == sorted({r["step_seq"] for r in steps})  # one step per pass
    np.testing.assert_allclose([r["loss"] for r in steps], _teacher_forced_losses(model, prompt, generated),
                               atol=1e-4, rtol=0)  # fmt: skip


def test_generate_batch_publishes_every_token_of_every_request(shm):
    model = tiny_llama()
    llmobs.instrument(model, model_id="tiny-llama")
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    gen, cb = _configs(6)
    errors = publisher.errors
    with llmobs.context(tenant="acme", session="s1"):
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    assert publisher.errors == errors
    rows, events = _read(shm)
    assert len(rows) == sum(len(o.generated_tokens) for o in out.values()) == 18
    by_request = _by_request(rows)
    for request_id, result in out.items():
        _check_request(model, by_request[request_id], result.prompt_ids, result.generated_tokens)
        first = min(by_request[request_id], key=lambda r: r["step"])
        assert first["tokens_in_pass"] == len(result.prompt_ids) and first["kv_len"] == 0
    assert {(r["tenant"], r["session"], r["model_id"]) for r in rows} == {("acme", "s1", "tiny-llama")}
    ends = {e["request_id"]: e for e in events if e["kind"] == "end"}
    assert set(ends) == set(out)
    for request_id, e in ends.items():
        assert e["decoded_tokens"] == 6 and e["finish_reason"] == "length" and e["kv_blocks"] >= 1
        assert e["prompt_tokens"] == e["prefill_tokens"] == len(out[request_id].prompt_ids)
        assert 0 <= e["queue_ns"] <= e["ttft_ns"] and e["tpot_ns"] > 0


def test_the_store_takes_the_new_columns_and_request_events(shm, tmp_path):
    """What the reader decodes appends to the store as it is (migration 8), and the rows of a pass
    (token steps + prefill chunks) carry the tokens its compute is apportioned by."""
    from llmobs.store.sink import DuckDBStore

    model = tiny_llama()
    llmobs.instrument(model, model_id="tiny-llama")
    gen, cb = _configs(3, page_size=4, max_batch_tokens=6, num_blocks=64)
    with llmobs.context(tenant="t1"):
        model.generate_batch(
            [list(range(1, 10)), [40, 41]], generation_config=gen, continuous_batching_config=cb
        )
    with ShmReader(os.getpid(), shm_dir=str(shm)) as r:
        steps, events = r.read_steps(0), r.read_request_events(0)
    store = DuckDBStore(tmp_path / "s.duckdb")
    try:
        written = store.append({"token_steps": steps.columns, "request_events": events.columns})
        assert written == {"token_steps": 6, "request_events": len(events)}
        per_request = store.query(
            "SELECT request_id, count(*), min(step), max(step), sum(tokens_in_pass) FILTER (step > 0) "
            "FROM token_steps GROUP BY request_id ORDER BY request_id").to_pylist()  # fmt: skip
        assert [tuple(r.values()) for r in per_request] == [("req_0", 3, 0, 2, 2), ("req_1", 3, 0, 2, 2)]
        prefilled = store.query(
            "SELECT request_id, sum(t) FROM (SELECT request_id, tokens_in_pass AS t FROM token_steps WHERE "
            "step = 0 UNION ALL SELECT request_id, prefill_tokens FROM request_events WHERE kind = 'chunk') "
            "GROUP BY request_id ORDER BY request_id").to_pylist()  # fmt: skip
        assert [tuple(r.values()) for r in prefilled] == [("req_0", 9), ("req_1", 2)]
        ends = store.query(
            "SELECT request_id, decoded_tokens, prompt_tokens, prefill_tokens, finish_reason, tenant "
            "FROM request_events WHERE kind = 'end' ORDER BY request_id").to_pylist()  # fmt: skip
        assert [tuple(r.values()) for r in ends] == [("req_0", 3, 9, 9, "length", "t1"),
                                                     ("req_1", 3, 2, 2, "length", "t1")]  # fmt: skip
        # every pass: its rows' tokens (token steps + chunks) never exceed the 6-token batch budget
        over = store.query(
            "SELECT step_seq, sum(t) FROM (SELECT step_seq, tokens_in_pass AS t FROM token_steps UNION ALL "
            "SELECT step_seq, prefill_tokens FROM request_events WHERE kind = 'chunk') GROUP BY step_seq "
            "HAVING sum(t) > 6").to_pylist()  # fmt: skip
        assert over == []
    finally:
        store.close()


def test_requests_added_mid_batch_from_two_tenants(shm):
    """Requests from two client threads under their own llmobs.context, the second pair added while the
    first is decoding; prompts longer than the batch budget are prefilled in chunks, and a prompt that
    repeats a finished block reuses it (prefix sharing)."""
    model = tiny_llama()
    llmobs.instrument(model, model_id="tiny-llama")
    gen, cb = _configs(8, page_size=4, max_batch_tokens=8, num_blocks=64)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    early = {"a0": list(range(1, 11)), "a1": [20, 21, 22]}
    late = {"b0": list(range(1, 9)) + [50, 51, 52], "b1": [30, 31, 32, 33]}

    def add(tenant, requests, streaming=False):
        with llmobs.context(tenant=tenant, session=f"{tenant}-session"):
            for request_id, prompt in requests.items():
                manager.add_request(prompt, request_id=request_id, streaming=streaming)

    manager.start()
    try:
        client = threading.Thread(target=add, args=("tenant-a", early, True))
        client.start()
        client.join()
        first = manager.get_result(request_id="a0", timeout=TIMEOUT_S)  # a0 is decoding now
        assert first is not None and not first.is_finished()
        client = threading.Thread(target=add, args=("tenant-b", late))
        client.start()
        client.join()
        results = {}
        while len(results) < 4:
            result = manager.get_result(timeout=TIMEOUT_S)
            assert result is not None, "the engine stopped answering"
            if result.is_finished():
                results[result.request_id] = result
    finally:
        manager.stop(block=True)
    rows, events = _read(shm)
    by_request = _by_request(rows)
    prompts = {**early, **late}
    for request_id, result in results.items():
        assert result.error is None
        _check_request(model, by_request[request_id], prompts[request_id], result.generated_tokens)
        tenant = "tenant-a" if request_id in early else "tenant-b"
        assert {(r["tenant"], r["session"]) for r in by_request[request_id]} == {
            (tenant, f"{tenant}-session")
        }
    # the late requests joined passes the early ones were decoding in
    passes: dict[int, set[str]] = {}
    for row in rows:
        passes.setdefault(row["step_seq"], set()).add(row["request_id"])
    assert any(ids & set(early) and ids & set(late) for ids in passes.values())
    first_pass = {rid: min(r["step_seq"] for r in steps) for rid, steps in by_request.items()}
    assert min(first_pass[r] for r in late) > min(first_pass[r] for r in early)
    ends = {e["request_id"]: e for e in events if e["kind"] == "end"}
    chunks = [e for e in events if e["kind"] == "chunk"]
    assert {c["request_id"] for c in chunks} >= {"a0"}  # 10 prompt tokens > the 8-token budget
    for request_id, e in ends.items():
        computed = sum(c["prefill_tokens"] for c in chunks if c["request_id"] == request_id)
        computed += min(by_request[request_id], key=lambda r: r["step"])["tokens_in_pass"]
        assert computed == e["prefill_tokens"] == e["prompt_tokens"] - e["prefix_hit_tokens"]
        assert e["decoded_tokens"] == 8 and e["tenant"] == ("tenant-a" if request_id in early else "tenant-b")
    assert ends["b0"]["prefix_hit_tokens"] == 8  # two 4-token blocks of a0's prompt, shared


def test_cancelled_and_failed_requests_keep_their_committed_steps(shm):
    model = tiny_llama()
    llmobs.instrument(model)
    gen, cb = _configs(200)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    fail = threading.Event()

    def broken_forward(module, args, kwargs):
        if fail.is_set():
            raise RuntimeError("device lost (injected)")

    manager.start()
    try:
        manager.add_request([1, 2, 3], request_id="cancel-me", streaming=True)
        manager.add_request([4, 5, 6], request_id="fail-me", streaming=True)
        seen = {}
        while len(seen) < 2:
            result = manager.get_result(timeout=TIMEOUT_S)
            assert result is not None
            seen[result.request_id] = result
        manager.cancel_request("cancel-me")
        while True:  # fail-me keeps streaming; cancel-me's end comes with the next scheduled pass
            result = manager.get_result(request_id="fail-me", timeout=TIMEOUT_S)
            assert result is not None
            if len(result.generated_tokens) >= 4:
                break
        handle = model.register_forward_pre_hook(broken_forward, with_kwargs=True)
        fail.set()
        while not result.is_finished():
            result = manager.get_result(request_id="fail-me", timeout=TIMEOUT_S)
            assert result is not None
        handle.remove()
    finally:
        manager.stop(block=True)
    assert result.error is not None
    rows, events = _read(shm)
    by_request = _by_request(rows)
    ends = {e["request_id"]: e for e in events if e["kind"] == "end"}
    assert ends["cancel-me"]["finish_reason"] == "cancelled"
    assert ends["fail-me"]["finish_reason"] == "error"
    for request_id in ("cancel-me", "fail-me"):
        steps = sorted(r["step"] for r in by_request[request_id])
        assert steps == list(range(len(steps))) and ends[request_id]["decoded_tokens"] == len(steps) >= 1
    failed = sorted(by_request["fail-me"], key=lambda r: r["step"])
    assert [r["token_id"] for r in failed] == result.generated_tokens[: len(failed)]


def test_instrument_manager_is_idempotent_and_removable(shm):
    model = tiny_llama()
    gen, cb = _configs(2)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    adapter = llmobs.serving.instrument_manager(manager)
    assert llmobs.serving.instrument_manager(manager) is adapter
    put = manager.input_queue.put
    adapter.remove()
    assert manager.input_queue.put != put and "put" not in manager.input_queue.__dict__
    assert getattr(manager, "_llmobs_serving", None) is None
