"""Tests for verl/trainer/ppo/core_algos.py, verl/trainer/ppo/dapo.py and verl/utils/torch_functional.py.

Every expected number is derived by hand in the test (comments show the arithmetic).
"""

from __future__ import annotations

import math
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from verl.trainer.ppo import core_algos as ca
from verl.trainer.ppo.core_algos import (
    ADV_ESTIMATORS,
    AGG_MODES,
    AdaptiveKLController,
    AdvantageEstimator,
    FixedKLController,
    agg_loss,
    compute_entropy_loss,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_multiconv_advantage,
    compute_policy_loss,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_value_loss,
    filter_zero_variance_groups,
    get_adv_estimator_fn,
    get_kl_controller,
    get_policy_loss_fn,
    grad_acc_mode,
    kl_penalty,
    local_loss_normalizer,
    overlong_reward_penalty,
    trajectory_token_weights,
)
from verl.utils.torch_functional import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


def last_token_rewards(scores, mask):
    """[B, L] reward tensor with each row's score on its last valid token (as a reward manager writes it)."""
    rewards = torch.zeros(mask.shape)
    last = mask.sum(-1).long() - 1
    rewards[torch.arange(mask.shape[0]), last] = torch.tensor(scores, dtype=torch.float32)
    return rewards


# --------------------------------------------------------------------------------------------------------------
# torch_functional helpers
# --------------------------------------------------------------------------------------------------------------


def test_masked_helpers_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(masked_sum(values, mask), 7.0)  # 1 + 2 + 4
    close(masked_mean(values, mask), 7.0 / 3)
    close(masked_mean(values, mask, axis=-1), [1.5, 4.0])
    # unbiased variance of {1, 2, 4}: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 42/9, / (3 - 1)
    close(masked_var(values, mask), (42 / 9) / 2)
    close(masked_var(values, mask, unbiased=False), (42 / 9) / 3)
    whitened = masked_whiten(values, mask)
    close(whitened[0, 0], (1 - 7 / 3) / math.sqrt(21 / 9 + 1e-8))
    close(masked_whiten(values, mask, shift_mean=False)[0, 0], (1 - 7 / 3) / math.sqrt(21 / 9 + 1e-8) + 7 / 3)
    # an empty mask gives 0, not NaN
    close(masked_mean(values, torch.zeros_like(mask)), 0.0)
    with pytest.raises(ValueError, match="selects 1 position"):
        masked_var(values, torch.tensor([[1, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="no positions"):
        masked_var(values, torch.zeros_like(mask))


def test_entropy_and_logprobs_from_logits():
    # token 0: uniform over 3 -> H = ln 3; token 1: probs [1/2, 1/4, 1/4] -> H = 0.5 ln2 + 2 * 0.25 ln4 = 1.5 ln2
    logits = torch.tensor([[[0.0, 0.0, 0.0], [math.log(0.5), math.log(0.25), math.log(0.25)]]])
    close(entropy_from_logits(logits), [[math.log(3), 1.5 * math.log(2)]])
    close(entropy_from_logits(logits + 100.0), [[math.log(3), 1.5 * math.log(2)]], atol=1e-5)  # shift invariant
    labels = torch.tensor([[2, 0]])
    close(logprobs_from_logits(logits, labels), [[math.log(1 / 3), math.log(0.5)]])


# --------------------------------------------------------------------------------------------------------------
# GRPO / Dr.GRPO
# --------------------------------------------------------------------------------------------------------------


def test_grpo_unbiased_std_group_of_four():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    rewards = last_token_rewards([1.0, 0.0, 0.0, 1.0], mask)
    adv, returns = compute_grpo_outcome_advantage(rewards, mask, np.array(["q"] * 4))
    # mean 0.5; unbiased std = sqrt((4 * 0.25) / 3) = 0.57735 (population std would be 0.5)
    std = math.sqrt(1.0 / 3.0)
    assert abs(std - 0.5774) < 1e-4
    a = 0.5 / (std + 1e-6)
    expected = torch.tensor([[a, a, a], [-a, -a, 0], [-a, 0, 0], [a, a, a]])
    close(adv, expected)
    assert torch.equal(adv, returns)
    close(torch.tensor([1.0, 0.0, 0.0, 1.0]).std(), std)  # torch.std is the unbiased one


def test_dr_grpo_no_std_and_interleaved_groups():
    mask = torch.ones(4, 2)
    rewards = last_token_rewards([1.0, 0.0, 0.0, 1.0], mask)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, ["a", "b", "a", "b"], norm_adv_by_std_in_grpo=False)
    # group a = rows 0, 2: scores [1, 0], mean 0.5; group b = rows 1, 3: [0, 1], mean 0.5
    close(adv, [[0.5, 0.5], [-0.5, -0.5], [-0.5, -0.5], [0.5, 0.5]])


def test_grpo_singleton_group_and_all_equal_group():
    mask = torch.ones(4, 2)
    rewards = last_token_rewards([0.7, 1.0, 1.0, 1.0], mask)
    index = [0, 1, 1, 1]  # group 0 has one member; group 1 rewards all equal
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    close(adv[0], [0.7 / (1 + 1e-6)] * 2)  # singleton: mean 0, std 1
    close(adv[1:], torch.zeros(3, 2))  # std 0: (1 - 1) / (0 + eps) = 0
    adv_no_std, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    close(adv_no_std[0], [0.7, 0.7])
    close(adv_no_std[1:], torch.zeros(3, 2))


def test_grpo_index_length_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="index has 3 entries but 4 rows"):
        compute_grpo_outcome_advantage(torch.zeros(4, 2), torch.ones(4, 2), ["a", "a", "b"])


# --------------------------------------------------------------------------------------------------------------
# RLOO, REINFORCE++, ReMax, GAE
# --------------------------------------------------------------------------------------------------------------


def test_rloo_leave_one_out_and_singleton():
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1]], dtype=torch.float32)
    rewards = last_token_rewards([1.0, 0.0, 0.0, 1.0, 0.7], mask)
    adv, returns = compute_rloo_outcome_advantage(rewards, mask, ["q", "q", "q", "q", "solo"])
    # row 0: 1 - mean(0, 0, 1) = 2/3; row 1: 0 - mean(1, 0, 1) = -2/3; singleton: baseline 0 -> 0.7
    expected = torch.tensor([[2 / 3, 2 / 3], [-2 / 3, 0], [-2 / 3, -2 / 3], [2 / 3, 2 / 3], [0.7, 0.7]])
    close(adv, expected)
    assert torch.equal(adv, returns)


