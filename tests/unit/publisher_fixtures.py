"""Shared by the publisher-side unit tests: a process-wide map writer isolated in a test's tmp dir, and
the random-init tiny GPT-2 of DESIGN.md's test tiers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from llmobs.shm import writer as writer_module


def isolated_writer(tmp_path: Path) -> Iterator[Path]:
    """The process-wide writer re-created under tmp_path for one test, and forgotten after it (for a
    pytest fixture: `yield from isolated_writer(tmp_path)`)."""
    writer_module.reset_writer()
    writer_module.configure(shm_dir=str(tmp_path))
    yield tmp_path
    writer_module.reset_writer()
    writer_module._writer_options.clear()


def tiny_gpt2(*, training: bool = False, initializer_range: float | None = None):
    """GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256), seeded; a wider initializer_range
    gives the attention and MLP outputs some spread to measure."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    extra = {} if initializer_range is None else {"initializer_range": initializer_range}
    config = GPT2Config(
        n_layer=2, n_head=2, n_embd=64, vocab_size=256, bos_token_id=0, eos_token_id=0, **extra
    )
    model = GPT2LMHeadModel(config)
    return model.train() if training else model.eval()


class GreedyLoop:
    """A plain llmobs.request loop: greedy, one forward per token step, its cache passed back in.
    `busy[i]`: whether a flight-recorder replay was running at step i (seen after its forward)."""

    def __init__(self, model, req, ids):
        self.model, self.req, self.ids, self.cache = model, req, ids, None
        self.busy: list[bool] = []

    def step(self, forced=None) -> None:
        """One token: the greedy one, or `forced` (then its loss is what the model thinks of it)."""
        import torch
        from llmobs.publisher import recorder as flight

        with torch.no_grad():
            out = self.model(input_ids=self.ids, cache=self.cache, use_cache=True)
            self.cache = out.cache
            logits = out.logits[:, -1]
            self.ids = logits.argmax(-1, keepdim=True) if forced is None else forced
            active = flight.active()
            self.busy.append(active is not None and active.busy)
            self.req.step(logits, self.ids[:, 0])
