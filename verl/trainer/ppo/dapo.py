"""Multi-Conv DAPO pieces (docs/spec.md#multi-conv-grpo; DAPO arXiv 2503.14476) as plain tensor functions.

* ``index_to_group_ids`` turns the per-row group key (the prompt ``uid`` shared by the n trajectories of one
  question) into dense integer ids; ``group_relative_scores`` is GRPO / Dr.GRPO on scalars per group.
* ``compute_multiconv_advantage`` is MemAgent's credit assignment: one advantage per *trajectory*, broadcast to
  every response token of every conversation (memory turns and final answer) of that trajectory;
  ``trajectory_token_weights`` is the documented choice of how those conversations weigh in the loss.
* ``filter_zero_variance_groups`` is DAPO's *dynamic sampling* condition ``0 < #correct < G``: groups whose
  trajectories all got the same reward have zero advantage (no policy gradient) and can be dropped.
* ``overlong_reward_penalty`` is DAPO's *soft overlong punishment* added to the correctness reward.

Everything is re-exported from ``verl.trainer.ppo.core_algos``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Union

import numpy as np
import torch

__all__ = [
    "index_to_group_ids",
    "group_relative_scores",
    "compute_multiconv_advantage",
    "trajectory_token_weights",
    "TURN_WEIGHTING_MODES",
    "filter_zero_variance_groups",
    "overlong_reward_penalty",
]

GroupIndex = Union[np.ndarray, Sequence[Hashable], torch.Tensor]


def index_to_group_ids(index: GroupIndex, expected_len: int, name: str = "index") -> tuple[torch.Tensor, int]:
    """Map per-row group keys to dense ids ``0..G-1`` in order of first appearance.

    Args:
        index: one hashable key per row (numpy array, list, or 1-D tensor), e.g. uid strings.
        expected_len: number of rows the keys must cover (raises ``ValueError`` naming ``name`` otherwise).
        name: argument name used in error messages.

    Returns:
        ``(group_ids, num_groups)``; ``group_ids`` is a ``torch.long`` tensor of shape ``[expected_len]``.

    Example: ``index_to_group_ids(["a", "b", "a"], 3) == (tensor([0, 1, 0]), 2)``.
    """
    keys = index.tolist() if isinstance(index, (torch.Tensor, np.ndarray)) else list(index)
    if len(keys) != expected_len:
        raise ValueError(f"{name} has {len(keys)} entries but {expected_len} rows were given")
    first_seen: dict[Any, int] = {}
    try:
        ids = [first_seen.setdefault(key, len(first_seen)) for key in keys]
    except TypeError as err:  # e.g. a list inside an object array
        raise TypeError(f"{name} entries must be hashable group keys: {err}") from err
    return torch.tensor(ids, dtype=torch.long), len(first_seen)


def group_relative_scores(
    scores: torch.Tensor, index: GroupIndex, epsilon: float, norm_adv_by_std: bool
) -> torch.Tensor:
    """GRPO on scalars ``[T]``: ``(s - mean_g) / (std_g + eps)``, or ``s - mean_g`` when ``norm_adv_by_std`` is
    False (Dr.GRPO). Groups are the rows sharing an ``index`` key; std is unbiased (``torch.std``, N-1).

    A group of size 1 uses mean 0 and std 1 (its advantage is its own score, up to ``1/(1+eps)``); a group whose
    scores are all equal gets 0. Computed in at least float32.
    """
    group_ids, num_groups = index_to_group_ids(index, scores.shape[0])
    group_ids = group_ids.to(scores.device)
    values = scores.to(torch.promote_types(scores.dtype, torch.float32))
    counts = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(
        0, group_ids, torch.ones_like(values)
    )
    means = torch.zeros_like(counts).index_add_(0, group_ids, values) / counts
    squared_dev = (values - means[group_ids]) ** 2
    unbiased_var = torch.zeros_like(counts).index_add_(0, group_ids, squared_dev) / (counts - 1).clamp_min(1)
    singleton = counts == 1
    means = torch.where(singleton, torch.zeros_like(means), means)
    stds = torch.where(singleton, torch.ones_like(means), unbiased_var.sqrt())
    advantages = values - means[group_ids]
    if norm_adv_by_std:
        advantages = advantages / (stds[group_ids] + epsilon)
    return advantages


@torch.no_grad()
def compute_multiconv_advantage(
    trajectory_scores: torch.Tensor,
    index: GroupIndex,
    sample_index: Union[torch.Tensor, Any],
    response_mask: torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-Conv GRPO credit assignment (MemAgent, paper Eq. 4; docs/spec.md#multi-conv-grpo).

    Args:
        trajectory_scores: ``[T]`` outcome reward per trajectory (from its final-answer conversation).
        index: ``[T]`` group key per trajectory (the prompt uid; the n trajectories of one question).
        sample_index: ``[C]`` trajectory row of each conversation (values in ``0..T-1``).
        response_mask: ``[C, L]`` response-token mask of each conversation.
        epsilon, norm_adv_by_std_in_grpo: as in ``compute_grpo_outcome_advantage``; the default ``False`` is
            MemAgent's ``grpo_use_adv=False`` (``A = R - mean(R_group)``, no std division).

    Returns:
        ``(advantages [C, L], returns [C, L], trajectory_advantages [T])`` with
        ``advantages[c, t] = trajectory_advantages[sample_index[c]] * response_mask[c, t]`` and
        ``returns = advantages``.
    """
    scores = torch.as_tensor(trajectory_scores).reshape(-1)
    num_trajectories = scores.shape[0]
    conv_to_traj = torch.as_tensor(sample_index, dtype=torch.long, device=scores.device).reshape(-1)
    if conv_to_traj.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"sample_index has {conv_to_traj.shape[0]} entries but response_mask has {response_mask.shape[0]} rows"
        )
    if conv_to_traj.numel() and (conv_to_traj.min() < 0 or conv_to_traj.max() >= num_trajectories):
        raise ValueError(
            f"sample_index values must lie in [0, {num_trajectories}); got min {int(conv_to_traj.min())}, "
            f"max {int(conv_to_traj.max())}"
        )
    trajectory_advantages = group_relative_scores(scores, index, epsilon, norm_adv_by_std_in_grpo)
    per_conversation = trajectory_advantages[conv_to_traj].to(response_mask.device)
    advantages = per_conversation.unsqueeze(-1) * response_mask.to(per_conversation.dtype)
    return advantages, advantages, trajectory_advantages


