"""Typed trainer config. ``ppo_trainer.yaml`` beside this package is the user-facing file (Hydra's
``config_path``); the dataclasses here and in ``verl/workers/config`` carry the same keys and defaults
(``tests/test_typed_config.py`` keeps them identical) and validate them in ``__post_init__``."""

from verl.trainer.config.algorithm import AlgoConfig, FilterGroupsConfig, KLControlConfig, OverlongBufferConfig
from verl.trainer.config.data import CustomClsConfig, DataConfig
from verl.trainer.config.ppo import PPOConfig, from_config
from verl.trainer.config.recurrent import RecurrentConfig
from verl.trainer.config.reward import CustomRewardFunctionConfig, RewardModelConfig, RewardModelModelConfig
from verl.trainer.config.trainer import RayInitConfig, TrainerConfig

__all__ = [
    "AlgoConfig",
    "CustomClsConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "OverlongBufferConfig",
    "PPOConfig",
    "RayInitConfig",
    "RecurrentConfig",
    "RewardModelConfig",
    "RewardModelModelConfig",
    "TrainerConfig",
    "from_config",
]
