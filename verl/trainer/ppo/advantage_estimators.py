"""Advantage estimators and their registry (``algorithm.adv_estimator``), re-exported by
:mod:`verl.trainer.ppo.core_algos` under upstream verl's names; the calling convention is in that module's docstring.

GAE, GRPO / Dr.GRPO, RLOO, REINFORCE++ and ReMax here; upstream's pass@k, REINFORCE++-baseline, OPO and GPG in
:mod:`verl.trainer.ppo.group_estimators`, which imports this module and registers them when imported (core_algos
imports it; :func:`get_adv_estimator_fn` imports it on a name it does not know yet); MemAgent's Multi-Conv credit
assignment (``grpo_multiconv``) in :mod:`verl.trainer.ppo.dapo`, registered here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, Optional, Union

import torch

from verl.trainer.ppo.dapo import GroupIndex, compute_multiconv_advantage, group_relative_scores, index_to_group_ids
from verl.utils.torch_functional import masked_whiten

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
]


def _valid_names(registry: Mapping[str, Any]) -> str:
    return ", ".join(sorted(registry))


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


# ----------------------------------------------------------------------------------------------------------
# Advantage estimator registry
# ----------------------------------------------------------------------------------------------------------


class AdvantageEstimator(str, Enum):
    """Names of the advantage estimators (``algorithm.adv_estimator``)."""

    GAE = "gae"
    GRPO = "grpo"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REMAX = "remax"
    GRPO_MULTICONV = "grpo_multiconv"
    # upstream's other outcome estimators (verl/trainer/ppo/group_estimators.py)
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"


ADV_ESTIMATORS: dict[str, Callable[..., Any]] = {}


def register_adv_est(name: Union[str, AdvantageEstimator]) -> Callable[[Callable], Callable]:
    """Decorator registering an advantage estimator under ``name`` (a str or ``AdvantageEstimator``)."""
    key = name.value if isinstance(name, AdvantageEstimator) else str(name)

    def decorator(fn: Callable) -> Callable:
        existing = ADV_ESTIMATORS.get(key)
        if existing is not None and existing is not fn:
            raise ValueError(f"adv_estimator '{key}' is already registered to {existing.__name__}")
        ADV_ESTIMATORS[key] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name: Union[str, AdvantageEstimator]) -> Callable[..., Any]:
    """Return the estimator registered under ``name``; ``ValueError`` listing the valid names otherwise.

    Note: ``grpo_multiconv`` takes trajectory-level scores plus ``sample_index`` (see
    ``compute_multiconv_advantage``); all the others take token-level tensors of one row per sequence.
    """
    key = name.value if isinstance(name, AdvantageEstimator) else str(name)
    if key not in ADV_ESTIMATORS:
        import verl.trainer.ppo.group_estimators  # noqa: F401 - registers upstream's other estimators
    if key not in ADV_ESTIMATORS:
        raise ValueError(f"unknown adv_estimator '{key}'; valid: {_valid_names(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[key]


# Multi-Conv credit assignment lives in dapo.py (with the other Multi-Conv DAPO pieces); registered here.
register_adv_est(AdvantageEstimator.GRPO_MULTICONV)(compute_multiconv_advantage)


def call_adv_estimator(fn: Callable[..., Any], **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Call ``fn`` with the upstream keyword convention (module docstring): all of ``inputs`` when it takes
    ``**kwargs``, else only those its signature names. A required parameter that ``inputs`` lacks raises a
    ``TypeError`` naming it and the inputs on offer."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        chosen = dict(inputs)
    else:
        chosen = {k: v for k, v in inputs.items() if k in params}
    missing = [
        name
        for name, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and name not in chosen
    ]
    if missing:
        raise TypeError(
            f"advantage estimator {getattr(fn, '__name__', fn)} needs {missing}; the trainer provides "
            f"{sorted(inputs)} (see the calling convention in verl/trainer/ppo/core_algos.py)"
        )
    result = fn(**chosen)
    name = getattr(fn, "__name__", fn)
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise TypeError(f"advantage estimator {name} must return (advantages, returns), got {type(result).__name__}")
    rewards = inputs.get("token_level_rewards")
    for label, value in zip(("advantages", "returns"), result):
        if not isinstance(value, torch.Tensor) or (rewards is not None and value.shape != rewards.shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            want = tuple(rewards.shape) if rewards is not None else "a tensor"
            raise TypeError(f"advantage estimator {name} returned {label} of shape {got}; expected {want}")
    return tuple(result)


# ----------------------------------------------------------------------------------------------------------
# Advantage estimators
# ----------------------------------------------------------------------------------------------------------


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)


def _row_scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    """``s_i``: each row's summed reward, in at least float32."""
    return token_level_rewards.sum(dim=-1).to(_compute_dtype(token_level_rewards))


