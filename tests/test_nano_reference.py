"""Numbers checks of the nano Multi-Conv GRPO reference (tests/nano_reference.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.nano_reference import (
    RolloutBatch,
    broadcast_advantages,
    grpo_trajectory_advantages,
    kl_penalty,
    loss_and_grads,
    make_padded_batch,
    nano_multiconv_grpo_step,
    ppo_clip_token_losses,
    response_log_probs,
)

# Worked example: 2 questions x 2 trajectories; trajectory t has CONVS[t] conversations.
CONVS = [3, 2, 1, 2]
UIDS = ["q0", "q0", "q1", "q1"]


def make_rollout(rewards: list[float], seed: int = 0, convs: list[int] = CONVS, uids: list[str] = UIDS) -> RolloutBatch:
    """Random token conversations, grouped by trajectory; prompts 3-8 tokens, responses 3-12."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses, sample_index, final_mask = [], [], [], []
    for traj, n_conv in enumerate(convs):
        for turn in range(n_conv):
            p_len = int(torch.randint(3, 9, (1,), generator=gen))
            r_len = int(torch.randint(3, 13, (1,), generator=gen))
            prompts.append(torch.randint(10, 2000, (p_len,), generator=gen).tolist())
            responses.append(torch.randint(10, 2000, (r_len,), generator=gen).tolist())
            sample_index.append(traj)
            final_mask.append(turn == n_conv - 1)
    return RolloutBatch(prompts, responses, sample_index, final_mask, list(uids), list(rewards))


@pytest.fixture
def policy(tiny_model_path):
    """A fresh float32 tiny policy (in train mode) and its pad id."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model.train()
    return model, model.config.pad_token_id


def test_padded_batch_layout():
    rb = RolloutBatch([[5, 6], [7]], [[8], [9, 10, 11]], [0, 1], [True, True], ["a", "b"], [1.0, 0.0])
    b = make_padded_batch(rb, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 8, 0, 0], [0, 7, 9, 10, 11]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 2, 2], [0, 0, 1, 2, 3]]
    assert b["responses"].tolist() == [[8, 0, 0], [9, 10, 11]]
    assert b["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]


def test_padded_log_probs_match_unpadded_forward(policy):
    """Padding, position ids and the logit shift must not change any response token's log-prob."""
    model, pad_id = policy
    rb = make_rollout([1, 0, 0, 1], seed=5)
    with torch.no_grad():
        padded = response_log_probs(model, make_padded_batch(rb, pad_id))
        for c, (prompt, response) in enumerate(zip(rb.prompt_ids, rb.response_ids)):
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
            log_probs = torch.log_softmax(logits, dim=-1)
            # Token response[t] sits at position len(prompt) + t and is predicted one position earlier.
            expected = torch.stack([log_probs[len(prompt) + t - 1, tok] for t, tok in enumerate(response)])
            assert torch.allclose(padded[c, : len(response)], expected, atol=1e-5), c


def test_worked_example_advantages(policy):
    # Group q0: rewards [1, 0] -> mean .5 -> [.5, -.5]; group q1: [1, 1] -> [0, 0].
    traj = grpo_trajectory_advantages([1, 0, 1, 1], UIDS)
    assert traj.tolist() == [0.5, -0.5, 0.0, 0.0]
    expected = [0.5, 0.5, 0.5, -0.5, -0.5, 0.0, 0.0, 0.0]
    mask = torch.tensor([[1, 1, 0]] * 8)
    token_adv = broadcast_advantages(traj, [0, 0, 0, 1, 1, 2, 3, 3], mask)
    assert token_adv.tolist() == [[a, a, 0.0] for a in expected]
    # The full step broadcasts the same way.
    model, pad_id = policy
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out = nano_multiconv_grpo_step(model, copy.deepcopy(model), make_rollout([1, 0, 1, 1]), opt, pad_id=pad_id)
    assert out["advantages"] == expected
    # With std: group of two [1, 0] has unbiased std sqrt(.5); a singleton group keeps mean 0, std 1.
    std_adv = grpo_trajectory_advantages([1, 0, 3], ["a", "a", "b"], norm_by_std=True)
    half = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert torch.allclose(std_adv, torch.tensor([half, -half, 3 / (1 + 1e-6)]))


