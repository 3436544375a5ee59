"""Core RL algorithms (verl-compatible names and positional signatures), plain torch, no DataProto.

Contents:
* advantage estimators (GAE, GRPO / Dr.GRPO, RLOO, REINFORCE++, ReMax and their registry from
  ``advantage_estimators``; upstream's pass@k, REINFORCE++-baseline, OPO and GPG from ``group_estimators``) and,
  re-exported from
  ``verl.trainer.ppo.dapo``, the Multi-Conv credit assignment of MemAgent (``compute_multiconv_advantage``: one
  scalar advantage per trajectory, broadcast to every response token of every conversation of that trajectory)
  plus the turn-weighting choice (``trajectory_token_weights``);
* loss aggregation (``agg_loss``, upstream verl 0.9 signature plus our ``global_token_count``/``global_seq_count``)
  with global normalisers so that a mini-batch loss does not depend on how it is split into micro-batches or ranks;
* PPO clipped policy loss with decoupled clip range (DAPO clip-higher) and dual clip, KL penalties, entropy and
  value losses, KL controllers;
* registries (``ADV_ESTIMATORS``, ``POLICY_LOSSES``, ``AGG_MODES``) with clear errors for unknown names;
* DAPO helpers (zero-variance group filter, overlong penalty) re-exported from ``verl.trainer.ppo.dapo``.

Shapes: ``[B, L]`` = (rows, response tokens); ``response_mask`` is 1 on response tokens that count.
Advantages and returns are computed without gradient.

Calling convention for registered estimators (upstream verl's ``compute_advantage``, here
``verl.trainer.ppo.advantage.compute_advantage``, which the single-turn trainer calls for every estimator):
keyword arguments ``token_level_rewards``, ``response_mask``, ``config`` (the ``algorithm`` config),
``norm_adv_by_std_in_grpo``, ``index`` (the ``uid`` array) and, when the batch has them,
``reward_baselines``/``values`` (plus ``gamma``/``lam`` for ``gae``); an estimator without ``**kwargs`` receives
only the names in its signature (``call_adv_estimator``). It returns ``(advantages, returns)``, both ``[B, L]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from verl.trainer.ppo.advantage_estimators import (
    ADV_ESTIMATORS,
    AdvantageEstimator,
    _cfg_get,
    _valid_names,
    call_adv_estimator,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    register_adv_est,
)
from verl.trainer.ppo.dapo import (
    TURN_WEIGHTING_MODES,
    compute_multiconv_advantage,
    filter_zero_variance_groups,
    group_relative_scores,
    index_to_group_ids,
    overlong_reward_penalty,
    trajectory_token_weights,
)
from verl.trainer.ppo.group_estimators import (  # importing it registers them
    compute_gpg_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
)
from verl.utils.torch_functional import entropy_from_logits, masked_mean, masked_sum

__all__ = [
    "AdvantageEstimator",
    "ADV_ESTIMATORS",
    "register_adv_est",
    "get_adv_estimator_fn",
    "call_adv_estimator",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_multiconv_advantage",
    "trajectory_token_weights",
    "TURN_WEIGHTING_MODES",
    "AGG_MODES",
    "agg_loss",
    "grad_acc_mode",
    "local_loss_normalizer",
    "POLICY_LOSSES",
    "register_policy_loss",
    "get_policy_loss_fn",
    "compute_policy_loss",
    "compute_policy_loss_vanilla",
    "KL_PENALTY_TYPES",
    "UNSUPPORTED_KL_PENALTY_TYPES",
    "kl_penalty",
    "compute_rewards",
    "compute_entropy_loss",
    "compute_value_loss",
    "FixedKLController",
    "AdaptiveKLController",
    "get_kl_controller",
    "filter_zero_variance_groups",
    "overlong_reward_penalty",
    "index_to_group_ids",
    "group_relative_scores",
]


# ----------------------------------------------------------------------------------------------------------
# Loss aggregation
# ----------------------------------------------------------------------------------------------------------

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def grad_acc_mode(loss_agg_mode: str) -> str:
    """``"token"`` for ``token-*`` and ``"seq"`` for the ``seq-mean-*`` modes: which count normalises the loss
    (``token-sum`` divides by nothing; its count is passed and ignored)."""
    _check_agg_mode(loss_agg_mode)
    return loss_agg_mode.split("-")[0]


def _check_agg_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode '{loss_agg_mode}'; valid: {', '.join(AGG_MODES)}")


def local_loss_normalizer(loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """The count ``agg_loss`` divides by for these rows: masked tokens (token mode) or rows with >= 1 masked
    token (seq modes). Sum it over all micro-batches (and all-reduce over ranks) to get the
    ``global_token_count`` / ``global_seq_count`` of a mini-batch."""
    mask = loss_mask.to(torch.float32)
    if grad_acc_mode(loss_agg_mode) == "token":
        return mask.sum()
    return (mask.sum(dim=-1) > 0).to(torch.float32).sum()


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Optional[Union[float, torch.Tensor]] = None,
    global_batch_size: Optional[Union[float, torch.Tensor]] = None,
    loss_scale_factor: Optional[float] = None,
    *,
    global_token_count: Optional[Union[float, torch.Tensor]] = None,
    global_seq_count: Optional[Union[float, torch.Tensor]] = None,
    weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Aggregate a ``[B, L]`` micro-batch loss matrix into a scalar (upstream verl 0.9 signature).

    Modes (``m`` = mask, ``w`` = optional per-token ``weights`` multiplied into ``loss_mat``, ``D`` = ``dp_size``):

    * ``token-mean``: ``sum(loss * m) / N * D`` with ``N`` = ``global_token_count`` or ``batch_num_tokens``
      (the token count of the whole mini-batch over all ranks), else this micro-batch's ``sum(m)``. With the global
      count each micro-batch returns its share and the shares *add up* to the mini-batch token-mean, whatever
      the split (MemAgent's gradient-accumulation fix, docs/spec.md#policy-loss).
    * ``token-sum``: ``sum(loss * m) * D`` (no normaliser).
    * ``seq-mean-token-sum``: per row ``sum_t loss * m``, then ``sum over rows / S * D``.
    * ``seq-mean-token-mean``: per row ``sum_t loss * m / sum_t m`` (0 for an empty row), then ``/ S * D``.
    * ``seq-mean-token-sum-norm`` (Dr.GRPO): per row ``sum_t loss * m / loss_scale_factor`` (default
      ``loss_mask.shape[-1]``, keep it constant across training), then ``/ S * D``: the mean over rows, as in the
      Dr.GRPO objective. Upstream returns the *sum* over rows / ``loss_scale_factor`` here (docs/differences.md).

    ``S`` = ``global_seq_count`` or ``global_batch_size``, else the number of rows with at least one masked token
    (padding rows with an all-zero mask are not counted). ``global_token_count``/``global_seq_count`` are our
    names for ``batch_num_tokens``/``global_batch_size``; give one of each pair. ``D`` undoes the gradient
    average over data-parallel ranks; callers that scale the loss by the number of ranks themselves (our actor
    and critic) leave ``dp_size=1``.
    """
    _check_agg_mode(loss_agg_mode)
    token_count = _one_of("global_token_count", global_token_count, "batch_num_tokens", batch_num_tokens)
    seq_count = _one_of("global_seq_count", global_seq_count, "global_batch_size", global_batch_size)
    mask = loss_mask.to(loss_mat.dtype)
    if weights is not None:
        loss_mat = loss_mat * weights.to(loss_mat.dtype)
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size
    if loss_agg_mode == "token-mean":
        denominator = mask.sum() if token_count is None else token_count
        return masked_sum(loss_mat, mask) / _as_denominator(denominator, loss_mat) * dp_size
    token_counts = mask.sum(dim=-1)
    seq_sums = masked_sum(loss_mat, mask, axis=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = seq_sums
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_sums / token_counts.clamp_min(1e-8)
    else:  # seq-mean-token-sum-norm
        scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        seq_losses = seq_sums / scale
    denominator = (token_counts > 0).to(loss_mat.dtype).sum() if seq_count is None else seq_count
    return seq_losses.sum() / _as_denominator(denominator, loss_mat) * dp_size


def _one_of(ours: str, ours_value: Any, upstream: str, upstream_value: Any) -> Any:
    if ours_value is not None and upstream_value is not None:
        raise ValueError(f"agg_loss: give {ours} or {upstream} (the same count under two names), not both")
    return ours_value if ours_value is not None else upstream_value


def _as_denominator(count: Union[float, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    count = torch.as_tensor(count, dtype=like.dtype, device=like.device)
    return count.clamp_min(1e-8)


# ----------------------------------------------------------------------------------------------------------
# Policy loss
# ----------------------------------------------------------------------------------------------------------

POLICY_LOSSES: dict[str, Callable[..., Any]] = {}


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering a policy loss under ``name`` (``actor.policy_loss.loss_mode``)."""

    def decorator(fn: Callable) -> Callable:
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> Callable[..., Any]:
    """Return the policy loss registered under ``name``; ``ValueError`` listing the valid names otherwise."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy_loss '{name}'; valid: {_valid_names(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


@register_policy_loss("vanilla")
def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: Optional[float] = None,
    cliprange_low: Optional[float] = None,
    cliprange_high: Optional[float] = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    *,
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    **agg_kwargs: Any,
) -> Any:
    """PPO clipped surrogate with decoupled clip range and dual clip; returns
    ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``.

    Two call forms share this registry entry (``vanilla``): ours/upstream's older one above, and upstream 0.9's
    ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)`` (a str in the fifth place
    or ``config=``), which is ``compute_policy_loss_vanilla`` and returns ``(pg_loss, metrics_dict)``.

    Per token, ``ratio = exp(clamp(log_prob - old_log_prob, -20, 20))``:

    * ``l1 = -A * ratio``, ``l2 = -A * clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)``,
      ``clipped = max(l1, l2)`` (standard PPO; clip-higher when ``cliprange_high > cliprange_low``);
    * dual clip for ``A < 0``: ``min(clipped, -A * clip_ratio_c)`` bounds the loss of a very large ratio;
    * ``pg_loss = agg_loss(...)`` (the keyword-only arguments are passed to ``agg_loss``).

    Metrics (masked means over ``response_mask``, detached): ``pg_clipfrac`` = fraction with ``l2 > l1``;
    ``ppo_kl`` = mean of ``old_log_prob - log_prob``; ``pg_clipfrac_lower`` = fraction with ``A < 0`` and
    ``clipped > -A * clip_ratio_c`` (dual clip active). ``cliprange_low``/``cliprange_high`` default to
    ``cliprange``.
    """
    if isinstance(cliprange, str) or config is not None:  # upstream 0.9 form
        if isinstance(cliprange, str):
            loss_agg_mode, config = cliprange, config if config is not None else cliprange_low
            if rollout_is_weights is None and isinstance(cliprange_high, torch.Tensor):
                rollout_is_weights = cliprange_high
        return compute_policy_loss_vanilla(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, **agg_kwargs
        )
    if rollout_is_weights is not None:
        given = agg_kwargs.get("weights")
        agg_kwargs["weights"] = rollout_is_weights if given is None else given * rollout_is_weights
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 (dual-clip bound -A * clip_ratio_c), got {clip_ratio_c}")
    cliprange_low = cliprange if cliprange_low is None else cliprange_low
    cliprange_high = cliprange if cliprange_high is None else cliprange_high
    if cliprange_low is None or cliprange_high is None:
        raise ValueError(
            "compute_policy_loss needs cliprange, or both cliprange_low and cliprange_high; "
            f"got cliprange={cliprange}, cliprange_low={cliprange_low}, cliprange_high={cliprange_high}"
        )
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask).detach()

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange_low, 1.0 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).to(ratio.dtype), response_mask).detach()

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    negative_adv = advantages < 0
    pg_clipfrac_lower = masked_mean(
        (torch.gt(clip_pg_losses1, pg_losses3) & negative_adv).to(ratio.dtype), response_mask
    ).detach()

    pg_losses = torch.where(negative_adv, clip_pg_losses2, clip_pg_losses1)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Upstream verl 0.9's policy-loss form: clip settings from ``config`` (the actor config: ``clip_ratio``,
    ``clip_ratio_low``/``clip_ratio_high`` defaulting to it, ``clip_ratio_c`` default 3.0, and optionally a
    ``global_batch_info`` mapping of ``agg_loss`` arguments); ``rollout_is_weights`` multiply the per-token loss.

    Same numbers as ``compute_policy_loss``; returns ``(pg_loss, {"actor/pg_clipfrac", "actor/ppo_kl",
    "actor/pg_clipfrac_lower"})`` with float metric values.
    """
    if config is None:
        raise ValueError("compute_policy_loss_vanilla needs config (the actor config with clip_ratio)")
    clip_ratio = _cfg_get(config, "clip_ratio")
    low, high = _cfg_get(config, "clip_ratio_low"), _cfg_get(config, "clip_ratio_high")
    kwargs = dict(_cfg_get(config, "global_batch_info") or {})
    kwargs.update(agg_kwargs)
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        cliprange=clip_ratio,
        cliprange_low=clip_ratio if low is None else low,
        cliprange_high=clip_ratio if high is None else high,
        clip_ratio_c=float(_cfg_get(config, "clip_ratio_c", 3.0) or 3.0),
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        **kwargs,
    )
    metrics = {
        "actor/pg_clipfrac": float(clipfrac),
        "actor/ppo_kl": float(ppo_kl),
        "actor/pg_clipfrac_lower": float(clipfrac_lower),
    }
    return pg_loss, metrics


# ----------------------------------------------------------------------------------------------------------
# KL, entropy and value losses
# ----------------------------------------------------------------------------------------------------------

KL_PENALTY_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")
# Accepted names without an implementation here, with the reason (refused at launch by config_preflight).
UNSUPPORTED_KL_PENALTY_TYPES = {"full": "it needs the full vocabulary distributions, which are not available here"}


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from sampled-token log-probs.

    * ``kl`` / ``k1``: ``logprob - ref_logprob``
    * ``abs``: ``|logprob - ref_logprob|``
    * ``mse`` / ``k2``: ``0.5 * (logprob - ref_logprob)^2``
    * ``low_var_kl`` / ``k3``: ``x = clamp(ref_logprob - logprob, -20, 20)``,
      ``clamp(exp(x) - x - 1, -10, 10)`` (unbiased, non-negative, low-variance; clamped for stability)
    * ``full``: needs the full distributions -> ``NotImplementedError``.
    """
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
        kld = torch.exp(log_ratio) - log_ratio - 1
        return torch.clamp(kld, min=-10.0, max=10.0)
    if kl_penalty in UNSUPPORTED_KL_PENALTY_TYPES:
        raise NotImplementedError(
            f"kl_penalty {kl_penalty!r} is not implemented: {UNSUPPORTED_KL_PENALTY_TYPES[kl_penalty]}; "
            "use 'low_var_kl', 'kl', 'abs' or 'mse'"
        )
    raise ValueError(f"unknown kl_penalty '{kl_penalty}'; valid: {', '.join(KL_PENALTY_TYPES)}")


