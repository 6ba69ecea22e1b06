"""A teacher-forced pass's loss from the publisher's own log-softmax, instead of a second one.

A Hugging Face causal LM given `labels` computes its loss as cross_entropy(logits, shifted labels),
which torch runs as nll_loss(log_softmax(logits)); the publisher then computes log_softmax of the same
logits again for the per-token metrics. On SmolLM2's 81-token pass at 1 thread the two were 9.3 ms
(the model's, into a fresh 16 MB tensor) and 11.7 ms (ours, the metrics included) of a ~265 ms pass.
Here the instance's `loss_function` is wrapped: inside a labelled pass that llmobs publishes, the
wrapper computes every row's log-softmax once, the metrics' block from it (device_math.labelled_block),
returns the model's loss as nll_loss of that log-softmax with the loss function's own reduction, and
hands the block to the post-hook, which publishes it instead of computing it again. Without autograd
(an evaluation, a scoring server) the log-softmax goes into a buffer of the thread's pool, chunk by
chunk; with it (training) it is torch.log_softmax with its graph, the very graph cross_entropy builds
(it is composite: LogSoftmaxBackward, then NllLossBackward), so the gradients are the same too, and
the metrics read its rows detached.

Only where the model's loss function is transformers' own ForCausalLMLoss, whose semantics this
reproduces (the shift, ignore_index, the mean or the sum over num_items_in_batch). The loss is the
same to the bit: the same log_softmax kernel row by row, the same nll_loss. That is checked, not
assumed: the first shared call of a process also runs the model's own loss function and compares; a
difference (another transformers' semantics, another kernel) or any failure here turns sharing off
for the process (`status()` says why) and the model's own loss is returned, never an error; each of the
two ways (with and without autograd) is checked at its first use. Every other call goes to the model's
own loss function untouched: with arguments ForCausalLMLoss does not have, outside a labelled pass that
llmobs publishes.
"""

from __future__ import annotations

import contextvars
import time

import torch
import torch.nn.functional as F

from llmobs.publisher import device_math

# the arguments of transformers' ForCausalLMLoss, in order, whose meaning this module reproduces
# (models call it with keywords, or some positionally: GPT-2 passes logits and labels first)
ARGUMENTS = ("logits", "labels", "vocab_size", "num_items_in_batch", "ignore_index", "shift_labels")
IGNORE_INDEX = -100

_checked: set[str] = set()  # the ways ("no_grad", "autograd") already compared with the model's own loss
_why_off: str | None = None


def status() -> str:
    """One line: whether sharing is on in this process, and why not."""
    if _why_off is not None:
        return f"off: {_why_off}"
    if not _checked:
        return "on (not used yet)"
    return f"on (checked against the model's own loss: {', '.join(sorted(_checked))})"


class SharedLoss:
    """The wrapper set as a model's `loss_function` (instrument() installs it, remove() restores)."""

    def __init__(self, original, labelled_pass: contextvars.ContextVar, shared: contextvars.ContextVar,
                 charge=None):  # fmt: skip
        self.original = original
        self._labelled_pass = labelled_pass  # the publisher's labelled-pass state (None outside one)
        self._shared = shared  # where the block goes for the post-hook: (logits, block)
        # instrument(measure=True): the shared call's CPU ns go to the hooks' account, the model's own
        # loss (which it would have computed anyway) with them: an upper bound of what sharing costs
        self._charge = charge
        self.calls = 0  # passes whose loss came from the shared log-softmax

    def __call__(self, *args, **kwargs):
        state = self._labelled_pass.get()
        ids = state[2] if state is not None else None
        if ids is None or _why_off is not None:
            return self.original(*args, **kwargs)
        named = dict(zip(ARGUMENTS, args, strict=False))
        known = (
            len(args) <= len(ARGUMENTS)
            and named.keys().isdisjoint(kwargs)
            and set(ARGUMENTS).issuperset(kwargs)
        )
        if not known:
            return self.original(*args, **kwargs)
        original, kwargs = self.original, {**named, **kwargs}  # from here on, every argument by name
        began = time.thread_time_ns() if self._charge is not None else 0
        try:
            loss, block = _loss_and_block(ids, **kwargs)
            way = "autograd" if loss.requires_grad else "no_grad"
        except Exception as exc:  # never into the model: its own loss instead, from now on
            _turn_off(f"the shared loss failed: {exc!r}")
            return original(**kwargs)
        finally:
            if self._charge is not None:
                self._charge(time.thread_time_ns() - began)
        self._shared.set((kwargs["logits"], block))  # the metrics hold either way
        if way not in _checked:
            theirs = original(**kwargs)
            if not _matches(loss, theirs, way):
                return theirs
        self.calls += 1
        return loss