def _group_sums(values: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[num_groups]`` sums of the ``[B]`` ``values`` over the rows of each group."""
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, group_ids, values)


def _per_token(row_values: torch.Tensor, response_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A ``[B]`` per-row advantage broadcast over the row's response tokens, in ``like``'s dtype."""
    return (row_values.unsqueeze(-1) * response_mask).to(like.dtype)


@register_adv_est(AdvantageEstimator.GRPO)
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage; with ``norm_adv_by_std_in_grpo=False`` it is Dr.GRPO's ``R - mean(R_group)``.

    ``config`` (upstream's algorithm config) is accepted and, as upstream, not read: pass
    ``norm_adv_by_std_in_grpo`` explicitly.

    Score per row = ``token_level_rewards.sum(-1)``; rows sharing ``index`` form a group; std is unbiased
    (``torch.std``). The row's scalar advantage is broadcast over its tokens and multiplied by
    ``response_mask``. Returns ``(advantages, returns)`` (identical), both ``[B, L]``.

    Example: group rewards ``[1, 0, 0, 1]`` -> mean 0.5, std 0.5774 -> A = ``[0.866, -0.866, -0.866, 0.866]``.
    """
    scores = token_level_rewards.sum(dim=-1)
    advantages = _per_token(
        group_relative_scores(scores, index, epsilon, norm_adv_by_std_in_grpo), response_mask, token_level_rewards
    )
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO)
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: ``A_i = s_i - mean_{j != i} s_j = (s_i - mean_g) * n / (n - 1)``.

    A group of size 1 has no other member, so its baseline is 0 and ``A = s``. ``epsilon`` and ``config`` are
    accepted for signature compatibility and unused. Returns ``(advantages, returns)`` (identical), both ``[B, L]``.
    """
    del epsilon, config, kwargs
    values = _row_scores(token_level_rewards)
    group_ids, num_groups = index_to_group_ids(index, values.shape[0])
    group_ids = group_ids.to(values.device)
    counts = _group_sums(torch.ones_like(values), group_ids, num_groups)
    means = _group_sums(values, group_ids, num_groups) / counts
    n = counts[group_ids]
    loo = (values - means[group_ids]) * n / (n - 1).clamp_min(1)
    advantages = _per_token(torch.where(n > 1, loo, values), response_mask, token_level_rewards)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.GAE)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation; returns ``(whitened advantages, returns)``, both ``[B, L]``.

    Backwards over t: ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``,
    where ``V_{t+1}``/``A_{t+1}`` are those of the next *masked* token (masked-out positions are skipped, and
    beyond the last token both are 0). ``returns = A + V`` (before whitening); the advantages are then
    whitened with ``masked_whiten`` over all masked tokens of the batch.
    """
    num_tokens = token_level_rewards.shape[-1]
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    reversed_advantages = []
    for t in reversed(range(num_tokens)):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        # a masked-out position passes the next token's value/advantage through unchanged
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        next_advantage = advantage_t * mask[:, t] + (1 - mask[:, t]) * next_advantage
        reversed_advantages.append(next_advantage)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    returns = advantages + values
    advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    gamma: Optional[float] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go per token, whitened over the batch, times the mask.

    ``gamma`` comes from ``config.gamma`` (upstream form: ``fn(rewards, mask, config=algo_cfg)``), or is given as
    ``gamma=`` or as a number in ``config``'s position (our earlier form ``fn(rewards, mask, 0.99)``).

    ``G_t = r_t + gamma * G_next`` over the valid tokens, where ``G_next`` is the return of the next *valid*
    token: masked-out positions inside a response (tool observations between turns) are skipped, so the return
    is carried across them (neither discounted nor reset there), and trailing padding stays 0 because the scan
    starts at 0. ``returns`` is 0 at masked positions. Example, gamma 1, rewards ``[0, 0, 0, 0, 0, 1]``, mask
    ``[1, 1, 0, 0, 1, 1]``: returns ``[1, 1, 0, 0, 1, 1]``. Returns ``(advantages, returns)``.
    """
    gamma = _resolve_gamma(config, gamma)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    mask = response_mask.to(token_level_rewards.dtype)
    for t in reversed(range(token_level_rewards.shape[-1])):
        candidate = token_level_rewards[:, t] + gamma * running
        valid = mask[:, t] > 0
        running = torch.where(valid, candidate, running)
        returns[:, t] = candidate * mask[:, t]
    advantages = masked_whiten(returns, response_mask) * mask
    return advantages, returns


def _resolve_gamma(config: Any, gamma: Optional[float]) -> float:
    if gamma is not None:
        return float(gamma)
    if isinstance(config, (int, float)) and not isinstance(config, bool):
        return float(config)
    value = _cfg_get(config, "gamma") if config is not None else None
    if value is None:
        raise ValueError("REINFORCE++ needs gamma: pass config with a 'gamma' field (algorithm.gamma) or gamma=")
    return float(value)


@register_adv_est(AdvantageEstimator.REMAX)
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: ``returns_t = sum_{k >= t} r_k * m_k``, ``A_t = returns_t - baseline * m_t`` (as upstream).

    ``reward_baselines`` is ``[B]`` (the greedy rollout's reward per row). On valid tokens ``A = returns -
    baseline``; at a masked position the baseline is not subtracted, so inside a multi-turn hole ``A`` equals
    the return still to come and on trailing padding it is 0 (these positions never enter a masked loss).
    ``config`` is accepted and unused. Returns ``(advantages, returns)``.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines.to(returns.dtype).unsqueeze(-1) * mask
    return advantages, returns
