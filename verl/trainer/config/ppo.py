"""The whole trainer config as typed objects: :class:`PPOConfig` and :func:`from_config`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl.trainer.config.algorithm import AlgoConfig
from verl.trainer.config.data import DataConfig
from verl.trainer.config.recurrent import RecurrentConfig
from verl.trainer.config.reward import CustomRewardFunctionConfig, RewardModelConfig
from verl.trainer.config.trainer import RayInitConfig, TrainerConfig
from verl.workers.config import ActorRolloutRefConfig, BaseConfig, CriticConfig

__all__ = ["PPOConfig", "from_config"]


@dataclass
class PPOConfig(BaseConfig):
    """The sections of ``ppo_trainer.yaml`` (``python -m verl.trainer.main_ppo``)."""

    SECTION = ""

    # Dataset and dataloader settings.
    data: DataConfig = field(default_factory=DataConfig)
    # Policy (actor), reference model and rollout engine.
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    # Value model (critic-based estimators such as gae).
    critic: CriticConfig = field(default_factory=CriticConfig)
    # Learned reward model and the rule-based reward manager.
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    # A user-provided scoring function.
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    # Advantage estimation, KL control and DAPO-style options.
    algorithm: AlgoConfig = field(default_factory=AlgoConfig)
    # Training loop, logging, checkpointing and cluster.
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # Upstream Ray init options.
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    # Multi-conversation agent workflows (typed keys only; the sub-configs stay free-form).
    recurrent: RecurrentConfig = field(default_factory=RecurrentConfig)


def from_config(cfg: Any) -> PPOConfig:
    """The composed Hydra config (DictConfig or mapping) as typed sections; one ``ConfigError`` lists every
    invalid key."""
    return PPOConfig.from_config(cfg)