TURN_WEIGHTING_MODES = ("token", "trajectory")


@torch.no_grad()
def trajectory_token_weights(
    sample_index: Union[torch.Tensor, Any], response_mask: torch.Tensor, mode: str = "token"
) -> torch.Tensor:
    """Per-token loss weights ``[C, L]`` deciding how the conversations (turns) of a trajectory are weighted.

    * ``"token"`` (MemAgent as released): every response token weighs the same (all weights 1), so a
      trajectory with more chunks / longer memories contributes more gradient (docs/spec.md#worked-example).
    * ``"trajectory"``: every trajectory's tokens sum to the same total weight. With ``N`` = masked tokens in
      the batch, ``T*`` = trajectories with at least one masked token and ``n_i`` = masked tokens of
      trajectory ``i`` (all its conversations), each token of trajectory ``i`` gets ``N / (T* * n_i)``. The
      weights average to 1 over the masked tokens, so under ``token-mean`` the loss becomes the mean over
      trajectories of each trajectory's own token-mean. Rows of trajectories without tokens get 0.

    The weights are constant per row (also on masked-out positions; ``agg_loss`` applies the mask).
    Compute them on the same set of rows whose token count normalises the loss (the whole mini-batch,
    before splitting into micro-batches), then slice them together with the rows.
    """
    mask = response_mask.to(torch.float32)
    if mode == "token":
        return torch.ones_like(mask)
    if mode != "trajectory":
        raise ValueError(f"unknown turn weighting mode '{mode}'; valid: {', '.join(TURN_WEIGHTING_MODES)}")
    conv_to_traj = torch.as_tensor(sample_index, dtype=torch.long, device=mask.device).reshape(-1)
    if conv_to_traj.shape[0] != mask.shape[0]:
        raise ValueError(f"sample_index has {conv_to_traj.shape[0]} entries but response_mask has {mask.shape[0]} rows")
    if conv_to_traj.numel() == 0:
        return torch.ones_like(mask)
    tokens_per_conv = mask.sum(dim=-1)
    num_slots = int(conv_to_traj.max().item()) + 1
    tokens_per_traj = torch.zeros(num_slots, device=mask.device).index_add_(0, conv_to_traj, tokens_per_conv)
    active = tokens_per_traj > 0
    total_tokens = tokens_per_conv.sum()
    num_active = active.sum()
    weight_if_active = total_tokens / (num_active.clamp_min(1) * tokens_per_traj.clamp_min(1))
    traj_weight = torch.where(active, weight_if_active, torch.zeros_like(tokens_per_traj))
    return traj_weight[conv_to_traj].unsqueeze(-1).expand_as(mask).clone()


