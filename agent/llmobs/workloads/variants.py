"""Model variants for comparisons: weights fake-quantized to a few bits, optionally with jittered scales.

    int4 = fake_quantize(model, bits=4)                       # symmetric, one scale per output channel
    jittered = fake_quantize(model, bits=4, scale_jitter=0.03, seed=1)

"Fake" quantization: every Linear weight of the decoder layers is quantized to signed `bits`-bit integers
and de-quantized back to float32 at once, so the variant runs on the same kernels as the original and
differs from it only by the rounding (what a weight-only int4 deployment changes in the numbers).
Per output channel c of W [out, in]: s_c = max|W_c| / (2^(bits-1) - 1), q = clamp(round(W_c / s_c),
-(2^(bits-1) - 1), 2^(bits-1) - 1), W'_c = q * s_c * u_c with u_c ~ U(1 - j, 1 + j) (j = scale_jitter,
u_c = 1 without it): at most 2^bits - 1 levels per channel and |W_c - W'_c| <= s_c / 2 without jitter,
<= s_c / 2 + max|q| * s_c * j with it. The jitter models a quantization whose scales were calibrated
slightly wrong (the seed's attribution example: "+2.7% scale jitter").

The embeddings and the LM head are kept as they are: weight-only int4 recipes (GPTQ, AWQ, bitsandbytes'
4-bit) leave them in high precision, since they are a small share of the compute and the most sensitive
to rounding; and in SmolLM2 they are one tied tensor, so quantizing the head would quantize the input
embeddings with it. Only `nn.Linear` modules inside the decoder layers are touched.
"""

from __future__ import annotations

import copy


def describe(bits: int = 4, per_channel: bool = True, scale_jitter: float = 0.0) -> str:
    """The quantization summary (what a `quant` factor or label would say): int4-pc, int4-pc-j0.03."""
    text = f"int{bits}-{'pc' if per_channel else 'pt'}"
    return f"{text}-j{scale_jitter:g}" if scale_jitter else text


def decoder_linears(model) -> list[tuple[str, object]]:
    """(name, module) of every nn.Linear inside the decoder layers (never the embeddings or the head)."""
    from torch import nn

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    layers = _decoder_layers(model)
    if layers is None:  # not a known layout: every Linear but the head
        return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head]
    return [
        (f"{i}.{n}", m)
        for i, layer in enumerate(layers)
        for n, m in layer.named_modules()
        if isinstance(m, nn.Linear) and m is not head
    ]


def _decoder_layers(model):
    try:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    except Exception:
        decoder = None
    for owner in (decoder, getattr(model, "model", None), getattr(model, "transformer", None)):
        for name in ("layers", "h"):
            layers = getattr(owner, name, None) if owner is not None else None
            if layers is not None:
                return layers
    return None


def quantize_weight(weight, bits: int = 4, per_channel: bool = True, jitter=None):
    """(de-quantized weight, scales [out, 1] or [1, 1], integer levels) of a float weight [out, in].
    `jitter`: the per-scale multipliers (same shape as the scales) or None."""
    import torch

    qmax = (1 << (bits - 1)) - 1
    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))  # an all-zero channel stays zero
    q = torch.clamp(torch.round(w / scale), -qmax, qmax)
    used = scale if jitter is None else scale * jitter
    return (q * used).to(weight.dtype), scale, q


def fake_quantize(model, bits: int = 4, per_channel: bool = True, scale_jitter: float = 0.0, seed: int = 0):
    """A deep copy of `model` whose decoder-layer Linear weights are quantized to `bits` bits and
    de-quantized (module docstring); scale_jitter j multiplies each scale by U(1 - j, 1 + j) (drawn from
    `seed`, the same for a given model and seed). The original is left unchanged."""
    import torch

    if not 2 <= bits <= 8:
        raise ValueError(f"fake_quantize(bits={bits}): bits must be in 2..8")
    if not 0.0 <= scale_jitter < 1.0:
        raise ValueError(f"fake_quantize(scale_jitter={scale_jitter}): the jitter must be in [0, 1)")
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in decoder_linears(out):
            w = module.weight
            rows = w.shape[0] if per_channel else 1
            jitter = None
            if scale_jitter:
                jitter = 1.0 + (torch.rand((rows, 1), generator=gen) * 2.0 - 1.0) * scale_jitter
                jitter = jitter.to(w.device)
            deq, _, _ = quantize_weight(w, bits, per_channel, jitter)
            w.copy_(deq)
    return out
