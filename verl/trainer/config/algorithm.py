"""Advantage estimation, KL control and DAPO options: the ``algorithm`` section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from verl.workers.config.base import BaseConfig, Checks

__all__ = ["KLControlConfig", "FilterGroupsConfig", "OverlongBufferConfig", "AlgoConfig", "rollout_is_on"]

KL_CTRL_TYPES = ("fixed", "adaptive")
FILTER_GROUP_METRICS = ("score", "reward")


def rollout_is_on(rollout_is: Optional[bool], rollout_overlap: bool, bypass_mode: bool = False) -> bool:
    """Whether TIS is on: ``algorithm.rollout_is``, or (null) exactly when ``trainer.rollout_overlap`` is and
    ``algorithm.bypass_mode`` is not (PPO's ratio is then taken against the rollout policy itself: nothing to weigh)."""
    if rollout_is is None:
        return bool(rollout_overlap) and not bypass_mode
    return bool(rollout_is)


@dataclass
class KLControlConfig(BaseConfig):
    """``algorithm.kl_ctrl``: the controller of the in-reward KL penalty."""

    SECTION = "algorithm.kl_ctrl"

    # fixed | adaptive.
    type: str = "fixed"
    # Initial (fixed: constant) KL coefficient.
    kl_coef: float = 0.001
    # Adaptive controller horizon.
    horizon: int = 10000
    # Adaptive controller target KL.
    target_kl: float = 0.1

    def check(self, c: Checks) -> None:
        c.choice("type", KL_CTRL_TYPES)
        c.number("kl_coef", lambda v: v >= 0, ">= 0")
        if self.type == "adaptive":
            c.number("horizon", lambda v: v > 0, "> 0 for the adaptive controller")
            c.number("target_kl", lambda v: v > 0, "> 0 for the adaptive controller")


@dataclass
class FilterGroupsConfig(BaseConfig):
    """``algorithm.filter_groups``: DAPO dynamic sampling (drop groups whose rewards are all equal)."""

    SECTION = "algorithm.filter_groups"

    # Turn the filter on.
    enable: bool = False
    # Per-trajectory quantity whose spread decides: score (the verifier's score) | reward (after the overlong
    # penalty) | a key of the scorer's result dict (e.g. acc, as upstream DAPO).
    metric: str = "score"
    # Max generation batches drawn to fill a training batch; 0 = no limit.
    max_num_gen_batches: int = 0

    def check(self, c: Checks) -> None:
        if self.enable:
            if not isinstance(self.metric, str) or not self.metric.strip():
                c.error(
                    f"{c.key('metric')} must be {' | '.join(FILTER_GROUP_METRICS)} or a key of the scorer's result "
                    f"dict (got {self.metric!r})",
                    "metric",
                )
            c.integer("max_num_gen_batches", 0)


@dataclass
class OverlongBufferConfig(BaseConfig):
    """``algorithm.overlong_buffer``: DAPO soft overlong punishment (``len`` is checked against
    ``data.max_response_length`` by ``validate_config``)."""

    SECTION = "algorithm.overlong_buffer"

    # Turn the penalty on.
    enable: bool = False
    # Buffer length: the penalty ramps over the last `len` tokens before max_response_length.
    len: int = 512
    # Penalty at max_response_length.
    penalty_factor: float = 1.0

    def check(self, c: Checks) -> None:
        if self.enable:
            c.number("penalty_factor", lambda v: v >= 0, ">= 0")


@dataclass
class AlgoConfig(BaseConfig):
    """``algorithm``."""

    SECTION = "algorithm"

    # Discount factor (gae only).
    gamma: float = 1.0
    # GAE lambda (gae only).
    lam: float = 1.0
    # Advantage estimator: a name registered with @register_adv_est (built-in or from adv_estimator_module).
    adv_estimator: str = "gae"
    # Module(s) imported before validation that register estimators of your own (dotted name, .py path, list).
    adv_estimator_module: Optional[Any] = None
    # GRPO: divide by the group std (False = Dr.GRPO).
    norm_adv_by_std_in_grpo: bool = True
    # Alias of norm_adv_by_std_in_grpo; null = not set. When set it overrides it.
    grpo_use_adv: Optional[bool] = None
    # Subtract a KL penalty from the reward.
    use_kl_in_reward: bool = False
    # KL estimator for the in-reward penalty.
    kl_penalty: str = "kl"
    # KL controller for the in-reward penalty.
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    # DAPO dynamic sampling.
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    # DAPO soft overlong punishment on the response length.
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    # Truncated importance sampling of the policy loss (null = exactly when trainer.rollout_overlap is on).
    rollout_is: Optional[bool] = None
    # TIS cap C: per-token weight min(exp(old_log_prob - rollout_log_prob), C).
    rollout_is_threshold: float = 2.0
    # PPO's old log-probs are the rollout engine's (no recompute pass by the actor); verl's
    # algorithm.rollout_correction.bypass_mode with its ppo_clip loss.
    bypass_mode: bool = False

    def check(self, c: Checks) -> None:
        from verl.trainer.ppo.core_algos import ADV_ESTIMATORS, KL_PENALTY_TYPES

        self._import_estimator_modules(c)  # first: the estimators they register are valid names
        if self.adv_estimator not in ADV_ESTIMATORS:
            c.error(
                f"{c.key('adv_estimator')} must be one of [{', '.join(sorted(ADV_ESTIMATORS))}] "
                f"(got {self.adv_estimator!r}); an estimator of your own: @register_adv_est('name') in a module "
                f"named by {c.key('adv_estimator_module')}"
            )
        c.number("gamma", lambda v: 0 <= v <= 1, "in [0, 1]")
        c.number("lam", lambda v: 0 <= v <= 1, "in [0, 1]")
        c.choice("kl_penalty", KL_PENALTY_TYPES)
        c.number("rollout_is_threshold", lambda v: 0 < v < float("inf"), "> 0 (the cap C of the TIS weight)")
        if self.bypass_mode and self.rollout_is:
            c.error(
                f"{c.key('bypass_mode')}=True with {c.key('rollout_is')}=True: in bypass mode PPO's old log-probs "
                "are the rollout engine's, so the TIS weight exp(old_log_prob - rollout_log_prob) is 1 everywhere; "
                f"set {c.key('rollout_is')}=null (or False)",
                "rollout_is",
            )

    def _import_estimator_modules(self, c: Checks) -> None:
        """Import ``adv_estimator_module`` (a dotted name, a ``.py`` path or a list; each file runs once)."""
        from verl.utils.import_utils import import_external_libs

        modules = self.adv_estimator_module
        if hasattr(modules, "__iter__") and not isinstance(modules, str):
            names = list(modules)
        else:
            names = [] if modules is None else [modules]
        if not all(isinstance(m, str) and m.strip() for m in names):
            c.error(
                f"{c.key('adv_estimator_module')} must be a module name, a .py file path, a list of them, or null "
                f"(got {modules!r})"
            )
            return
        for name in names:
            try:
                import_external_libs(name)
            except Exception as err:  # the user's module: report whatever it raised, naming the key
                c.error(f"{c.key('adv_estimator_module')}={name!r} could not be imported: {type(err).__name__}: {err}")

    @property
    def norm_adv_by_std(self) -> bool:
        """``grpo_use_adv`` when set (MemAgent's alias), else ``norm_adv_by_std_in_grpo``."""
        return self.norm_adv_by_std_in_grpo if self.grpo_use_adv is None else self.grpo_use_adv
