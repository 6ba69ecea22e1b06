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

from tests.unit.continuous_batching import (  # noqa: E402
    TIMEOUT_S,
    cb_configs,
    read_map,
    rows_by_request,
    serve_two_tenants,
    teacher_forced_losses,
    tiny_llama,
)
from tests.unit.publisher_fixtures import isolated_writer  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.fixture
def shm(tmp_path):
    yield from isolated_writer(tmp_path)


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
    np.testing.assert_allclose([r["loss"] for r in steps], teacher_forced_losses(model, prompt, generated),
                               atol=1e-4, rtol=0)  # fmt: skip


def test_generate_batch_publishes_every_token_of_every_request(shm):
    model = tiny_llama()
    llmobs.instrument(model, model_id="tiny-llama")
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    gen, cb = cb_configs(6)
    errors = publisher.errors
    with llmobs.context(tenant="acme", session="s1"):
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    assert publisher.errors == errors
    rows, events = read_map(shm)
    assert len(rows) == sum(len(o.generated_tokens) for o in out.values()) == 18
    by_request = rows_by_request(rows)
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
    gen, cb = cb_configs(3, page_size=4, max_batch_tokens=6, num_blocks=64)
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
    gen, cb = cb_configs(8, page_size=4, max_batch_tokens=8, num_blocks=64)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    early = {"a0": list(range(1, 11)), "a1": [20, 21, 22]}
    late = {"b0": list(range(1, 9)) + [50, 51, 52], "b1": [30, 31, 32, 33]}
    first, results = serve_two_tenants(manager, early, late)
    assert not first.is_finished()  # a0 was decoding when the late requests came
    rows, events = read_map(shm)
    by_request = rows_by_request(rows)
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
    gen, cb = cb_configs(200)
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

        def next_of_fail_me():
            # get_result(request_id=...) answers None when another request's output is first in the queue:
            # a token of cancel-me from the pass in flight when it was cancelled may still come, skip it
            while True:
                out = manager.get_result(timeout=TIMEOUT_S)
                assert out is not None, "the engine stopped answering"
                if out.request_id == "fail-me":
                    return out

        while True:  # fail-me keeps streaming; cancel-me's end comes with the next scheduled pass
            result = next_of_fail_me()
            if len(result.generated_tokens) >= 4:
                break
        handle = model.register_forward_pre_hook(broken_forward, with_kwargs=True)
        fail.set()
        while not result.is_finished():
            result = next_of_fail_me()
        handle.remove()
    finally:
        manager.stop(block=True)
    assert result.error is not None
    rows, events = read_map(shm)
    by_request = rows_by_request(rows)
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
    gen, cb = cb_configs(2)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    adapter = llmobs.serving.instrument_manager(manager)
    assert llmobs.serving.instrument_manager(manager) is adapter
    put = manager.input_queue.put
    adapter.remove()
    assert manager.input_queue.put != put and "put" not in manager.input_queue.__dict__
    assert getattr(manager, "_llmobs_serving", None) is None


def test_a_pass_is_published_before_the_engine_delivers_its_tokens(shm):
    """When the engine hands a pass's outputs to the clients, that pass's token steps (and the end record
    of a request it finished) are already in the map: a client that received its last token and then
    stops the agent finds every step of it. Published after the delivery (as before), the last pass
    raced the client: bench.serving counted 252 token steps for 253 tokens the clients received."""
    import queue

    model = tiny_llama()
    llmobs.instrument(model, model_id="tiny-llama")
    gen, cb = cb_configs(5)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    delivered: list[tuple[str, int, bool, int, bool]] = []

    class AtDelivery(queue.Queue):
        """The engine thread puts each output here as it delivers it: what the map holds at that moment."""

        def put(self, item, *args, **kwargs):
            rows, events = read_map(shm)
            steps = sum(r["request_id"] == item.request_id for r in rows)
            ended = any(e["kind"] == "end" and e["request_id"] == item.request_id for e in events)
            delivered.append((item.request_id, len(item.generated_tokens), item.is_finished(), steps, ended))
            super().put(item, *args, **kwargs)

    manager.output_router.output_queue = AtDelivery()
    manager.start()
    try:
        for request_id, prompt in {"r0": [1, 2, 3, 4], "r1": [5, 6, 7], "r2": [8, 9]}.items():
            manager.add_request(prompt, request_id=request_id, streaming=True)
        finished = set()
        while len(finished) < 3:
            result = manager.get_result(timeout=TIMEOUT_S)
            assert result is not None, "the engine stopped answering"
            if result.is_finished():
                finished.add(result.request_id)
    finally:
        manager.stop(block=True)
    assert len(delivered) == 15  # streaming: one output per generated token
    for request_id, tokens, is_finished, steps, ended in delivered:
        assert steps == tokens, (request_id, tokens, steps)  # every token it received is a step already
        assert ended == is_finished, (request_id, tokens)  # and its end record, with its last one
