"""Small masked tensor helpers shared by the RL algorithms (``verl.trainer.ppo.core_algos``) and the workers.

Conventions:
* ``mask`` is a 0/1 tensor (bool, int or float) broadcastable to ``values``; 1 marks a position that counts.
* Reductions over an empty mask return 0 instead of NaN (the numerator is 0 and the denominator is clamped),
  so a micro-batch made only of padding rows contributes nothing rather than poisoning the loss.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "entropy_from_logits",
    "logprobs_from_logits",
]

# Denominators are clamped to this value; with a 0/1 mask a non-empty count is >= 1, so the clamp only ever
# applies to empty masks (numerator 0 -> result 0) and never biases a real mean.
_MIN_DENOMINATOR = 1e-8


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: Optional[int] = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set (over ``axis``, or everything when ``axis`` is None)."""
    masked = values * mask.to(values.dtype)
    return masked.sum() if axis is None else masked.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: Optional[int] = None) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is set; 0 for an empty mask.

    Example: ``masked_mean(tensor([1., 2., 3.]), tensor([1, 1, 0])) == 1.5``.
    """
    mask_f = mask.to(values.dtype)
    count = mask_f.sum() if axis is None else mask_f.sum(dim=axis)
    return masked_sum(values, mask_f, axis) / count.clamp_min(_MIN_DENOMINATOR)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the masked positions (all axes together).

    ``unbiased=True`` applies Bessel's correction (divide by N-1), which needs at least 2 masked positions;
    fewer raise ``ValueError`` naming the count.
    """
    mask_f = mask.to(values.dtype)
    count = mask_f.sum()
    n = int(count.item())
    if n == 0:
        raise ValueError("masked_var: the mask selects no positions (mask.sum() == 0)")
    mean = masked_mean(values, mask_f)
    centered = values - mean
    variance = masked_mean(centered * centered, mask_f)
    if unbiased:
        if n == 1:
            raise ValueError("masked_var(unbiased=True): the mask selects 1 position; need at least 2")
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Standardise ``values`` with the masked mean and unbiased masked variance: ``(x - mean) / sqrt(var + 1e-8)``.

    With ``shift_mean=False`` the mean is added back (only the scale changes). Positions outside the mask are
    transformed too (callers multiply by the mask when they need zeros there).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution ``softmax(logits)`` over the last axis: ``[..., V] -> [...]``.

    Uses ``H = logsumexp(z) - sum(softmax(z) * z)``, which is exact and stable for large logits.
    """
    probs = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under ``softmax(logits)``: logits ``[..., V]``, labels ``[...]`` -> ``[...]``."""
    log_probs = F.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(dim=-1, index=labels.long().unsqueeze(-1)).squeeze(-1)
