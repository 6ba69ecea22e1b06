"""The SmolLM2 GGUF is read once and kept converted (llmobs.workloads.models.converted_dir): a later load
reads the converted copy, with the same weights, tokenizer and generation settings."""

from __future__ import annotations

import os

import torch
from llmobs.workloads import models


def test_a_second_load_reads_the_converted_copy_with_the_same_model(smollm2):
    model, tokenizer, _ = smollm2  # loaded by load_model: the GGUF (then kept) or the kept copy
    kept = models.converted_dir()
    assert os.path.isfile(os.path.join(kept, "model.safetensors")), "the first load kept no converted copy"
    again, again_tokenizer, model_id = models.load_model("smollm2")
    assert model_id == "SmolLM2-135M-Instruct" and getattr(again, "hf_quantizer", None) is None
    first, second = model.state_dict(), again.state_dict()
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()  # still tied
    text = ["The water cycle describes how water moves"]
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert torch.equal(ids, again_tokenizer(text, return_tensors="pt")["input_ids"])
    assert (again_tokenizer.pad_token_id, again_tokenizer.padding_side) == (tokenizer.pad_token_id, "left")
    assert again.generation_config.to_diff_dict() == model.generation_config.to_diff_dict()
