"""Known faults and known work the generation workload injects, so the agent's findings can be checked
against the truth: a forced least-likely token (a loss spike) and exact allocations per forward pass."""

from __future__ import annotations


class LeastLikelyAt:
    """Logits processor: at the chosen token indices of the request, only the least likely token can be
    chosen (a sampling fault the detectors must see as a loss spike)."""

    def __init__(self, steps: set[int], prompt_len: int, alloc_bytes: int = 0):
        self.steps, self.prompt_len, self.alloc_bytes = steps, prompt_len, alloc_bytes

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.prompt_len in self.steps:
            if self.alloc_bytes:  # still inside the step's tag: the next forward has not begun
                import torch

                torch.empty(self.alloc_bytes, dtype=torch.uint8).fill_(1)  # every page touched
            # tokens other processors ruled out (-inf: eos under min_new_tokens) stay out
            worst = scores.masked_fill(scores == float("-inf"), float("inf")).argmin(dim=-1, keepdim=True)
            forced = scores.new_full(scores.shape, float("-inf"))
            return forced.scatter(-1, worst, 0.0)
        return scores


class AllocPhase:
    """Known allocations per step: 1 + step_seq % 3 tensors of `nbytes` during each forward pass."""

    def __init__(self, model, nbytes: int):
        self.nbytes = nbytes
        self.per_step: list[list[int]] = []  # [step_seq, allocations] of the forwards since the last take
        model.get_output_embeddings().register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        import torch

        from llmobs.shm.writer import get_writer

        seq = get_writer().step_seq
        count = 1 + seq % 3
        kept = [torch.empty(self.nbytes, dtype=torch.uint8) for _ in range(count)]
        self.per_step.append([seq, len(kept)])

    def take(self) -> list[list[int]]:
        taken, self.per_step = self.per_step, []
        return taken
