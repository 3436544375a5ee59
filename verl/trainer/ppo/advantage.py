"""Rewards and advantages of a batch: upstream verl's ``ray_trainer.apply_kl_penalty`` and ``compute_advantage``.

Every estimator in the ``core_algos`` registry is called the same way, so one a recipe registers with
``@register_adv_est("name")`` (in a module named by ``algorithm.adv_estimator_module`` or
``VERL_USE_EXTERNAL_MODULES``) is selected with ``algorithm.adv_estimator=name`` like a built-in one.

Keyword arguments an estimator receives (``core_algos.call_adv_estimator``: all of them when it takes
``**kwargs``, else those its signature names): ``token_level_rewards`` and ``response_mask`` ``[B, R]``,
``config`` (the ``algorithm`` config), ``norm_adv_by_std_in_grpo``, and when the batch has them ``index`` (the
``uid`` array: rows of one prompt share it), ``reward_baselines`` ``[B]`` and ``values`` ``[B, R]``; ``gae`` also
gets ``gamma`` and ``lam``. Upstream passes the same names except ``norm_adv_by_std_in_grpo`` (only to ``grpo``)
and ``values`` (only to ``gae``).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Optional, Union

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import AdvantageEstimator, call_adv_estimator, get_adv_estimator_fn
from verl.utils.torch_functional import masked_mean

__all__ = ["apply_kl_penalty", "compute_advantage", "compute_response_mask", "adv_estimator_inputs"]


def apply_kl_penalty(data: DataProto, kl_ctrl: Any, kl_penalty: str = "kl") -> tuple[DataProto, dict[str, float]]:
    """``token_level_rewards = token_level_scores - beta * KL(old || ref)`` per response token (``beta =
    kl_ctrl.value``), then ``kl_ctrl.update(mean KL, batch size)``; returns ``(data, metrics)`` as upstream.

    The KL is the ``kl_penalty`` estimator of ``old_log_probs`` vs ``ref_log_prob``, zero outside ``response_mask``;
    the metric ``actor/reward_kl_penalty`` is its per-row token mean averaged over rows.
    """
    mask = data.batch["response_mask"]
    kld = core_algos.kl_penalty(data.batch["old_log_probs"], data.batch["ref_log_prob"], kl_penalty) * mask
    beta = kl_ctrl.value
    data.batch["token_level_rewards"] = data.batch["token_level_scores"] - beta * kld
    current_kl = float(masked_mean(kld, mask, axis=-1).mean())
    kl_ctrl.update(current_kl=current_kl, n_steps=len(data))
    return data, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(beta)}


def compute_response_mask(data: DataProto):
    """The response columns of ``attention_mask`` (``[B, R]`` with ``R = responses.shape[1]``), as upstream."""
    response_length = data.batch["responses"].shape[1]
    return data.batch["attention_mask"][:, -response_length:]


def adv_estimator_inputs(
    data: DataProto,
    adv_estimator: str,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> dict[str, Any]:
    """The keyword arguments offered to estimator ``adv_estimator`` for ``data`` (module docstring)."""
    batch, non_tensor = data.batch, data.non_tensor_batch
    inputs: dict[str, Any] = {
        "token_level_rewards": batch["token_level_rewards"],
        "response_mask": batch["response_mask"],
        "config": config,
        "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
    }
    if "uid" in non_tensor:
        inputs["index"] = non_tensor["uid"]
    for key in ("reward_baselines", "values"):
        if key in batch.keys():
            inputs[key] = batch[key]
    if adv_estimator == AdvantageEstimator.GAE.value:
        inputs.update(gamma=gamma, lam=lam)
    return inputs


def compute_advantage(
    data: DataProto,
    adv_estimator: Union[str, AdvantageEstimator],
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
) -> DataProto:
    """Set ``data.batch["advantages"]`` and ``["returns"]`` (``[B, R]``) with the registered estimator
    ``adv_estimator`` and return ``data`` (upstream's signature; ``num_repeat`` is accepted and unused, as there).

    ``data`` needs ``token_level_rewards`` and ``response_mask`` (computed from ``attention_mask`` when absent),
    plus what the estimator needs (``values`` for ``gae``, ``uid`` for the group estimators,
    ``reward_baselines`` for ``remax``); a missing input raises ``TypeError`` naming it.
    """
    del num_repeat
    name = adv_estimator.value if isinstance(adv_estimator, Enum) else str(adv_estimator)
    if "response_mask" not in data.batch.keys():
        data.batch["response_mask"] = compute_response_mask(data)
    fn = get_adv_estimator_fn(name)
    inputs = adv_estimator_inputs(data, name, gamma, lam, norm_adv_by_std_in_grpo, config)
    advantages, returns = call_adv_estimator(fn, **inputs)
    data.batch["advantages"], data.batch["returns"] = advantages, returns
    return data
