"""Per-token metrics computed on the logits' own device with a few torch ops (no host sync).

The result is the record's 7-word "device block": float32 loss, entropy, target_prob, top1_prob, then
the int32 bits of target_rank, token_id and target_id, so one copy_ moves a whole step into the map.

The loss comes from torch.log_softmax, the kernel F.cross_entropy itself uses, so the two agree to
float32 rounding (a log-sum-exp of our own differs by up to ~1e-5 on a 49k vocabulary: the float32
sum's own error). The other passes over the vocabulary are kept few, because on a CPU the logits are
usually cold in cache after the forward pass:
  lp = log_softmax(x);  loss = -lp[t];  target_prob = exp(lp[t]);  top1_prob = exp(max lp)
  entropy = -(exp(lp) . lp);  target_rank = #{lp > lp[t]} (counted as floats, exact below 2^24)
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Prepared(NamedTuple):
    """Stage 1 of the metrics, everything that needs no target: computed while the logits are hot in
    cache (right after the forward pass), before the target is known."""

    x: torch.Tensor
    lp: torch.Tensor
    top1: torch.Tensor
    neg_entropy: torch.Tensor


def prepare(logits: torch.Tensor) -> Prepared:
    """logits [N, V] -> the target-independent passes over the vocabulary."""
    x = logits if logits.dtype == torch.float32 else logits.float()
    lp = torch.log_softmax(x, -1)
    return Prepared(x, lp, lp.amax(-1, keepdim=True), torch.linalg.vecdot(lp.exp(), lp).unsqueeze(-1))


def device_block(
    logits: torch.Tensor | Prepared,
    targets: torch.Tensor | None,
    token_ids: torch.Tensor | None = None,
    *,
    all_valid: bool = False,
) -> torch.Tensor:
    """logits [N, V] (or prepare(logits)); targets [N] int (-100 or any negative = no target) or None;
    token_ids [N] or None (None: the target when there is one, else the arg-max). all_valid promises
    no ignored target (generate's chosen tokens), which saves a few ops. Returns float32 [N, 7]."""
    x, lp, top1, neg_entropy = logits if isinstance(logits, Prepared) else prepare(logits)
    if targets is None:
        nan = torch.full_like(top1, float("nan"))
        floats = torch.cat([nan, neg_entropy.neg(), nan, top1.exp()], -1)
        rank = target32 = torch.full_like(top1, -1, dtype=torch.int32)
        tokens = x.argmax(-1, keepdim=True) if token_ids is None else token_ids.view(-1, 1)
    else:
        tgt = targets.view(-1, 1)
        lpt = lp.gather(-1, tgt if all_valid else tgt.clamp(min=0))
        if not x.is_cuda and bool((lpt >= top1).all()):
            rank = torch.zeros_like(top1)  # every target is a top token (greedy): no pass over V needed
        else:  # (on CUDA never branch on device values: that would be a host sync)
            rank = torch.sub(lp, lpt).gt_(0).sum(-1, keepdim=True)
        target32 = tgt
        if not all_valid:
            valid = tgt >= 0
            lpt = lpt.masked_fill(~valid, float("nan"))  # NaN loss and target_prob without a target
            rank = torch.where(valid, rank, -1.0)
            target32 = torch.where(valid, tgt, -1)
        floats = torch.cat([torch.cat([lpt, neg_entropy], -1).neg_(), torch.cat([lpt, top1], -1).exp_()], -1)
        target32 = target32.to(torch.int32)
        tokens = target32 if token_ids is None else token_ids.view(-1, 1)
    ints = torch.cat([rank.to(torch.int32), tokens.to(torch.int32), target32], -1)  # .to: no-op when int32
    return torch.cat([floats, ints.view(torch.float32)], -1)
