"""Per-token metrics computed on the logits' own device with a few torch ops (no host sync).

The result is the record's 7-word "device block": float32 loss, entropy, target_prob, top1_prob, then
the int32 bits of target_rank, token_id and target_id, so one copy_ moves a whole step into the map.
"""

from __future__ import annotations

import torch

_MASKS: dict[torch.device, torch.Tensor] = {}


def _exp_columns(device: torch.device) -> torch.Tensor:
    """[F, F, T, T]: columns 2 and 3 (probabilities) are exp(log-prob); 0 and 1 are negated."""
    mask = _MASKS.get(device)
    if mask is None:
        mask = _MASKS[device] = torch.tensor([False, False, True, True], device=device)
    return mask


def device_block(
    logits: torch.Tensor,
    targets: torch.Tensor | None,
    token_ids: torch.Tensor | None = None,
    *,
    all_valid: bool = False,
) -> torch.Tensor:
    """logits [N, V]; targets [N] int (-100 or any negative = no target) or None; token_ids [N] or None
    (None: the target when there is one, else the arg-max). all_valid promises no ignored target
    (generate's chosen tokens), which saves three ops. Returns a float32 [N, 7] tensor."""
    x = logits if logits.dtype == torch.float32 else logits.float()
    logp = torch.log_softmax(x, -1)
    top1, argmax = logp.max(-1, keepdim=True)
    neg_entropy = torch.linalg.vecdot(logp.exp(), logp).unsqueeze(-1)  # sum p log p
    if targets is None:
        target_lp = torch.full_like(top1, float("nan"))
        rank = torch.full_like(argmax, -1)
        target32 = rank
        tokens = argmax if token_ids is None else token_ids.view(-1, 1)
    else:
        tgt = targets.view(-1, 1)
        valid = tgt >= 0
        safe = tgt.clamp(min=0)
        target_lp = logp.gather(-1, safe)
        rank = (logp > target_lp).sum(-1, keepdim=True)
        if not all_valid:
            target_lp = torch.where(valid, target_lp, float("nan"))
            rank = torch.where(valid, rank, -1)
            target32 = torch.where(valid, tgt, -1)
        else:
            target32 = tgt
        tokens = target32 if token_ids is None else token_ids.view(-1, 1)
    floats = torch.cat([target_lp, neg_entropy, target_lp, top1], -1)
    floats = torch.where(_exp_columns(floats.device), floats.exp(), floats.neg())
    ints = torch.cat([rank, tokens, target32], -1).to(torch.int32)
    return torch.cat([floats, ints.view(torch.float32)], -1)
