"""Training mode: dL/dE (the gradient of the loss w.r.t. the input embeddings, per token) of every
training step, kept on the model's device in a ring of the last 128 steps; dumped on the agent's ask.

    inst = llmobs.instrument(model, training=True)     # or training=llmobs.TrainingOptions(...)
    out = model(input_ids, labels=input_ids)           # per-token losses -> token steps (publisher.hf)
    out.loss.backward()                                # dL/dE of this step -> the ring (one copy_)

How dL/dE is taken without an extra backward: a forward hook on the input-embedding module
(model.get_input_embeddings()) registers a tensor hook on its output; autograd calls that hook with
dL/dE during the workload's own backward, and the hook copies it into the ring slot of the step the
forward belonged to (`copy_`, non-blocking on CUDA: no host sync). Steps without grad (eval, no_grad,
a frozen embedding whose output needs no grad) leave the ring alone.

Bounded memory: the ring is one preallocated tensor [steps, tokens, dims] in a compact dtype
(bfloat16 by default: float32's range, so tiny gradients do not flush to zero as in float16), allocated
on the first training step, when B*T and D are known:
    tokens = min(B*T, max_tokens)                     (the first tokens of the flattened batch)
    dims   = min(D, max_bytes // (steps * tokens * itemsize))
    bytes  = steps * tokens * dims * itemsize <= max_bytes   (default 128 x 512 x D x 2, capped at 64 MiB)
A later step with fewer tokens zero-pads its slot; one with more is cut at `tokens`.

The agent asks for the slices with the control command CMD_DUMP_GRADIENTS (cmd_arg = the spike's
step_seq): at its next step boundary the workload copies the last `dump_steps` slots whose step_seq <=
cmd_arg to the host (the one host sync, only on that command) and writes them as one .npz next to its
map, `<map>.dLdE.<ack_step_seq>.npz` (arrays grads [n, tokens, dims] float32, step_seq [n], tokens [n],
batch [n], seq_len [n]), mode 0600, renamed into place so the agent never reads half a file.
One recorder per process serves the dump command (the model instrumented last with training mode).
Steps are tagged with the step_seq current at the embedding's forward: a forward with labels (or
inside llmobs.request) begins that step; a forward that publishes no token step (a loss computed
outside the model) is tagged with the previous step's step_seq.
Nothing here raises into the workload: failures are counted in llmobs.publisher.request.errors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmobs.publisher import request as publisher
from llmobs.shm import layout
from llmobs.shm import writer as writer_module
from llmobs.shm.names import dump_path
from llmobs.shm.sidefile import write_npz_atomically


@dataclass(frozen=True)
class TrainingOptions:
    """Training mode's ring: how many steps, the caps on its size, and how many steps a dump holds."""

    steps: int = 128
    max_tokens: int = 512
    max_bytes: int = 64 << 20
    dtype: str = "bfloat16"
    dump_steps: int = 5

    def __post_init__(self) -> None:
        if self.steps < 1 or self.max_tokens < 1 or self.max_bytes < 1:
            raise ValueError("TrainingOptions: steps, max_tokens and max_bytes must be >= 1")
        if not 1 <= self.dump_steps <= self.steps:
            raise ValueError(f"TrainingOptions: dump_steps must be in 1..{self.steps}")


