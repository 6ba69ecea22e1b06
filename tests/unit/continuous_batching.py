"""Shared by the continuous-batching tests (test_serving_cb, test_apportion, tests/gpu/test_serving_cuda):
the seeded tiny Llama that transformers' ContinuousBatchingManager runs on a CPU, its configs, the map
read back, and two tenants' clients adding requests to the real engine while it decodes.

torch and transformers are imported inside the functions: a module that imports this one skips itself
(pytest.importorskip) before anything here needs them."""

from __future__ import annotations

import os
import threading

import llmobs
import numpy as np
from llmobs.shm.reader import ShmReader

TIMEOUT_S = 120  # the engine thread answers within this (a hung engine fails the test, it never sleeps it)


def tiny_llama():
    """A random-init 2-layer Llama, seeded: the same weights on every call (and on every device)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)  # fmt: skip
    config._attn_implementation = "sdpa"  # paged SDPA: the continuous-batching path that runs on a CPU
    return LlamaForCausalLM(config).eval()


def cb_configs(max_new_tokens: int, **cb):
    """(GenerationConfig, ContinuousBatchingConfig(**cb)): greedy, never stopping early (no EOS), so
    every request decodes exactly max_new_tokens; 64 KV blocks and 64 tokens per pass unless given."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # Sized for these tests: left to itself the engine sizes its KV cache and its static attention mask
    # by the host's free memory (here [max_batch_tokens, tokens read] floats, filled at start: 34 s of one
    # test's 39 on this 24 GiB host).
    cb.setdefault("num_blocks", 64)
    cb.setdefault("max_batch_tokens", 64)
    return gen, ContinuousBatchingConfig(**cb)


def read_map(shm_dir):
    """This process's map read back: (token step rows, request event dicts), none lost or corrupt."""
    with ShmReader(os.getpid(), shm_dir=str(shm_dir)) as r:
        steps = r.read_steps(0)
        events = r.read_request_events(0)
    assert steps.lost == 0 and steps.corrupt == 0 and events.corrupt == 0
    return steps.rows(), [{k: events.columns[k][i] for k in events.columns} for i in range(len(events))]


def rows_by_request(rows):
    """request id -> its token step rows, in map order."""
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(row["request_id"], []).append(row)
    return out


def teacher_forced_losses(model, prompt, generated) -> np.ndarray:
    """-log p(generated[k] | prompt + generated[:k]) from one ordinary forward pass (no paged cache)."""
    import torch

    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    p = len(prompt)
    return np.array([-lp[p - 1 + k, t].item() for k, t in enumerate(generated)])


def serve_two_tenants(manager, early: dict, late: dict, session_suffix: str = "-session"):
    """Requests from two client threads, each under its own llmobs.context (session tenant+suffix):
    tenant-a's `early` requests (streamed), then, once a0 has decoded a token, tenant-b's `late` ones,
    so they join passes the early ones are decoding in. Returns (a0's first output, every request's
    final result by id); the manager is started here and stopped before it returns."""

    def add(tenant, requests, streaming=False):
        with llmobs.context(tenant=tenant, session=f"{tenant}{session_suffix}"):
            for request_id, prompt in requests.items():
                manager.add_request(prompt, request_id=request_id, streaming=streaming)

    manager.start()
    try:
        client = threading.Thread(target=add, args=("tenant-a", early, True))
        client.start()
        client.join()
        first = manager.get_result(request_id="a0", timeout=TIMEOUT_S)
        assert first is not None, "the engine stopped answering"
        client = threading.Thread(target=add, args=("tenant-b", late))
        client.start()
        client.join()
        done = {}
        while len(done) < len(early) + len(late):
            result = manager.get_result(timeout=TIMEOUT_S)
            assert result is not None, "the engine stopped answering"
            if result.is_finished():
                done[result.request_id] = result
    finally:
        manager.stop(block=True)
    return first, done
