"""Attention entropy per layer, sampled by a policy: off by default, every N-th forward pass when on.

transformers 5 computes attention with SDPA by default, which never materialises the probabilities:
`output_attentions=True` under SDPA silently returns an empty tuple. So on a sampled forward pass only,
the model's attention implementation is switched to "eager" (one config attribute, read by the masks
and by every attention module at call time), forward hooks are put on the attention modules to take
the probabilities of the newest query position, and both are undone when the forward returns. Unsampled
passes run exactly as without the policy (no hooks, SDPA); with no policy nothing is installed at all.

Per layer: H = -sum_k p_k ln p_k (nats) of softmax row of the newest query, per head, then the mean
over heads (or every head with per_head=True). torch ops on the model's device; the values reach the
map's layer-stream ring with one non-blocking copy (llmobs.shm.writer.ShmWriter.publish_layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmobs.publisher.layer_base import ForwardHookSampler, coerce_policy, publish_module_names, row_traces
from llmobs.shm import layout


@dataclass(frozen=True)
class AttentionEntropy:
    """The sampling policy: measure on forward passes whose step_seq % every == 0."""

    every: int = 1
    per_head: bool = False

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"AttentionEntropy(every={self.every}): every must be >= 1")


def as_policy(value) -> AttentionEntropy | None:
    return coerce_policy(value, AttentionEntropy, "attention_entropy")


def attention_modules(model) -> list:
    """The self-attention modules in layer order (each has a layer_idx in HF GPT-2 and Llama)."""
    found = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
    return sorted(found, key=lambda m: m.layer_idx)


def attention_module_names(model) -> list[str]:
    """Qualified names of the self-attention modules, in the order AttentionSampler measures them."""
    names = {id(m): n for n, m in model.named_modules()}
    return [names.get(id(m), f"layer.{i}.attention") for i, m in enumerate(attention_modules(model))]


def newest_query_entropy(weights):
    """Attention probabilities [B, H, Q, K] -> entropy of the last query row [B, H] (float32, nats)."""
    import torch

    return torch.special.entr(weights[:, :, -1, :].detach().float()).sum(-1)


class AttentionSampler(ForwardHookSampler):
    """Installs the per-step capture on sampled forward passes and publishes what it captured."""

    def __init__(self, model, policy: AttentionEntropy):
        super().__init__(attention_modules(model))
        self.model = model
        self.policy = policy
        self.names = attention_module_names(model)  # registered in the map for root cause (kind 1)
        self.config = getattr(model, "config", None)
        self._saved_impl = None

    def begin(self, step_seq: int, trace_hi, trace_lo) -> None:
        """Called by the pre-hook once the step has its step_seq; a no-op on unsampled passes."""
        self.abort()  # a forward that raised last time never reached end(): undo its capture first
        if step_seq % self.policy.every or not self.modules or self.config is None:
            return
        self._saved_impl = self.config._attn_implementation
        if self._saved_impl != "eager":
            self.config._attn_implementation = "eager"
        self._install(step_seq, trace_hi, trace_lo)

    def _hook(self, index: int):
        def capture(module, args, output):
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is not None:
                self._captured[index] = newest_query_entropy(weights)

        return capture

    def abort(self) -> None:
        """Remove the hooks and give the model its attention implementation back."""
        super().abort()
        if self._saved_impl is not None:
            if self.config._attn_implementation != self._saved_impl:
                self.config._attn_implementation = self._saved_impl
            self._saved_impl = None

    def end(self, writer) -> None:
        """Called by the post-hook: publish the captured entropies of a sampled pass."""
        taken = self._take()
        if taken is None:
            return
        (step_seq, trace_hi, trace_lo), per_layer = taken  # [L, B, H]
        n_layers, batch, heads = per_layer.shape
        if self.policy.per_head:
            values = per_layer.reshape(-1)
            head = np.tile(np.arange(heads, dtype=np.int32), n_layers * batch)
            row = np.tile(np.repeat(np.arange(batch, dtype=np.int32), heads), n_layers)
            layer = np.repeat(np.arange(n_layers, dtype=np.int32), batch * heads)
        else:
            values = per_layer.mean(-1).reshape(-1)
            head = layout.HEAD_MEAN
            row = np.tile(np.arange(batch, dtype=np.int32), n_layers)
            layer = np.repeat(np.arange(n_layers, dtype=np.int32), batch)
        hi, lo = row_traces(trace_hi, trace_lo, batch)
        publish_module_names(writer, layout.LAYER_ATTENTION_ENTROPY, self.names)
        writer.publish_layers(
            values, step_seq=step_seq, kind=layout.LAYER_ATTENTION_ENTROPY, trace_hi=hi[row],
            trace_lo=lo[row], batch_row=row, layer=layer, head=head,
        )  # fmt: skip
