"""Upstream verl 0.9's other outcome estimators (one scalar reward per response, grouped by ``index``).

Registered in the advantage estimator registry (``verl/trainer/ppo/advantage_estimators.py``; re-exported by
``core_algos``) under upstream's names, so a recipe that selects
``algorithm.adv_estimator=grpo_passk | reinforce_plus_plus_baseline | opo | gpg`` runs unchanged. Each takes
upstream's keyword inputs (``verl/trainer/ppo/advantage.py``) and returns ``(advantages, returns)`` (identical),
both ``[B, L]``, zero outside ``response_mask``. ``s_i`` is row ``i``'s summed reward; a group is the rows sharing
an ``index`` key.
"""

from __future__ import annotations

from typing import Any

import torch

from verl.trainer.ppo.advantage_estimators import (
    AdvantageEstimator,
    _group_sums,
    _per_token,
    _row_scores,
    register_adv_est,
)
from verl.trainer.ppo.dapo import GroupIndex, group_relative_scores, index_to_group_ids
from verl.utils.torch_functional import masked_whiten

__all__ = [
    "compute_grpo_passk_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_gpg_outcome_advantage",
]


@register_adv_est(AdvantageEstimator.GRPO_PASSK)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k (arXiv 2503.19595): only the best row of each group gets ``max - second max`` (divided by the group's
    unbiased std + ``epsilon`` when normalising), every other row 0. As upstream, normalisation follows
    ``config.norm_adv_by_std_in_grpo`` (default True) when ``config`` is given; groups need at least 2 rows.

    Example: group ``[0.2, 1.0, 0.5]``, no normalisation: ``A = [0, 0.5, 0]``.
    """
    if config is not None:
        norm_adv_by_std_in_grpo = bool(config.get("norm_adv_by_std_in_grpo", True))
    scores = _row_scores(token_level_rewards)
    group_ids, num_groups = index_to_group_ids(index, scores.shape[0])
    advantages = torch.zeros_like(scores)
    for group in range(num_groups):
        rows = torch.nonzero(group_ids == group).flatten().to(scores.device)
        if rows.numel() < 2:
            raise ValueError(f"grpo_passk needs at least 2 responses per group; group {group} has {rows.numel()}")
        values = scores[rows]
        top = torch.topk(values, 2).values
        advantage = top[0] - top[1]
        if norm_adv_by_std_in_grpo:
            advantage = advantage / (values.std() + epsilon)
        advantages[rows[int(torch.argmax(values))]] = advantage
    result = _per_token(advantages, response_mask, token_level_rewards)
    return result, result


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (arXiv 2501.03262): ``s_i - mean_group`` (0 for a group of one: its mean counts as 0)
    on every valid token, then whitened over all valid tokens of the batch (``masked_whiten``) and masked.

    Example: groups ``[1, 0]`` and ``[1, 1]``, one token each: centred ``[0.5, -0.5, 0, 0]``, whitened
    ``[1.2247, -1.2247, 0, 0]``.
    """
    centred = group_relative_scores(_row_scores(token_level_rewards), index, epsilon, norm_adv_by_std=False)
    per_token = centred.unsqueeze(-1) * response_mask
    result = (masked_whiten(per_token, response_mask) * response_mask).to(token_level_rewards.dtype)
    return result, result


@register_adv_est(AdvantageEstimator.OPO)
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (arXiv 2505.23585): ``s_i - b_group`` with the length-weighted baseline
    ``b = sum_j len_j * s_j / sum_j len_j`` (``len`` = valid response tokens; 0 for a group of one).

    Example: one group, scores ``[1, 0]``, lengths ``[1, 3]``: ``b = 0.25``, ``A = [0.75, -0.25]``.
    """
    scores = _row_scores(token_level_rewards)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)
    group_ids, num_groups = index_to_group_ids(index, scores.shape[0])
    group_ids = group_ids.to(scores.device)
    counts = _group_sums(torch.ones_like(scores), group_ids, num_groups)
    weighted = _group_sums(lengths * scores, group_ids, num_groups)
    total_length = _group_sums(lengths, group_ids, num_groups)
    baseline = torch.where(counts > 1, weighted / total_length, torch.zeros_like(counts))
    result = _per_token(scores - baseline[group_ids], response_mask, token_level_rewards)
    return result, result


@register_adv_est(AdvantageEstimator.GPG)
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: ``alpha * (s_i - mean_group) / f_norm`` with ``alpha = B / max(#rows with a non-zero score, 1)``
    (computed, as upstream: the ``alpha`` argument is accepted and ignored); a group of one has mean 0.

    Example: groups ``[1, 0]`` and ``[0, 0]``: alpha = 4 / 1, ``A = [2, -2, 0, 0]``.
    """
    del alpha
    scores = _row_scores(token_level_rewards)
    scale = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    centred = group_relative_scores(scores, index, epsilon, norm_adv_by_std=False)
    result = _per_token(scale * centred / f_norm, response_mask, token_level_rewards)
    return result, result
