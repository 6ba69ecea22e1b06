"""The shared base of the layer streams (attention entropy, MLP variance): the policy argument, the
forward-hook sampler skeleton, per-row trace ids and the module-name records. attention.py builds on
this module alone; layers.py (MLP variance, and the LayerStreams policy that turns both streams on)
builds on it and on attention.py's sampler, so the imports run one way only.
"""

from __future__ import annotations

import numpy as np

from llmobs.publisher.replay_thread import in_replay_thread
from llmobs.shm import layout
from llmobs.shm.names import module_name


def coerce_policy(value, policy: type, argument: str):
    """A sampling-policy argument: None/False/0 = off (None); an int N = policy(every=N); a policy as is."""
    if value is None or value is False or (isinstance(value, int) and value == 0):
        return None
    if isinstance(value, policy):
        return value
    if isinstance(value, int):
        return policy(every=value)
    raise TypeError(f"{argument} must be None, an int or llmobs.{policy.__name__}, not {value!r}")


class ForwardHookSampler:
    """The skeleton of a layer-stream sampler: forward hooks on `modules`, installed only for a sampled
    pass (begin) and removed when it ends (end) or when a pass that raised never reached its end."""

    def __init__(self, modules: list):
        self.modules = modules
        self._handles: list = []
        self._captured: list = []
        self._step = None  # (step_seq, trace_hi, trace_lo) of the sampled pass in flight

    def _install(self, step_seq: int, trace_hi, trace_lo) -> None:
        self._captured = [None] * len(self.modules)
        for i, module in enumerate(self.modules):
            self._handles.append(module.register_forward_hook(_live_only(self._hook(i))))
        self._step = (step_seq, trace_hi, trace_lo)

    def _hook(self, index: int):
        raise NotImplementedError

    def abort(self) -> None:
        """Remove the hooks (the pass in flight publishes nothing)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._step = None

    def _take(self):
        """Ends the pass: ((step_seq, trace_hi, trace_lo), the captures stacked [L, ...]), or None when it
        was not sampled or a layer captured nothing."""
        step = self._step
        self.abort()
        captured, self._captured = self._captured, []
        if step is None or not captured or any(c is None for c in captured):
            return None
        import torch

        return step, torch.stack(captured)


def _live_only(hook):
    """A capture hook that ignores the flight recorder's replay passes (another thread, same modules)."""

    def live(module, args, output):
        if not in_replay_thread():
            hook(module, args, output)

    return live


def row_traces(trace_hi, trace_lo, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The trace id words of each batch row (rows that are not the request's rows: all row 0's)."""
    hi = np.asarray(trace_hi, dtype=np.uint64)
    lo = np.asarray(trace_lo, dtype=np.uint64)
    if hi.size != batch:
        hi, lo = np.full(batch, hi.flat[0], np.uint64), np.full(batch, lo.flat[0], np.uint64)
    return hi, lo


def publish_module_names(writer, kind: int, names: list[str]) -> None:
    """Register `module:<kind>:<layer>:<name>` for each layer (a dict lookup each once published)."""
    for layer, name in enumerate(names):
        writer.name(layout.NAME_OTHER, module_name(kind, layer, name))