def compute_rewards(
    token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_ratio: float
) -> torch.Tensor:
    """Upstream's ``scores - (old_log_prob - ref_log_prob) * kl_ratio`` (the plain ``kl`` estimator, unmasked)."""
    return token_level_scores - (old_log_prob - ref_log_prob) * kl_ratio


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", **agg_kwargs: Any
) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` (``[B, L, V]``) per token, aggregated with ``agg_loss`` over the mask.

    ``agg_kwargs`` (``global_token_count``, ``global_seq_count``, ``weights``, ...) are passed to ``agg_loss``.
    """
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode, **agg_kwargs)


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss; returns ``(vf_loss, vf_clipfrac)``.

    ``v_clip = clamp(vpreds, values - c, values + c)``; per token ``max((vpreds - R)^2, (v_clip - R)^2)``;
    ``vf_loss = 0.5 * agg_loss(...)``; ``vf_clipfrac`` = masked fraction where the clipped error is larger.
    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns).square()
    vf_losses2 = (vpred_clipped - returns).square()
    clipped_vf_losses = torch.maximum(vf_losses1, vf_losses2)
    vf_loss = 0.5 * agg_loss(clipped_vf_losses, response_mask, loss_agg_mode, **agg_kwargs)
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).to(vpreds.dtype), response_mask).detach()
    return vf_loss, vf_clipfrac


# ----------------------------------------------------------------------------------------------------------
# KL controllers (for KL-in-reward)
# ----------------------------------------------------------------------------------------------------------


class FixedKLController:
    """Constant KL coefficient (``value``); ``update`` does nothing."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept for interface compatibility with ``AdaptiveKLController``)."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): steer the observed KL towards ``target_kl``.

    ``update``: ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0:
            raise ValueError(f"AdaptiveKLController target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale ``value`` after observing ``current_kl`` over ``n_steps`` samples."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def get_kl_controller(kl_ctrl_cfg: Any) -> Union[FixedKLController, AdaptiveKLController]:
    """Build a KL controller from ``algorithm.kl_ctrl`` (mapping or attribute object).

    Keys: ``type`` (``fixed`` default | ``adaptive``), ``kl_coef``; adaptive also ``target_kl``, ``horizon``.
    """
    ctrl_type = _cfg_get(kl_ctrl_cfg, "type", "fixed")
    kl_coef = _cfg_get(kl_ctrl_cfg, "kl_coef")
    if kl_coef is None:
        raise ValueError("kl_ctrl.kl_coef is required")
    if ctrl_type == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if ctrl_type == "adaptive":
        target_kl, horizon = _cfg_get(kl_ctrl_cfg, "target_kl"), _cfg_get(kl_ctrl_cfg, "horizon")
        if target_kl is None or horizon is None:
            raise ValueError(
                f"kl_ctrl.type 'adaptive' needs kl_ctrl.target_kl and kl_ctrl.horizon; got {target_kl}, {horizon}"
            )
        return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"unknown kl_ctrl.type '{ctrl_type}'; valid: adaptive, fixed")