def ring_shape(options: TrainingOptions, tokens: int, dims: int, itemsize: int) -> tuple[int, int, int]:
    """[steps, tokens, dims] of the ring for B*T = `tokens` and hidden size `dims`, within the caps."""
    tokens = max(1, min(tokens, options.max_tokens))
    dims = max(1, min(dims, options.max_bytes // (options.steps * tokens * itemsize)))
    return options.steps, tokens, dims


class GradientRing:
    """The last `steps` dL/dE slices on the device, each tagged with its step_seq (host arrays)."""

    def __init__(self, options: TrainingOptions):
        self.options = options
        self.data = None  # torch [steps, tokens, dims], allocated on the first write
        self.head = 0  # slices ever written
        self.step_seq = np.zeros(options.steps, np.int64)
        self.tokens = np.zeros(options.steps, np.int32)  # valid tokens in each slot
        self.batch = np.zeros(options.steps, np.int32)
        self.seq_len = np.zeros(options.steps, np.int32)

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()

    def _allocate(self, grad) -> None:
        import torch

        dtype = getattr(torch, self.options.dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        flat = grad.shape[0] * grad.shape[1] if grad.dim() == 3 else grad.shape[0]
        shape = ring_shape(self.options, flat, grad.shape[-1], itemsize)
        self.data = torch.zeros(shape, dtype=dtype, device=grad.device)

    def write(self, step_seq: int, grad) -> None:
        """Copy dL/dE [B, T, D] (or [N, D]) of step `step_seq` into the next slot (oldest overwritten)."""
        if self.data is None:
            self._allocate(grad)
        _, tokens, dims = self.data.shape
        flat = grad.detach().reshape(-1, grad.shape[-1])
        n = min(flat.shape[0], tokens)
        slot = self.head % self.options.steps
        dest = self.data[slot]
        dest[:n].copy_(flat[:n, :dims], non_blocking=True)
        if n < tokens:
            dest[n:].zero_()
        self.step_seq[slot] = step_seq
        self.tokens[slot] = n
        self.batch[slot] = grad.shape[0] if grad.dim() == 3 else 1
        self.seq_len[slot] = grad.shape[1] if grad.dim() == 3 else flat.shape[0]
        self.head += 1

    def last(self, n: int, upto_step_seq: int | None = None) -> list[int]:
        """Slots of the newest `n` slices with step_seq <= upto (all when None), oldest first."""
        count = min(self.head, self.options.steps)
        slots = [(self.head - 1 - i) % self.options.steps for i in range(count)]  # newest first
        if upto_step_seq:
            slots = [s for s in slots if self.step_seq[s] <= upto_step_seq]
        return sorted(slots[:n], key=lambda s: self.step_seq[s])

    def host_slices(self, slots: list[int]) -> np.ndarray:
        """float32 [len(slots), tokens, dims] on the host (a device sync: only on the agent's ask)."""
        return self.data[slots].float().cpu().numpy()

    def dump(self, path: str, upto_step_seq: int | None = None) -> int:
        """Write the last dump_steps slices (<= upto) to `path` (.npz, 0600, atomic); returns how many."""
        slots = self.last(self.options.dump_steps, upto_step_seq)
        if not slots:
            return 0
        arrays = {
            "grads": self.host_slices(slots),
            "step_seq": self.step_seq[slots],
            "tokens": self.tokens[slots],
            "batch": self.batch[slots],
            "seq_len": self.seq_len[slots],
        }
        write_npz_atomically(path, arrays)
        return len(slots)


_recorder: TrainingRecorder | None = None  # the process's recorder (the one the dump command serves)


def _handle_dump(writer, arg: int):
    """CMD_DUMP_GRADIENTS at a step boundary: dump the slices up to step_seq `arg` (0 = the newest)."""
    rec = _recorder
    if rec is None or rec.ring.data is None:
        return layout.ACK_UNSUPPORTED, None
    written = rec.ring.dump(dump_path(writer.path, writer.step_seq), arg or None)
    return (layout.ACK_OK if written else layout.ACK_UNSUPPORTED), None


class TrainingRecorder:
    """The embedding hooks that feed the ring, and the dump command's handler."""

    def __init__(self, model, options: TrainingOptions):
        global _recorder
        self.options = options
        self.ring = GradientRing(options)
        self.embedding = model.get_input_embeddings()
        self._handle = self.embedding.register_forward_hook(self._on_embedding)
        _recorder = self
        writer_module.register_command_handler(layout.CMD_DUMP_GRADIENTS, _handle_dump)

    @classmethod
    def for_model(cls, model, training) -> TrainingRecorder:
        options = training if isinstance(training, TrainingOptions) else TrainingOptions()
        return cls(model, options)

    def _on_embedding(self, module, args, output) -> None:
        try:
            if not getattr(output, "requires_grad", False):
                return  # eval / no_grad / frozen embedding: nothing will flow back here
            seq = writer_module.get_writer().step_seq  # the step begun by the model's pre-hook

            def keep(grad, seq=seq):
                try:
                    self.ring.write(seq, grad)
                except Exception as exc:  # never break the backward
                    publisher._count_error(exc)

            output.register_hook(keep)
        except Exception as exc:
            publisher._count_error(exc)

    def remove(self) -> None:
        global _recorder
        self._handle.remove()
        if _recorder is self:
            _recorder = None