def test_reinforce_plus_plus_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    adv, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    # row 0: G2 = 1, G1 = 0 + 0.5 * 1 = 0.5, G0 = 0.25; row 1: G2 = 0 (padding), G1 = 1, G0 = 0.5
    close(returns, [[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]])
    # whiten over the 5 valid tokens {0.25, 0.5, 1, 0.5, 1}: mean 0.65, unbiased var 0.45 / 4 = 0.1125
    scale = 1 / math.sqrt(0.1125 + 1e-8)
    expected = [
        [(0.25 - 0.65) * scale, (0.5 - 0.65) * scale, (1 - 0.65) * scale],
        [(0.5 - 0.65) * scale, (1 - 0.65) * scale, 0.0],
    ]
    close(adv, expected, atol=1e-5)


def test_remax_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    adv, returns = compute_remax_outcome_advantage(rewards, torch.tensor([0.5, 2.0]), mask)
    close(returns, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # reversed cumulative sum of the masked rewards
    close(adv, [[0.5, 0.5, 0.5], [-1.0, -1.0, 0.0]])  # (returns - baseline) * mask


def test_gae_three_tokens_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    adv, returns = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    # t2: delta = 1 + 0.9 * 0 - 0.7 = 0.3                       A2 = 0.3
    # t1: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03                    A1 = 0.03 + 0.72 * 0.3 = 0.246
    # t0: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04                    A0 = 0.04 + 0.72 * 0.246 = 0.21712
    raw = [0.21712, 0.246, 0.3]
    close(returns, [[0.21712 + 0.5, 0.246 + 0.6, 0.3 + 0.7]], atol=1e-6)
    mean = sum(raw) / 3
    var = sum((x - mean) ** 2 for x in raw) / 2
    close(adv, [[(x - mean) / math.sqrt(var + 1e-8) for x in raw]], atol=1e-4)


def test_gae_skips_padding_values():
    # row 1 is one token shorter; the value 9.0 at its padding position must not leak into its advantages
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    _, returns = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 1: t1: delta = 1 - 0.6 = 0.4, A1 = 0.4; t0: delta = 0.9 * 0.6 - 0.5 = 0.04, A0 = 0.04 + 0.72 * 0.4 = 0.328
    close(returns[1, :2], [0.328 + 0.5, 0.4 + 0.6])
    close(returns[0], [0.71712, 0.846, 1.0])


# --------------------------------------------------------------------------------------------------------------
# Multi-Conv credit assignment (MemAgent)
# --------------------------------------------------------------------------------------------------------------

# 2 questions x 2 trajectories; trajectories 0, 1 answer q1 and 2, 3 answer q2; rewards [1, 0, 1, 1].
# Conversations per trajectory [3, 2, 1, 2], laid out turn-major like the generation manager does:
# memory turn 1 of trajectories 0, 1, 3; memory turn 2 of trajectory 0; then the four final answers.
MC_SCORES = torch.tensor([1.0, 0.0, 1.0, 1.0])
MC_INDEX = np.array(["q1", "q1", "q2", "q2"], dtype=object)
MC_SAMPLE_INDEX = torch.tensor([0, 1, 3, 0, 0, 1, 2, 3])
MC_MASK = torch.tensor(
    [
        [1, 1, 1, 0],  # c0 traj 0
        [1, 1, 0, 0],  # c1 traj 1
        [1, 1, 1, 1],  # c2 traj 3
        [1, 0, 0, 0],  # c3 traj 0
        [1, 1, 0, 0],  # c4 traj 0 (final)
        [1, 1, 1, 0],  # c5 traj 1 (final)
        [1, 0, 0, 0],  # c6 traj 2 (final, its only conversation)
        [1, 1, 0, 0],  # c7 traj 3 (final)
    ],
    dtype=torch.float32,
)


def test_multiconv_worked_example_dr_grpo():
    adv, returns, traj_adv = compute_multiconv_advantage(MC_SCORES, MC_INDEX, MC_SAMPLE_INDEX, MC_MASK)
    # q1: mean(1, 0) = 0.5 -> A = [0.5, -0.5]; q2: mean(1, 1) = 1 -> A = [0, 0]
    close(traj_adv, [0.5, -0.5, 0.0, 0.0])
    expected = torch.tensor(
        [
            [0.5, 0.5, 0.5, 0.0],
            [-0.5, -0.5, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
            [0.5, 0.0, 0.0, 0.0],
            [0.5, 0.5, 0.0, 0.0],
            [-0.5, -0.5, -0.5, 0.0],
            [0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    close(adv, expected)
    assert torch.equal(adv, returns)
    assert torch.all(adv[MC_MASK == 0] == 0)  # nothing outside the response mask
    assert adv.shape == MC_MASK.shape


def test_multiconv_with_std_and_registry_entry():
    fn = get_adv_estimator_fn("grpo_multiconv")
    adv, _, traj_adv = fn(MC_SCORES, MC_INDEX, MC_SAMPLE_INDEX, MC_MASK, norm_adv_by_std_in_grpo=True)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # q1: unbiased std of [1, 0] = sqrt(0.5); q2: std 0 -> 0
    close(traj_adv, [a, -a, 0.0, 0.0])
    close(adv[5], [-a, -a, -a, 0.0])


def test_multiconv_matches_grpo_on_final_conversations():
    # the trajectory advantage equals plain GRPO on the final-answer rows (one row per trajectory)
    final_rows = torch.tensor([4, 5, 6, 7])
    rewards = last_token_rewards(MC_SCORES.tolist(), MC_MASK[final_rows])
    grpo_adv, _ = compute_grpo_outcome_advantage(rewards, MC_MASK[final_rows], MC_INDEX, norm_adv_by_std_in_grpo=False)
    mc_adv, _, _ = compute_multiconv_advantage(MC_SCORES, MC_INDEX, MC_SAMPLE_INDEX, MC_MASK)
    close(mc_adv[final_rows], grpo_adv)


def test_multiconv_input_errors():
    with pytest.raises(ValueError, match=r"sample_index values must lie in \[0, 4\)"):
        compute_multiconv_advantage(MC_SCORES, MC_INDEX, torch.tensor([0, 1, 3, 0, 0, 1, 2, 4]), MC_MASK)
    with pytest.raises(ValueError, match="sample_index has 7 entries but response_mask has 8 rows"):
        compute_multiconv_advantage(MC_SCORES, MC_INDEX, MC_SAMPLE_INDEX[:7], MC_MASK)


def test_trajectory_token_weights_modes():
    assert torch.equal(trajectory_token_weights(MC_SAMPLE_INDEX, MC_MASK, "token"), torch.ones(8, 4))
    weights = trajectory_token_weights(MC_SAMPLE_INDEX, MC_MASK, "trajectory")
    # tokens per trajectory: t0 = 3 + 1 + 2 = 6, t1 = 2 + 3 = 5, t2 = 1, t3 = 4 + 2 = 6; N = 18, T* = 4
    # weight_i = 18 / (4 * n_i): t0 0.75, t1 0.9, t2 4.5, t3 0.75
    close(weights[:, 0], [0.75, 0.9, 0.75, 0.75, 0.75, 0.9, 4.5, 0.75])
    per_traj = torch.zeros(4).index_add_(0, MC_SAMPLE_INDEX, (weights * MC_MASK).sum(-1))
    close(per_traj, [4.5, 4.5, 4.5, 4.5])  # every trajectory carries the same total weight
    close(masked_mean(weights, MC_MASK), 1.0)  # mean weight over tokens is 1
    # token-mean of the weighted loss = mean over trajectories of each trajectory's own token mean
    loss = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10
    weighted = agg_loss(loss, MC_MASK, "token-mean", weights=weights)
    traj_means = []
    for traj in range(4):
        rows = MC_SAMPLE_INDEX == traj
        traj_means.append(masked_mean(loss[rows], MC_MASK[rows]))
    close(weighted, sum(traj_means) / 4, atol=1e-5)
    # ... which differs from the plain token-mean (so the choice matters)
    assert abs(agg_loss(loss, MC_MASK, "token-mean") - weighted) > 0.1
    with pytest.raises(ValueError, match="unknown turn weighting mode 'turn'; valid: token, trajectory"):
        trajectory_token_weights(MC_SAMPLE_INDEX, MC_MASK, "turn")


# --------------------------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------------------------


def policy_inputs(ratios, advantages):
    log_prob = torch.log(torch.tensor([ratios], dtype=torch.float32))
    return torch.zeros_like(log_prob), log_prob, torch.tensor([advantages], dtype=torch.float32)


def test_policy_loss_no_clip_is_minus_a_times_ratio():
    old, new, adv = policy_inputs([1.1, 0.9, 1.05], [1.0, -2.0, 0.5])
    loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(old, new, adv, torch.ones(1, 3), cliprange=0.2)
    close(loss, (-1.1 + 2 * 0.9 - 0.5 * 1.05) / 3)
    close(clipfrac, 0.0)
    close(clipfrac_lower, 0.0)
    close(ppo_kl, -(math.log(1.1) + math.log(0.9) + math.log(1.05)) / 3)  # mean(old - new)


@pytest.mark.parametrize(
    "ratio, advantage, expected_loss, clipped",
    [
        (1.25, 1.0, -1.25, 0.0),  # A > 0, 1.25 < 1 + 0.28: not clipped under clip-higher
        (1.30, 1.0, -1.28, 1.0),  # A > 0, clipped at 1 + 0.28
        (0.75, -1.0, 0.80, 1.0),  # A < 0, clipped at 1 - 0.2
    ],
)
def test_policy_loss_clip_higher(ratio, advantage, expected_loss, clipped):
    old, new, adv = policy_inputs([ratio], [advantage])
    loss, clipfrac, _, _ = compute_policy_loss(old, new, adv, torch.ones(1, 1), cliprange_low=0.2, cliprange_high=0.28)
    close(loss, expected_loss)
    close(clipfrac, clipped)


def test_policy_loss_clip_higher_batch_and_gradient():
    old, new, adv = policy_inputs([1.25, 1.3, 0.75], [1.0, 1.0, -1.0])
    new.requires_grad_(True)
    loss, clipfrac, _, _ = compute_policy_loss(old, new, adv, torch.ones(1, 3), cliprange_low=0.2, cliprange_high=0.28)
    close(loss, (-1.25 - 1.28 + 0.8) / 3)
    close(clipfrac, 2 / 3)
    loss.backward()
    # d/dlogp of -A * exp(logp) = -A * ratio (token-mean over 3); clipped tokens get no gradient
    close(new.grad, [[-1.25 / 3, 0.0, 0.0]])
    # the same ratio 1.25 IS clipped with the symmetric range 0.2
    old, new, adv = policy_inputs([1.25], [1.0])
    loss, clipfrac, _, _ = compute_policy_loss(old, new, adv, torch.ones(1, 1), cliprange=0.2)
    close(loss, -1.2)
    close(clipfrac, 1.0)


def test_policy_loss_dual_clip():
    old, new, adv = policy_inputs([5.0, 5.0], [-2.0, 2.0])
    loss, clipfrac, _, clipfrac_lower = compute_policy_loss(old, new, adv, torch.tensor([[1.0, 0.0]]), cliprange=0.2)
    # A = -2, ratio 5: -A * ratio = 10, -A * clip = 2.4 -> max 10; dual clip min(10, -A * 3 = 6) = 6
    close(loss, 6.0)
    close(clipfrac, 0.0)  # l2 (2.4) is not > l1 (10): the standard clip is not what bounds it
    close(clipfrac_lower, 1.0)
    # with A > 0 dual clip does not apply: ratio 5 clipped to 1.2 -> -2 * 1.2 = -2.4
    loss_pos, clipfrac_pos, _, lower_pos = compute_policy_loss(old, new, adv, torch.tensor([[0.0, 1.0]]), cliprange=0.2)
    close(loss_pos, -2.4)
    close(clipfrac_pos, 1.0)
    close(lower_pos, 0.0)
    # clip_ratio_c = 10: bound -A * 10 = 20 > the PPO-clipped loss 10 -> loss stays 10, dual clip inactive
    first_only = torch.tensor([[1.0, 0.0]])
    loss_c10, _, _, lower_c10 = compute_policy_loss(old, new, adv, first_only, cliprange=0.2, clip_ratio_c=10.0)
    close(loss_c10, 10.0, atol=1e-5)
    close(lower_c10, 0.0)


def test_policy_loss_multiplies_turn_weights_and_rollout_is_weights():
    """``weights`` (turn weighting) and ``rollout_is_weights`` (TIS) both scale each token's loss: their product,
    neither replacing the other (trajectory turn weighting with one-step-off training uses both)."""
    old, new, adv = policy_inputs([1.1, 0.9, 1.05], [1.0, -2.0, 0.5])
    mask = torch.ones(1, 3)
    turn = torch.tensor([[2.0, 1.0, 0.5]])
    tis = torch.tensor([[1.0, 0.5, 2.0]])
    per_token = [-1.1, 2 * 0.9, -0.5 * 1.05]  # -A * ratio, no token clipped
    for kwargs, factors in (
        ({"weights": turn}, [2.0, 1.0, 0.5]),
        ({"rollout_is_weights": tis}, [1.0, 0.5, 2.0]),
        ({"weights": turn, "rollout_is_weights": tis}, [2.0, 0.5, 1.0]),
    ):
        loss, *_ = compute_policy_loss(old, new, adv, mask, cliprange=0.2, **kwargs)
        close(loss, sum(v * f for v, f in zip(per_token, factors)) / 3)


def test_policy_loss_ratio_clamp_and_argument_errors():
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), 50.0)  # log-ratio clamped to 20 -> finite ratio exp(20)
    loss, _, ppo_kl, _ = compute_policy_loss(old, new, torch.tensor([[-1.0]]), torch.ones(1, 1), cliprange=0.2)
    close(loss, 3.0)  # dual clip bound -A * 3
    close(ppo_kl, -20.0)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1.0.*got 1.0"):
        compute_policy_loss(old, old, old, torch.ones(1, 1), cliprange=0.2, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="needs cliprange"):
        compute_policy_loss(old, old, old, torch.ones(1, 1))


# --------------------------------------------------------------------------------------------------------------
# Loss aggregation and micro-batch invariance
# --------------------------------------------------------------------------------------------------------------

AGG_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
AGG_MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)


def test_agg_loss_modes_by_hand():
    close(agg_loss(AGG_LOSS, AGG_MASK, "token-mean"), (1 + 2 + 4) / 3)
    close(agg_loss(AGG_LOSS, AGG_MASK, "seq-mean-token-sum"), (3 + 4) / 2)
    close(agg_loss(AGG_LOSS, AGG_MASK, "seq-mean-token-mean"), (1.5 + 4) / 2)
    close(agg_loss(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm"), (3 / 3 + 4 / 3) / 2)  # / L = 3, mean over rows
    close(agg_loss(AGG_LOSS, AGG_MASK, "seq-mean-token-sum-norm", loss_scale_factor=2.0), (1.5 + 2.0) / 2)
    weights = torch.tensor([[2.0, 1.0, 1.0], [0.5, 1.0, 1.0]])
    close(agg_loss(AGG_LOSS, AGG_MASK, "token-mean", weights=weights), (2 + 2 + 2) / 3)
    close(agg_loss(AGG_LOSS, AGG_MASK, "token-mean", global_token_count=7), 7 / 7)
    close(agg_loss(AGG_LOSS, AGG_MASK, "seq-mean-token-sum", global_seq_count=7), 7 / 7)


def test_agg_loss_padding_rows_and_empty_mask():
    loss = torch.cat([AGG_LOSS, torch.full((1, 3), 100.0)])
    mask = torch.cat([AGG_MASK, torch.zeros(1, 3)])  # an all-masked padding row
    for mode in AGG_MODES:
        close(agg_loss(loss, mask, mode), agg_loss(AGG_LOSS, AGG_MASK, mode))
    for mode in AGG_MODES:
        close(agg_loss(AGG_LOSS, torch.zeros(2, 3), mode), 0.0)
    with pytest.raises(
        ValueError, match="unknown loss_agg_mode 'token_mean'; valid: token-mean, token-sum, seq-mean-token-sum"
    ):
        agg_loss(AGG_LOSS, AGG_MASK, "token_mean")
    assert grad_acc_mode("token-mean") == "token"
    assert grad_acc_mode("seq-mean-token-sum-norm") == "seq"


# 4 rows with 1, 3, 2 and 4 response tokens (10 in total); row sums 8, 9, 6, 4
MB_LOSS = torch.tensor([[8.0, 0.0, 0.0, 0.0], [3.0, 3.0, 3.0, 0.0], [2.0, 4.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
MB_MASK = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)


@pytest.mark.parametrize(
    "split, naive_mean_of_means",
    [
        ([1, 3], (8 + 19 / 9) / 2),  # micro means 8/1 and (9 + 6 + 4)/9
        ([2, 2], (17 / 4 + 10 / 6) / 2),  # (8 + 9)/4 and (6 + 4)/6
        ([1, 1, 1, 1], (8 + 3 + 3 + 1) / 4),
    ],
)
def test_token_mean_with_global_count_is_split_invariant(split, naive_mean_of_means):
    full = agg_loss(MB_LOSS, MB_MASK, "token-mean")
    close(full, (8 + 9 + 6 + 4) / 10)  # 2.7
    losses = torch.split(MB_LOSS, split)
    masks = torch.split(MB_MASK, split)
    global_count = sum(local_loss_normalizer(m, "token-mean") for m in masks)
    assert global_count.item() == 10
    summed = sum(agg_loss(loss, m, "token-mean", global_token_count=global_count) for loss, m in zip(losses, masks))
    close(summed, full, atol=1e-6)
    # without the global count, averaging micro-batch means is NOT the token mean
    naive = sum(agg_loss(loss, m, "token-mean") for loss, m in zip(losses, masks)) / len(split)
    close(naive, naive_mean_of_means, atol=1e-5)
    assert abs(naive.item() - full.item()) > 0.2


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_seq_modes_with_global_count_are_split_invariant(mode):
    full = agg_loss(MB_LOSS, MB_MASK, mode)
    masks = torch.split(MB_MASK, [1, 3])
    global_seqs = sum(local_loss_normalizer(m, mode) for m in masks)
    assert global_seqs.item() == 4
    summed = sum(
        agg_loss(loss, m, mode, global_seq_count=global_seqs) for loss, m in zip(torch.split(MB_LOSS, [1, 3]), masks)
    )
    close(summed, full, atol=1e-6)


def test_policy_loss_gradient_is_split_invariant():
    torch.manual_seed(0)
    old = torch.randn(4, 4) * 0.1
    new = (old + torch.randn(4, 4) * 0.3).requires_grad_(True)
    adv = torch.tensor([[1.0], [-0.5], [0.25], [-1.0]]).expand(4, 4)
    full_loss = compute_policy_loss(old, new, adv, MB_MASK, cliprange=0.2)[0]
    (full_grad,) = torch.autograd.grad(full_loss, new)
    micro_total = 0.0
    for rows in ([0], [1, 2, 3]):
        micro_total = (
            micro_total
            + compute_policy_loss(old[rows], new[rows], adv[rows], MB_MASK[rows], cliprange=0.2, global_token_count=10)[
                0
            ]
        )
    (micro_grad,) = torch.autograd.grad(micro_total, new)
    close(micro_total, full_loss)
    close(micro_grad, full_grad)


# --------------------------------------------------------------------------------------------------------------
# KL, entropy, value loss, KL controllers
# --------------------------------------------------------------------------------------------------------------


def test_kl_penalty_types_by_hand():
    logprob = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])  # logprob - ref = [0.5, -1.0]
    close(kl_penalty(logprob, ref, "kl"), [0.5, -1.0])
    close(kl_penalty(logprob, ref, "k1"), [0.5, -1.0])
    close(kl_penalty(logprob, ref, "abs"), [0.5, 1.0])
    close(kl_penalty(logprob, ref, "mse"), [0.125, 0.5])
    close(kl_penalty(logprob, ref, "k2"), [0.125, 0.5])
    # k3: x = ref - logprob = [-0.5, 1.0]; exp(x) - x - 1
    expected_k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    close(kl_penalty(logprob, ref, "low_var_kl"), expected_k3)
    close(kl_penalty(logprob, ref, "k3"), expected_k3)


def test_low_var_kl_clamps():
    logprob = torch.tensor([0.0, -30.0, -1.0], requires_grad=True)
    ref = torch.tensor([-30.0, 0.0, -1.0])
    kld = kl_penalty(logprob, ref, "low_var_kl")
    # x = -30 -> clamped to -20: exp(-20) + 20 - 1 = 19.000000002 -> clamped to 10
    # x = +30 -> clamped to 20: exp(20) - 21 -> clamped to 10; x = 0 -> 0
    close(kld, [10.0, 10.0, 0.0])
    kld.sum().backward()
    assert torch.isfinite(logprob.grad).all()
    close(logprob.grad[:2], [0.0, 0.0])  # saturated by the clamps


def test_kl_penalty_full_and_unknown():
    with pytest.raises(NotImplementedError, match="full"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "full")
    with pytest.raises(ValueError, match="unknown kl_penalty 'k4'; valid: kl, k1, abs, mse, k2, low_var_kl, k3, full"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_entropy_loss():
    logits = torch.tensor([[[0.0, 0.0, 0.0], [math.log(0.5), math.log(0.25), math.log(0.25)]]])
    close(compute_entropy_loss(logits, torch.tensor([[1.0, 1.0]])), (math.log(3) + 1.5 * math.log(2)) / 2)
    close(compute_entropy_loss(logits, torch.tensor([[1.0, 0.0]])), math.log(3))


def test_value_loss_clipping():
    values = torch.zeros(1, 3)
    vpreds = torch.tensor([[1.0, 0.5, 0.1]])
    returns = torch.tensor([[0.5, 1.0, 1.0]])
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, values, torch.ones(1, 3), cliprange_value=0.2)
    # token 0: clip 1.0 -> 0.2: (1 - 0.5)^2 = 0.25 vs (0.2 - 0.5)^2 = 0.09 -> 0.25
    # token 1: clip 0.5 -> 0.2: (0.5 - 1)^2 = 0.25 vs (0.2 - 1)^2 = 0.64 -> 0.64 (counted as clipped)
    # token 2: inside the range: 0.81 both
    close(vf_loss, 0.5 * (0.25 + 0.64 + 0.81) / 3)
    close(vf_clipfrac, 1 / 3)


def test_kl_controllers():
    fixed = FixedKLController(kl_coef=0.001)
    fixed.update(current_kl=5.0, n_steps=100)
    assert fixed.value == 0.001
    adaptive = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    adaptive.update(current_kl=0.06, n_steps=10)  # error 0.2 (0.06/0.05 - 1) -> x (1 + 0.2 * 10/100)
    close(adaptive.value, 0.1 * 1.02)
    adaptive.update(current_kl=0.01, n_steps=10)  # error -0.8 clipped to -0.2 -> x 0.98
    close(adaptive.value, 0.1 * 1.02 * 0.98)
    assert isinstance(get_kl_controller({"type": "fixed", "kl_coef": 0.001}), FixedKLController)
    ctrl = get_kl_controller(types.SimpleNamespace(type="adaptive", kl_coef=0.2, target_kl=0.1, horizon=10))
    assert isinstance(ctrl, AdaptiveKLController) and ctrl.value == 0.2
    from omegaconf import OmegaConf

    assert get_kl_controller(OmegaConf.create({"type": "fixed", "kl_coef": 0.5})).value == 0.5
    with pytest.raises(ValueError, match="unknown kl_ctrl.type 'pid'"):
        get_kl_controller({"type": "pid", "kl_coef": 0.1})
    with pytest.raises(ValueError, match="needs kl_ctrl.target_kl and kl_ctrl.horizon"):
        get_kl_controller({"type": "adaptive", "kl_coef": 0.1})


# --------------------------------------------------------------------------------------------------------------
# DAPO pieces
# --------------------------------------------------------------------------------------------------------------


def test_overlong_reward_penalty():
    # Lmax = 20, Lcache = 4: no penalty up to 16, linear to -1 at 20, -1 beyond
    lengths = [10, 16, 17, 18, 20, 25]
    close(overlong_reward_penalty(lengths, 20, 4), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(overlong_reward_penalty(torch.tensor(lengths), 20, 4, penalty_factor=0.5), [0, 0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="overlong_buffer_len must be > 0, got 0"):
        overlong_reward_penalty(lengths, 20, 0)
    with pytest.raises(ValueError, match=r"overlong_buffer_len \(30\) must not exceed max_response_length \(20\)"):
        overlong_reward_penalty(lengths, 20, 30)


def test_filter_zero_variance_groups():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    index = ["a", "a", "b", "b", "c", "c", "d"]  # a: mixed; b: all 1; c: all 0; d: singleton
    keep, stats = filter_zero_variance_groups(scores, index)
    assert keep.tolist() == [True, True, False, False, False, False, True]
    assert stats == {"kept_groups": 2, "total_groups": 4, "kept_trajectories": 3}
    keep, stats = filter_zero_variance_groups(scores, index, keep_singletons=False)
    assert keep.tolist() == [True, True, False, False, False, False, False]
    assert stats == {"kept_groups": 1, "total_groups": 4, "kept_trajectories": 2}
    # mapped onto conversations through sample_index (Multi-Conv example: q1 mixed, q2 all 1)
    keep_traj, _ = filter_zero_variance_groups(MC_SCORES, MC_INDEX)
    assert keep_traj[MC_SAMPLE_INDEX].tolist() == [True, True, False, True, True, True, False, False]


# --------------------------------------------------------------------------------------------------------------
# Registries
# --------------------------------------------------------------------------------------------------------------


def test_registries_and_error_messages():
    assert get_adv_estimator_fn("grpo") is compute_grpo_outcome_advantage
    assert get_adv_estimator_fn(AdvantageEstimator.GAE) is compute_gae_advantage_return
    assert AdvantageEstimator.RLOO == "rloo"
    # every built-in name is registered (recipes loaded by other test modules may have added their own)
    assert {e.value for e in AdvantageEstimator} <= set(ADV_ESTIMATORS)
    with pytest.raises(ValueError, match="unknown adv_estimator 'grpoo'; valid: gae, gpg, grpo, grpo_multiconv") as err:
        get_adv_estimator_fn("grpoo")
    for name in ("grpo_passk", "opo", "reinforce_plus_plus, reinforce_plus_plus_baseline, remax, rloo"):
        assert name in str(err.value)
    assert get_policy_loss_fn("vanilla") is compute_policy_loss
    with pytest.raises(ValueError, match="unknown policy_loss 'gspo'; valid: vanilla"):
        get_policy_loss_fn("gspo")
    assert AGG_MODES == (
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    )
    with pytest.raises(ValueError, match="already registered"):
        ca.register_adv_est("grpo")(lambda *a: None)


# ----------------------------------------------------------------------------------------------------------
# upstream's other outcome estimators (group_estimators.py), by hand
# ----------------------------------------------------------------------------------------------------------


def _last_token_rewards(scores, width=2):
    rewards = torch.zeros(len(scores), width)
    rewards[:, 0] = torch.tensor(scores)
    return rewards


def test_grpo_passk_gives_the_best_row_the_gap_to_the_second():
    rewards, mask = _last_token_rewards([0.2, 1.0, 0.5, 1.0, 1.0]), torch.ones(5, 2)
    index = ["a", "a", "a", "b", "b"]
    plain, _ = ca.compute_grpo_passk_outcome_advantage(rewards, mask, index, config={"norm_adv_by_std_in_grpo": False})
    assert plain[:, 0].tolist() == pytest.approx([0.0, 0.5, 0.0, 0.0, 0.0])  # b ties: gap 0
    # normalised: gap / (unbiased std of [0.2, 1.0, 0.5] = 0.404145 + 1e-6); config=None keeps the keyword
    normed, _ = ca.compute_grpo_passk_outcome_advantage(rewards, mask, index)
    assert normed[:, 1].tolist() == pytest.approx([0.0, 1.237175, 0.0, 0.0, 0.0], abs=1e-5)
    assert get_adv_estimator_fn("grpo_passk") is ca.compute_grpo_passk_outcome_advantage
    with pytest.raises(ValueError, match="at least 2 responses per group; group 1 has 1"):
        ca.compute_grpo_passk_outcome_advantage(rewards[:4], mask[:4], ["a", "a", "a", "b"])


def test_reinforce_plus_plus_baseline_centres_per_group_then_whitens_the_batch():
    rewards = _last_token_rewards([1.0, 0.0, 1.0, 1.0])
    mask = torch.tensor([[1.0, 0.0]] * 4)
    adv, ret = ca.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, ["a", "a", "b", "b"])
    # centred [0.5, -0.5, 0, 0]; unbiased std over the 4 valid tokens sqrt(0.5 / 3) = 0.408248
    assert adv[:, 0].tolist() == pytest.approx([1.224745, -1.224745, 0.0, 0.0], abs=1e-5)
    assert adv[:, 1].tolist() == [0.0] * 4 and torch.equal(adv, ret)


def test_opo_subtracts_the_length_weighted_group_mean():
    rewards = _last_token_rewards([1.0, 0.0, 0.4], width=3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, _ = ca.compute_opo_outcome_advantage(rewards, mask, ["a", "a", "c"])
    # group a: b = (1 * 1 + 3 * 0) / 4 = 0.25; the lone row of c keeps its score
    want = [[0.75, 0.0, 0.0], [-0.25, -0.25, -0.25], [0.4, 0.4, 0.0]]
    torch.testing.assert_close(adv, torch.tensor(want))


def test_gpg_scales_the_centred_score_by_rows_over_non_zero_rows():
    rewards, mask = _last_token_rewards([1.0, 0.0, 0.0, 0.0]), torch.ones(4, 2)
    index = ["a", "a", "b", "b"]
    adv, _ = ca.compute_gpg_outcome_advantage(rewards, mask, index)  # alpha = 4 rows / 1 non-zero
    assert adv[:, 0].tolist() == pytest.approx([2.0, -2.0, 0.0, 0.0])
    adv, _ = ca.compute_gpg_outcome_advantage(rewards, mask, index, f_norm=2.0, alpha=99.0)  # alpha is computed
    assert adv[:, 1].tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])


@pytest.mark.parametrize(
    "module", ["group_estimators", "advantage_estimators", "core_algos"], ids=lambda m: f"{m}_first"
)
def test_each_estimator_module_imports_first_and_every_estimator_is_found(module):
    """The registry, upstream's group estimators and the core_algos facade import in any order (in a fresh
    interpreter, this one first); every upstream name is found through the registry."""
    code = (
        f"import verl.trainer.ppo.{module}\n"
        "from verl.trainer.ppo.advantage_estimators import get_adv_estimator_fn\n"
        "names = ['gae', 'grpo', 'rloo', 'reinforce_plus_plus', 'remax', 'grpo_multiconv',\n"
        "         'reinforce_plus_plus_baseline', 'opo', 'grpo_passk', 'gpg']\n"
        "print(sorted(get_adv_estimator_fn(n).__name__ for n in names))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "compute_gpg_outcome_advantage" in proc.stdout and "compute_multiconv_advantage" in proc.stdout
