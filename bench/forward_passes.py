"""Wall time of every forward pass of an instrumented model, split by whether a sampling policy with
every=2 sampled it, recorded into a harness Comparison (bench/attention_entropy.py, layer_streams.py).

Sampled and unsampled passes alternate inside one generate() call, so the interleaving is the model's
own: pass 2k (sampled) and pass 2k+1 (unsampled) are recorded as round k of their arms, and the
harness pairs them for the ratio.

    time_generate(model, comparison, tokens, rounds, model_id=..., attention_entropy=...(every=2))

which wraps instrument() between the timer's outermost pre-hook (registered before instrument()'s) and
its outermost post-hook (registered after), then runs `rounds` greedy generate() calls.
"""

from __future__ import annotations

import time

from bench.harness import Comparison

SAMPLED, UNSAMPLED = "sampled", "unsampled"
FIGURE = "us per forward pass"


class PassTimer:
    def __init__(self, comparison: Comparison):
        self.comparison = comparison
        self._began = 0
        self._handles: list = []

    def before_instrument(self, model) -> None:
        def pre(module, args, kwargs):
            self._began = time.perf_counter_ns()

        self._handles.append(model.register_forward_pre_hook(pre, with_kwargs=True))

    def after_instrument(self, model) -> None:
        from llmobs.shm.writer import get_writer

        def post(module, args, kwargs, out):
            took = time.perf_counter_ns() - self._began
            seq = get_writer().step_seq
            self.comparison.record(SAMPLED if seq % 2 == 0 else UNSAMPLED, seq // 2, {FIGURE: took / 1e3})

        self._handles.append(model.register_forward_hook(post, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def time_generate(model, comparison: Comparison, tokens: int, rounds: int, **instrument_options) -> None:
    """instrument(model, **instrument_options) between the timer's hooks, `rounds` greedy generate() calls
    of `tokens` tokens each on a 16-token prompt, then every hook removed."""
    import llmobs
    import torch

    timer = PassTimer(comparison)
    timer.before_instrument(model)
    inst = llmobs.instrument(model, **instrument_options)
    timer.after_instrument(model)
    ids = torch.tensor([list(range(1, 17))])
    try:
        for _ in range(rounds):
            with torch.no_grad():
                model.generate(
                    ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0
                )
    finally:
        inst.remove()
        timer.remove()