def filter_zero_variance_groups(
    scores: torch.Tensor, index: GroupIndex, keep_singletons: bool = True
) -> tuple[torch.Tensor, dict[str, int]]:
    """Keep the rows of groups whose rewards are not all equal (DAPO dynamic-sampling condition).

    Args:
        scores: ``[T]`` scalar reward per trajectory row (e.g. ``token_level_rewards.sum(-1)``).
        index: ``[T]`` group key per row (the prompt uid).
        keep_singletons: what to do with a group of size 1, whose reward std is undefined. Default ``True``
            keeps it, as the MemAgent filter does ("keep uids with std > 0 or a single member").

    Returns:
        ``(keep_mask, stats)``: ``keep_mask`` is a bool tensor ``[T]`` over trajectory rows (map it onto
        conversations with ``keep_mask[sample_index]``); ``stats`` has ``kept_groups``, ``total_groups`` and
        ``kept_trajectories``.

    A group has std > 0 exactly when its max differs from its min, which is what is tested (no float
    round-off from computing a std).
    """
    scores = torch.as_tensor(scores).reshape(-1)
    group_ids, num_groups = index_to_group_ids(index, scores.shape[0])
    values = scores.detach().to(torch.float64).cpu()
    group_max = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(
        0, group_ids, values, reduce="amax"
    )
    group_min = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(
        0, group_ids, values, reduce="amin"
    )
    group_size = torch.zeros(num_groups, dtype=torch.long).index_add_(0, group_ids, torch.ones_like(group_ids))
    keep_group = group_max > group_min
    if keep_singletons:
        keep_group = keep_group | (group_size == 1)
    keep_mask = keep_group[group_ids].to(scores.device)
    stats = {
        "kept_groups": int(keep_group.sum().item()),
        "total_groups": num_groups,
        "kept_trajectories": int(keep_mask.sum().item()),
    }
    return keep_mask, stats


def overlong_reward_penalty(
    response_lengths: Union[torch.Tensor, Sequence[int]],
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment, one value per sample (to be added to the correctness reward).

    With ``Lmax = max_response_length``, ``Lcache = overlong_buffer_len`` and ``L`` the response length:

    * ``L <= Lmax - Lcache``            -> 0
    * ``Lmax - Lcache < L <= Lmax``     -> ``-(L - (Lmax - Lcache)) / Lcache * penalty_factor`` (linear to
      ``-penalty_factor`` at ``L = Lmax``)
    * ``L > Lmax``                      -> ``-penalty_factor``

    Example: ``Lmax=20, Lcache=4``: lengths ``[16, 17, 20, 25]`` -> ``[0, -0.25, -1, -1]``.
    """
    if overlong_buffer_len <= 0:
        raise ValueError(f"overlong_buffer_len must be > 0, got {overlong_buffer_len}")
    if overlong_buffer_len > max_response_length:
        raise ValueError(
            f"overlong_buffer_len ({overlong_buffer_len}) must not exceed max_response_length ({max_response_length})"
        )
    lengths = torch.as_tensor(response_lengths, dtype=torch.float32)
    expected_len = max_response_length - overlong_buffer_len
    exceed = (lengths - expected_len).clamp(min=0.0, max=float(overlong_buffer_len))
    return -exceed / overlong_buffer_len * penalty_factor
