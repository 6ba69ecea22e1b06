"""Model factors: what the publisher can read off a model itself, published per model id.

    adapters   the active LoRA/PEFT adapters, comma-separated ("none")
    dtype      the dtype of its parameters ("float32", "bfloat16", ...)
    quant      a summary of config.quantization_config ("bitsandbytes-4bit-nf4", "gptq-4bit", "none")
    tokenizer  the tokenizer's name_or_path (when instrument() was given one)
    vocab      the vocabulary size (the tokenizer's, else config.vocab_size)

`llmobs.instrument(model, factors={"quant": "int4-pc"})` adds keys or overrides these (validated like
request labels, llmobs.publisher.labels). Each is a NAME_MODEL_FACTOR record (docs/shm-abi.md, "Model
factors"); the writer republishes one only when its value changed or the names ring overwrote it, so
publish() is cheap enough to call at every request.
"""

from __future__ import annotations

from llmobs.publisher import labels as request_labels

MAX_FACTORS = 16  # a model's factors (the automatic five and the user's)


def quant_summary(config) -> str:
    """A short, stable name of a transformers quantization config (a dict or a QuantizationConfigMixin)."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return "none"
    d = q if isinstance(q, dict) else (q.to_dict() if hasattr(q, "to_dict") else vars(q))
    method = str(d.get("quant_method", "unknown")).lower().replace("quantizationmethod.", "")
    method = method.replace("bits_and_bytes", "bitsandbytes")  # the enum's value; the package's name
    if d.get("load_in_4bit"):
        kind = d.get("bnb_4bit_quant_type")
        return f"{method}-4bit" + (f"-{kind}" if kind else "")
    if d.get("load_in_8bit"):
        return f"{method}-8bit"
    bits = d.get("bits") or d.get("w_bit") or d.get("weight_bits")
    return f"{method}-{bits}bit" if bits else method


def _dtype(model) -> str:
    try:
        dtype = getattr(model, "dtype", None)
        if dtype is None:
            dtype = next(model.parameters()).dtype
        return str(dtype).removeprefix("torch.")
    except Exception:
        return "unknown"


class ModelFactors:
    """A model's factors: the fixed ones read once (instrument time), the adapters and dtype per request."""

    def __init__(self, model, tokenizer=None, user: dict | None = None):
        self.model = model
        fixed: dict[str, str] = {"quant": quant_summary(getattr(model, "config", None))}
        if tokenizer is not None and getattr(tokenizer, "name_or_path", ""):
            fixed["tokenizer"] = str(tokenizer.name_or_path)
        vocab = None
        if tokenizer is not None:
            try:
                vocab = len(tokenizer)
            except Exception:
                vocab = getattr(tokenizer, "vocab_size", None)
        if vocab is None:
            vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab is not None:
            fixed["vocab"] = str(int(vocab))
        self.fixed = {k: v[: request_labels.MAX_VALUE_BYTES] for k, v in fixed.items()}
        # the user's, validated once; they override the automatic ones (adapters and dtype included)
        self.user = dict(request_labels.merge((), None, user, max_labels=MAX_FACTORS)) if user else {}

    def current(self, adapters: list[str]) -> dict[str, str]:
        out = {
            "adapters": ",".join(adapters)[: request_labels.MAX_VALUE_BYTES] or "none",
            "dtype": _dtype(self.model),
            **self.fixed,
        }
        out.update(self.user)
        return out

    def publish(self, writer, model_hash: int, adapters: list[str]) -> None:
        for key, value in self.current(adapters).items():
            writer.name_model_factor(model_hash, key, value)
