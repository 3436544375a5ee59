"""Off-policy correction of the policy loss for rollouts sampled by another policy than the actor's.

The rollout engine's log-probs of its own samples (``rollout_log_probs``) and the actor's recomputed ones
(``old_log_probs``, the current weights: PPO's denominator) differ when the engine's weights are stale (one-step-off
training, ``trainer.rollout_overlap``) or computed differently (bf16, other kernels). Truncated importance sampling
(TIS; verl's ``rollout_is`` with a token-level truncated weight) multiplies each response token's policy loss by

    w = min(exp(old_log_prob - rollout_log_prob), C)        C = algorithm.rollout_is_threshold

so the PPO ratio stays relative to the current policy and the sampling policy's mismatch is corrected, with the
variance bounded by ``C``. The weight is a constant (no gradient); the actor passes it to the policy loss as
``rollout_is_weights`` (``core_algos.compute_policy_loss``).
"""

from __future__ import annotations

import torch

__all__ = ["compute_rollout_is_weights", "engine_token_mask", "rollout_is_metrics"]


def compute_rollout_is_weights(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """Per-token TIS weights ``[B, R]``: ``min(exp(old_log_prob - rollout_log_prob), threshold)`` on response tokens.

    Tokens outside ``response_mask`` and tokens without an engine log-prob get weight 1: the managers store 0 where
    the engine gave none (async turns re-tokenised from text), and a real log-prob of exactly 0 (probability 1) has
    a ratio of about 1 anyway. The log-ratio is clamped to [-20, 20] before ``exp``, as PPO's ratio.

    Example (C = 2): old ``[[-1.0, -2.0, -0.1]]``, rollout ``[[-1.5, -1.0, -1.0]]`` -> ratios ``exp(0.5) = 1.6487``,
    ``exp(-1) = 0.3679``, ``exp(0.9) = 2.4596`` -> weights ``[[1.6487, 0.3679, 2.0]]``.
    """
    if threshold <= 0:
        raise ValueError(f"algorithm.rollout_is_threshold must be > 0, got {threshold}")
    ratio, valid = _ratio_and_valid(old_log_prob, rollout_log_prob, response_mask)
    weights = ratio.clamp(max=float(threshold))
    return torch.where(valid, weights, torch.ones_like(weights)).detach()


def _ratio_and_valid(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(clamp(old - rollout, -20, 20))`` and the mask of response tokens that have an engine log-prob."""
    ratio = torch.exp(torch.clamp(old_log_prob.float() - rollout_log_prob.float(), min=-20.0, max=20.0))
    return ratio, engine_token_mask(rollout_log_prob, response_mask)


def engine_token_mask(rollout_log_prob: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Response tokens that have an engine log-prob (the managers store 0 where the engine gave none)."""
    return response_mask.bool() & (rollout_log_prob != 0)


def rollout_is_metrics(
    weights: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float,
) -> dict[str, float]:
    """``rollout/is_weight_{mean,min,max}`` over response tokens with an engine log-prob, and
    ``rollout/is_truncated_frac``: the fraction of them whose ratio exceeded the cap."""
    ratio, valid = _ratio_and_valid(old_log_prob, rollout_log_prob, response_mask)
    if not bool(valid.any()):
        return {}
    w, ratio = weights[valid], ratio[valid]
    return {
        "rollout/is_weight_mean": float(w.mean()),
        "rollout/is_weight_min": float(w.min()),
        "rollout/is_weight_max": float(w.max()),
        "rollout/is_truncated_frac": float((ratio > threshold).float().mean()),
    }
