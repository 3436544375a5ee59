"""Nano reference: one Multi-Conv GRPO update step in plain, single-process PyTorch.

This is the numerical oracle that the distributed trainer is tested against (docs/spec.md#multi-conv-grpo,
#policy-loss, #kl-entropy-and-clipping). It deliberately does NOT import ``verl.trainer.ppo.core_algos``: every formula
is written out here so that it is an independent check.

One step, in words:
  1. A rollout is a flat list of conversations; ``sample_index[c]`` says which trajectory
     conversation ``c`` belongs to. Rewards live on trajectories.
  2. Trajectory advantage A_i = R_i - mean(R of its uid group) (optionally / (std + eps)).
  3. Every response token of every conversation of trajectory i gets A_i.
  4. Old log-probs (policy before the update) and ref log-probs are computed once, without grad.
  5. Conversations are split in order into mini-batches; each mini-batch gets one optimizer step
     on loss = token-mean(PPO-clip loss) + kl_coef * token-mean(KL), where the token-mean runs over
     ALL response tokens of the mini-batch (micro-batches are normalised by that same count).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RolloutBatch:
    """A multi-conversation rollout. Conversation-level lists have one entry per conversation,
    trajectory-level lists one entry per trajectory."""

    prompt_ids: list[list[int]]  # per conversation, unpadded
    response_ids: list[list[int]]  # per conversation, unpadded
    sample_index: list[int]  # per conversation: index of its trajectory
    final_mask: list[bool]  # per conversation: True for the trajectory's final-answer turn
    uid: list[str]  # per trajectory: GRPO group id (one per question)
    reward: list[float]  # per trajectory: reward of the final answer


def make_padded_batch(rb: RolloutBatch, pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad prompts and right-pad responses to the batch maximum; return the tensors."""
    num_conv = len(rb.prompt_ids)
    prompt_len = max(len(p) for p in rb.prompt_ids)
    response_len = max(max(len(r) for r in rb.response_ids), 1)
    prompts = torch.full((num_conv, prompt_len), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(num_conv, prompt_len, dtype=torch.long)
    responses = torch.full((num_conv, response_len), pad_id, dtype=torch.long)
    response_mask = torch.zeros(num_conv, response_len, dtype=torch.long)
    for c, (p, r) in enumerate(zip(rb.prompt_ids, rb.response_ids)):
        if len(p) > 0:  # left padding: the prompt sits at the right end
            prompts[c, prompt_len - len(p) :] = torch.tensor(p)
            prompt_mask[c, prompt_len - len(p) :] = 1
        responses[c, : len(r)] = torch.tensor(r, dtype=torch.long)  # right padding
        response_mask[c, : len(r)] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (torch.cumsum(attention_mask, dim=1) - 1).clamp(min=0)
    return {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": responses,
        "response_mask": response_mask,
    }


def select_rows(batch: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    """The same tensors restricted to the given conversation rows (padding width unchanged)."""
    index = torch.tensor(rows, dtype=torch.long)
    return {key: value[index] for key, value in batch.items()}


def response_log_probs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log pi(response token | everything before it), shape [num_conversations, response_len]."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
    )
    response_len = batch["responses"].shape[1]
    # Logits at position t predict token t+1: the response tokens are predicted by the
    # positions from (last prompt position) to (second-to-last position).
    logits = out.logits[:, -response_len - 1 : -1, :].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return torch.gather(log_probs, dim=-1, index=batch["responses"].unsqueeze(-1)).squeeze(-1)


def grpo_trajectory_advantages(
    rewards: list[float], uids: list[str], norm_by_std: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = R_i - mean(group) (Dr.GRPO), or (R_i - mean) / (std + eps) when ``norm_by_std``.

    Groups are trajectories sharing a uid. A group of size 1 has mean 0 and std 1; std is unbiased."""
    if len(rewards) != len(uids):
        raise ValueError(f"rewards has {len(rewards)} entries but uids has {len(uids)}")
    r = torch.tensor(rewards, dtype=torch.float32)
    adv = torch.zeros_like(r)
    for group in dict.fromkeys(uids):  # unique uids, first-seen order
        members = torch.tensor([i for i, u in enumerate(uids) if u == group])
        values = r[members]
        mean = values.mean() if len(members) > 1 else torch.tensor(0.0)
        std = values.std(unbiased=True) if len(members) > 1 else torch.tensor(1.0)
        adv[members] = (values - mean) / (std + eps) if norm_by_std else values - mean
    return adv


def broadcast_advantages(traj_adv: torch.Tensor, sample_index: list[int], response_mask: torch.Tensor) -> torch.Tensor:
    """Token-level advantages: advantages[c, t] = A[sample_index[c]] * response_mask[c, t]."""
    per_conversation = traj_adv[torch.tensor(sample_index, dtype=torch.long)]
    return per_conversation.unsqueeze(1) * response_mask.float()


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate of pi_theta from pi_ref."""
    if kl_type == "low_var_kl":  # k3 estimator, clamped as upstream verl
        kl = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
        return (torch.exp(kl) - kl - 1.0).clamp(-10.0, 10.0)
    if kl_type == "kl":  # k1
        return log_prob - ref_log_prob
    if kl_type == "mse":  # k2
        return 0.5 * (log_prob - ref_log_prob).square()
    raise ValueError(f"kl_type must be 'low_var_kl', 'kl' or 'mse', got {kl_type!r}")


def ppo_clip_token_losses(log_prob, old_log_prob, advantages, clip_low, clip_high, clip_ratio_c):
    """Per-token PPO-clip loss with dual clip for A < 0; also returns clip indicators."""
    ratio = torch.exp(log_prob - old_log_prob)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)  # pessimistic of the two
    dual_clip_bound = -advantages * clip_ratio_c  # caps the loss when A < 0 and the ratio is huge
    loss = torch.where(advantages < 0, torch.minimum(loss, dual_clip_bound), loss)
    clipped = (loss_clipped > loss_unclipped).float()
    clipped_lower = ((advantages < 0) & (dual_clip_bound < torch.maximum(loss_unclipped, loss_clipped))).float()
    return loss, clipped, clipped_lower


def accumulate_minibatch_grads(model, mini, old_lp, ref_lp, adv, cfg, micro_splits=None) -> dict:
    """Backward the mini-batch loss into ``.grad`` (accumulating), micro-batch by micro-batch.

    ``mini`` holds the mini-batch tensors; ``micro_splits`` lists row-index lists within it (default:
    one micro-batch). Every micro-batch's token sums are divided by the token count of the WHOLE
    mini-batch, so the accumulated gradient is that of the mini-batch token-mean."""
    num_rows = mini["response_mask"].shape[0]
    micro_splits = micro_splits if micro_splits is not None else [list(range(num_rows))]
    n_tokens = mini["response_mask"].sum().clamp(min=1).float()
    sums = {"pg_loss": 0.0, "kl_loss": 0.0, "clipfrac": 0.0, "clipfrac_lower": 0.0, "ppo_kl": 0.0}
    for rows in micro_splits:
        micro = select_rows(mini, rows)
        mask = micro["response_mask"].float()
        idx = torch.tensor(rows, dtype=torch.long)
        log_prob = response_log_probs(model, micro)
        pg, clipped, clipped_lower = ppo_clip_token_losses(
            log_prob, old_lp[idx], adv[idx], cfg["clip_low"], cfg["clip_high"], cfg["clip_ratio_c"]
        )
        kl = kl_penalty(log_prob, ref_lp[idx], cfg["kl_type"])
        pg_sum, kl_sum = (pg * mask).sum(), (kl * mask).sum()
        ((pg_sum + cfg["kl_coef"] * kl_sum) / n_tokens).backward()
        sums["pg_loss"] += pg_sum.item()
        sums["kl_loss"] += kl_sum.item()
        sums["clipfrac"] += (clipped * mask).sum().item()
        sums["clipfrac_lower"] += (clipped_lower * mask).sum().item()
        sums["ppo_kl"] += ((old_lp[idx] - log_prob.detach()) * mask).sum().item()
    stats = {key: value / n_tokens.item() for key, value in sums.items()}  # token-means
    stats["loss"] = stats["pg_loss"] + cfg["kl_coef"] * stats["kl_loss"]
    return stats


def loss_and_grads(model, mini, old_lp, ref_lp, adv, micro_splits=None, **cfg_overrides):
    """Zero grads, accumulate the mini-batch gradient over ``micro_splits``; return (loss, grads)."""
    cfg = dict(clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0, kl_coef=0.001, kl_type="low_var_kl")
    cfg.update(cfg_overrides)
    model.zero_grad(set_to_none=True)
    stats = accumulate_minibatch_grads(model, mini, old_lp, ref_lp, adv, cfg, micro_splits)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return stats["loss"], grads


def nano_multiconv_grpo_step(
    model,
    ref_model,
    rb: RolloutBatch,
    optimizer,
    clip_low=0.2,
    clip_high=0.2,
    clip_ratio_c=3.0,
    kl_coef=0.001,
    kl_type="low_var_kl",
    norm_by_std=False,
    num_mini_batches=1,
    max_grad_norm=1.0,
    pad_id: int = 0,
) -> dict:
    """One Multi-Conv GRPO update step of ``model`` (in place, through ``optimizer``).

    Conversations are split in order into ``num_mini_batches`` contiguous parts (np.array_split
    sizes); each part gets one optimizer step after ``clip_grad_norm_(max_grad_norm)``.
    Returns lists with one float per mini-batch (``loss, pg_loss, kl_loss, grad_norm, clipfrac,
    clipfrac_lower, ppo_kl``; token-means over the mini-batch, grad_norm before clipping), plus
    ``advantages`` (one float per conversation), ``token_advantages``, ``old_log_probs`` and
    ``ref_log_probs`` ([C, R] tensors) and the padded ``batch`` they refer to."""
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual clip, got {clip_ratio_c}")
    num_conv = len(rb.prompt_ids)
    if not 1 <= num_mini_batches <= num_conv:
        raise ValueError(f"num_mini_batches={num_mini_batches} must be in [1, {num_conv} conversations]")
    cfg = dict(clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c, kl_coef=kl_coef, kl_type=kl_type)
    batch = make_padded_batch(rb, pad_id)

    # Advantages: per trajectory from the uid groups, then broadcast to every response token.
    traj_adv = grpo_trajectory_advantages(rb.reward, rb.uid, norm_by_std=norm_by_std)
    adv = broadcast_advantages(traj_adv, rb.sample_index, batch["response_mask"])

    # Old (behaviour) and reference log-probs, computed once before any update.
    with torch.no_grad():
        old_lp = response_log_probs(model, batch)
        ref_lp = response_log_probs(ref_model, batch)

    metric_names = ["loss", "pg_loss", "kl_loss", "grad_norm", "clipfrac", "clipfrac_lower", "ppo_kl"]
    metrics: dict[str, list[float]] = {name: [] for name in metric_names}
    for rows in np.array_split(np.arange(num_conv), num_mini_batches):  # contiguous, uneven allowed
        rows = rows.tolist()
        idx = torch.tensor(rows, dtype=torch.long)
        optimizer.zero_grad(set_to_none=True)
        mini = select_rows(batch, rows)
        stats = accumulate_minibatch_grads(model, mini, old_lp[idx], ref_lp[idx], adv[idx], cfg)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for key, value in stats.items():
            metrics[key].append(value)
        metrics["grad_norm"].append(float(grad_norm))

    return {
        **metrics,
        "advantages": traj_adv[torch.tensor(rb.sample_index, dtype=torch.long)].tolist(),
        "token_advantages": adv,
        "old_log_probs": old_lp,
        "ref_log_probs": ref_lp,
        "batch": batch,
    }