def test_on_policy_first_loss_is_minus_token_mean_advantage(policy):
    model, pad_id = policy
    rewards = [1.0, 0.0, 0.0, 1.0]  # q0 -> [.5, -.5], q1 -> [-.5, .5]
    rb = make_rollout(rewards, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = nano_multiconv_grpo_step(model, copy.deepcopy(model), rb, opt, num_mini_batches=3, pad_id=pad_id)
    # 8 conversations in 3 mini-batches -> sizes 3, 3, 2; the first holds conversations 0..2.
    assert len(out["loss"]) == 3 and len(out["grad_norm"]) == 3
    conv_adv = [0.5, 0.5, 0.5, -0.5, -0.5, -0.5, 0.5, 0.5]
    lengths = [len(r) for r in rb.response_ids[:3]]
    expected = -sum(a * n for a, n in zip(conv_adv[:3], lengths)) / sum(lengths)
    assert out["advantages"] == conv_adv
    # ratio == 1 and kl == 0 on the first mini-batch: loss is -sum(A * mask) / sum(mask).
    assert out["pg_loss"][0] == pytest.approx(expected, abs=1e-5)
    assert out["kl_loss"][0] == pytest.approx(0.0, abs=1e-8)
    assert out["loss"][0] == pytest.approx(expected, abs=1e-5)
    assert out["clipfrac"][0] == 0.0
    assert all(math.isfinite(g) and g > 0 for g in out["grad_norm"])
    assert out["old_log_probs"].shape == out["batch"]["responses"].shape


def test_every_trainable_parameter_changes(policy):
    model, pad_id = policy
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # no decay: only grads move
    nano_multiconv_grpo_step(model, copy.deepcopy(model), make_rollout([1, 0, 0, 1], seed=2), opt, pad_id=pad_id)
    unchanged = [n for n, p in model.named_parameters() if p.requires_grad and torch.equal(p, before[n])]
    assert unchanged == []


def test_token_mean_is_invariant_to_micro_batching(policy):
    model, pad_id = policy
    rb = make_rollout([1, 0, 0, 1], seed=3)
    batch = make_padded_batch(rb, pad_id)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        log_prob = response_log_probs(model, batch)
    # Off-policy old/ref log-probs so that clipping and KL both contribute to the gradient.
    old_lp = log_prob + 0.3 * torch.randn(log_prob.shape, generator=gen)
    ref_lp = log_prob + 0.3 * torch.randn(log_prob.shape, generator=gen)
    traj = grpo_trajectory_advantages(rb.reward, rb.uid)
    adv = broadcast_advantages(traj, rb.sample_index, batch["response_mask"])
    args = (model, batch, old_lp, ref_lp, adv)
    kw = dict(kl_coef=0.1)

    loss_one, grads_one = loss_and_grads(*args, micro_splits=None, **kw)
    loss_two, grads_two = loss_and_grads(*args, micro_splits=[[0, 1, 2], [3, 4, 5, 6, 7]], **kw)
    assert loss_two == pytest.approx(loss_one, rel=1e-5)
    assert grads_one.keys() == grads_two.keys() and len(grads_one) > 0
    for name in grads_one:
        assert torch.allclose(grads_one[name], grads_two[name], rtol=1e-4, atol=1e-7), name

    # Sanity: averaging two per-micro-batch token-means (the bug the fix avoids) gives other grads.
    def sub(rows):
        index = torch.tensor(rows)
        return {k: v[index] for k, v in batch.items()}, old_lp[index], ref_lp[index], adv[index]

    naive = [loss_and_grads(model, *sub(rows), **kw)[1] for rows in ([0, 1, 2], [3, 4, 5, 6, 7])]
    assert any(not torch.allclose((naive[0][n] + naive[1][n]) / 2, grads_one[n], rtol=1e-3) for n in grads_one)


def test_second_mini_batch_sees_ratio_away_from_one(policy):
    model, pad_id = policy
    opt = torch.optim.Adam(model.parameters(), lr=5e-2)  # a deliberately huge step
    out = nano_multiconv_grpo_step(
        model, copy.deepcopy(model), make_rollout([1, 0, 0, 1], seed=4), opt, num_mini_batches=2, pad_id=pad_id
    )
    assert out["clipfrac"][0] == 0.0 and abs(out["ppo_kl"][0]) < 1e-5  # on-policy
    assert out["clipfrac"][1] > 0.0 and abs(out["ppo_kl"][1]) > 1e-3  # policy moved: ratio != 1
    assert out["kl_loss"][1] > 1e-4  # and drifted from the reference


def test_clip_and_kl_formulas_by_hand():
    old = torch.zeros(4)
    log_prob = torch.log(torch.tensor([1.5, 5.0, 0.5, 50.0]))  # ratios
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0])
    loss, clipped, clipped_lower = ppo_clip_token_losses(log_prob, old, adv, 0.2, 0.2, 3.0)
    # A>0, r=1.5: max(-1.5, -1.2) = -1.2 | A<0, r=5: max(5, 1.2)=5, dual clip -> 3
    # A<0, r=.5: max(.5, .8) = .8       | A<0, r=50: dual clip -> 3
    assert torch.allclose(loss, torch.tensor([-1.2, 3.0, 0.8, 3.0]))
    assert clipped.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert clipped_lower.tolist() == [0.0, 1.0, 0.0, 1.0]
    # low_var_kl (k3): kl = ref - logp = -1 -> exp(-1) + 1 - 1; huge gaps clamp at 10.
    k3 = kl_penalty(torch.tensor([-1.0, 0.0]), torch.tensor([-2.0, 30.0]), "low_var_kl")
    assert torch.allclose(k3, torch.tensor([math.exp(-1.0), 10.0]))
