"""Layer streams beyond attention entropy: MLP output variance per layer (kind 2), and the policy object
that switches every layer stream on together (`llmobs.LayerStreams`).

MLP variance: on a sampled forward pass only, a forward hook on each layer's MLP module (GPT-2
`transformer.h.N.mlp`, Llama `model.layers.N.mlp`) takes the variance over the hidden dimension of the
MLP's output at the newest position of each batch row (population variance, torch.var(correction=0),
float32, on the model's device). Hooks are installed for the sampled pass and removed when it returns,
so unsampled passes run the model exactly as without the policy. The values reach the map's
layer-stream ring with the same single non-blocking copy as attention entropy
(llmobs.shm.writer.ShmWriter.publish_layers).

Module names: the store must name the module a stream comes from (root cause prints
`transformer.h.1.mlp`, not "layer 1 kind 2"), and the naming differs per architecture. So the
publisher registers each stream's real qualified name (from model.named_modules()) in the map's names
ring as a NAME_OTHER record `module:<kind>:<layer>:<qualified name>`; the agent folds those into the
store's `layer_modules` table. They are re-published on sampled passes only if the names ring has
overwritten them (ShmWriter.name keeps that check to one dict lookup).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from llmobs.publisher.attention import AttentionEntropy, AttentionSampler, as_policy
from llmobs.publisher.layer_base import ForwardHookSampler, coerce_policy, publish_module_names, row_traces
from llmobs.shm import layout

_LAYER_INDEX = re.compile(r"\.(\d+)\.[A-Za-z_]+$")  # "....h.3.mlp" -> 3


@dataclass(frozen=True)
class MlpVariance:
    """Sampling policy for MLP output variance: measure on forward passes whose step_seq % every == 0."""

    every: int = 1

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"MlpVariance(every={self.every}): every must be >= 1")


@dataclass(frozen=True)
class LayerStreams:
    """Every layer stream under one policy: attention entropy and/or MLP variance every N-th pass."""

    every: int = 1
    attention: bool = True
    mlp: bool = True
    per_head: bool = False

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"LayerStreams(every={self.every}): every must be >= 1")


def as_mlp_policy(value) -> MlpVariance | None:
    return coerce_policy(value, MlpVariance, "mlp_variance")


def _layer_of(name: str) -> int | None:
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else None


def mlp_modules(model) -> list[tuple[str, object]]:
    """(qualified name, module) of each decoder layer's MLP, in layer order: a submodule named `mlp`
    directly under a numbered layer (`....<N>.mlp`), which is how GPT-2, Llama, Mistral, Qwen name it."""
    found = []
    for name, module in model.named_modules():
        if name.endswith(".mlp") and (layer := _layer_of(name)) is not None:
            found.append((layer, name, module))
    found.sort(key=lambda x: x[0])
    return [(name, module) for _, name, module in found]


def newest_position_variance(output):
    """MLP output [B, T, D] (or [B, D]) -> population variance over D at the last position, [B] float32."""
    hidden = output[0] if isinstance(output, tuple) else output
    last = hidden[:, -1, :] if hidden.dim() == 3 else hidden
    return last.detach().float().var(dim=-1, correction=0)


class MlpSampler(ForwardHookSampler):
    """Installs the MLP hooks on sampled forward passes and publishes what they captured (kind 2)."""

    def __init__(self, model, every: int):
        named = mlp_modules(model)
        super().__init__([m for _, m in named])
        self.every = every
        self.names = [n for n, _ in named]

    def begin(self, step_seq: int, trace_hi, trace_lo) -> None:
        self.abort()  # a forward that raised last time never reached end()
        if step_seq % self.every or not self.modules:
            return
        self._install(step_seq, trace_hi, trace_lo)

    def _hook(self, index: int):
        def capture(module, args, output):
            self._captured[index] = newest_position_variance(output)

        return capture

    def end(self, writer) -> None:
        taken = self._take()
        if taken is None:
            return
        (step_seq, trace_hi, trace_lo), per_layer = taken  # [L, B]
        n_layers, batch = per_layer.shape
        row = np.tile(np.arange(batch, dtype=np.int32), n_layers)
        layer = np.repeat(np.arange(n_layers, dtype=np.int32), batch)
        hi, lo = row_traces(trace_hi, trace_lo, batch)
        publish_module_names(writer, layout.LAYER_MLP_VARIANCE, self.names)
        writer.publish_layers(
            per_layer.reshape(-1), step_seq=step_seq, kind=layout.LAYER_MLP_VARIANCE, trace_hi=hi[row],
            trace_lo=lo[row], batch_row=row, layer=layer, head=layout.HEAD_MEAN,
        )  # fmt: skip


class Samplers:
    """The layer-stream samplers of one instrumented model, driven together by its hooks."""

    def __init__(self, samplers: list):
        self.samplers = samplers

    def begin(self, step_seq: int, trace_hi, trace_lo) -> None:
        for s in self.samplers:
            s.begin(step_seq, trace_hi, trace_lo)

    def end(self, writer) -> None:
        for s in self.samplers:
            s.end(writer)

    def abort(self) -> None:
        for s in self.samplers:
            s.abort()


def build_samplers(model, attention_entropy=None, mlp_variance=None, layer_streams=None):
    """(attention sampler or None, Samplers or None) for instrument()'s policy arguments.

    layer_streams=LayerStreams(...) (or an int N: every stream every N-th pass) sets attention and MLP
    together; attention_entropy / mlp_variance set one stream each and win over layer_streams."""
    if isinstance(layer_streams, int) and not isinstance(layer_streams, bool) and layer_streams:
        layer_streams = LayerStreams(every=layer_streams)
    if layer_streams not in (None, False, 0) and not isinstance(layer_streams, LayerStreams):
        raise TypeError(f"layer_streams must be None, an int or llmobs.LayerStreams, not {layer_streams!r}")
    attention = as_policy(attention_entropy)
    mlp = as_mlp_policy(mlp_variance)
    if isinstance(layer_streams, LayerStreams):
        if attention is None and layer_streams.attention:
            attention = AttentionEntropy(every=layer_streams.every, per_head=layer_streams.per_head)
        if mlp is None and layer_streams.mlp:
            mlp = MlpVariance(every=layer_streams.every)
    samplers = []
    attention_sampler = None
    if attention is not None:
        attention_sampler = AttentionSampler(model, attention)
        samplers.append(attention_sampler)
    if mlp is not None:
        samplers.append(MlpSampler(model, mlp.every))
    return attention_sampler, (Samplers(samplers) if samplers else None)