def install(model, labelled_pass: contextvars.ContextVar, shared: contextvars.ContextVar, charge=None):
    """Wrap `model.loss_function` (a transformers PreTrainedModel's); returns what `uninstall` needs, or
    None for a model without one."""
    cls_attr = getattr(type(model), "loss_function", None)
    if not isinstance(cls_attr, property) or cls_attr.fset is None:
        return None
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss

        if model.loss_function is not ForCausalLMLoss:
            return None  # another loss (a user's, another head's): its meaning is not ours to reproduce
    except Exception:
        return None
    had_own = "_loss_function" in model.__dict__
    wrapper = SharedLoss(model.loss_function, labelled_pass, shared, charge)
    model.loss_function = wrapper
    return (wrapper, had_own)


def uninstall(model, installed) -> None:
    wrapper, had_own = installed
    if model.__dict__.get("_loss_function") is not wrapper:
        return  # someone set another loss function since: theirs stays
    if had_own:
        model.loss_function = wrapper.original
    else:
        del model.__dict__["_loss_function"]


def block_for(shared: contextvars.ContextVar, logits: torch.Tensor) -> torch.Tensor | None:
    """The block the wrapper computed for this pass's `logits` (taken: None afterwards), or None."""
    held = shared.get()
    if held is None:
        return None
    shared.set(None)
    return held[1] if held[0] is logits else None


def _loss_and_block(ids, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
                    shift_labels=None):  # fmt: skip
    """ForCausalLMLoss's loss, and the metrics' block of every row (rows past each sequence's end
    included: their target is ignored)."""
    x = logits.float()
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    x = x.view(-1, vocab_size)
    targets = shift_labels.reshape(-1).to(x.device)
    tokens = F.pad(ids, (0, 1), value=0)[..., 1:].reshape(-1).to(x.device)
    if tokens.shape != targets.shape:
        raise ValueError(f"input_ids {tuple(ids.shape)} do not match the labels {tuple(shift_labels.shape)}")
    # the metrics take a target < 0 as none; nll_loss ignores exactly ignore_index
    if ignore_index != IGNORE_INDEX:
        targets_of_metrics = targets.masked_fill(targets == ignore_index, -1)
    else:
        targets_of_metrics = targets
    if torch.is_grad_enabled() and x.requires_grad:  # training: the loss keeps its graph
        lp = torch.log_softmax(x, -1)
        block, _ = device_math.labelled_block(x.detach(), targets_of_metrics, tokens, log_softmax=lp.detach())
        return _reduced(lp, targets, ignore_index, num_items_in_batch), block
    block, lp = device_math.labelled_block(x, targets_of_metrics, tokens)
    try:
        return _reduced(lp, targets, ignore_index, num_items_in_batch), block
    finally:
        device_math.release(lp)


def _reduced(lp, targets, ignore_index: int, num_items_in_batch) -> torch.Tensor:
    """fixed_cross_entropy's loss from the log-softmax: the mean, or the sum over num_items_in_batch."""
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.nll_loss(lp, targets, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _matches(ours: torch.Tensor, theirs: torch.Tensor, way: str) -> bool:
    """A way's first shared call's check: the same bits as the model's own loss, else sharing goes off."""
    ours, theirs = ours.detach(), theirs.detach()
    if ours.dtype == theirs.dtype and ours.shape == theirs.shape and torch.equal(ours, theirs):
        _checked.add(way)
        return True
    _turn_off(f"the shared loss {ours.item()!r} differs from the model's {theirs.item()!r}")
    return False


def _turn_off(why: str) -> None:
    global _why_off
    _why_off = why
