"""``actor_rollout_ref``: the sections one ActorRolloutRefWorker holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from verl.workers.config.actor import ActorConfig, RefConfig
from verl.workers.config.base import BaseConfig
from verl.workers.config.model import ModelConfig
from verl.workers.config.rollout import RolloutConfig

__all__ = ["ActorRolloutRefConfig"]


@dataclass
class ActorRolloutRefConfig(BaseConfig):
    """Policy (actor), reference model and rollout engine; one worker group shares the model."""

    SECTION = "actor_rollout_ref"

    # Actor and rollout share the GPUs (colocated hybrid engine with sleep/wake).
    hybrid_engine: bool = True
    # The policy model.
    model: ModelConfig = field(default_factory=ModelConfig)
    # Actor (policy update) settings.
    actor: ActorConfig = field(default_factory=ActorConfig)
    # Reference model (for the KL term).
    ref: RefConfig = field(default_factory=RefConfig)
    # Rollout (generation) engine.
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
