"""Typed sections of the worker config (``actor_rollout_ref``, ``critic``), in upstream verl's layout.

Each section is a dataclass whose fields carry the YAML defaults (``verl/trainer/config/ppo_trainer.yaml``, kept
identical by ``tests/test_typed_config.py``) and whose ``__post_init__`` validates them; see ``base.py``.
"""

from verl.workers.config.actor import ActorConfig, CheckpointConfig, PolicyLossConfig, RefConfig
from verl.workers.config.base import BaseConfig, ConfigError, collect_errors
from verl.workers.config.critic import CriticConfig, CriticModelConfig
from verl.workers.config.engine import FSDPConfig, RefFSDPConfig, RewardFSDPConfig, WrapPolicyConfig
from verl.workers.config.model import ModelConfig
from verl.workers.config.optimizer import CriticOptimizerConfig, OptimizerConfig
from verl.workers.config.rollout import RolloutConfig, ValKwargsConfig
from verl.workers.config.worker import ActorRolloutRefConfig

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "BaseConfig",
    "CheckpointConfig",
    "ConfigError",
    "CriticConfig",
    "CriticModelConfig",
    "CriticOptimizerConfig",
    "FSDPConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PolicyLossConfig",
    "RefConfig",
    "RefFSDPConfig",
    "RewardFSDPConfig",
    "RolloutConfig",
    "ValKwargsConfig",
    "WrapPolicyConfig",
    "collect_errors",
]
