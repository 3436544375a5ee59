"""The value-model section ``critic``; null keys follow the actor's (the YAML interpolates them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from verl.workers.config.actor import ACTOR_STRATEGIES, CheckpointConfig, _check_sequence_parallel
from verl.workers.config.base import BaseConfig, Checks
from verl.workers.config.engine import FSDPConfig
from verl.workers.config.optimizer import CriticOptimizerConfig

__all__ = ["CriticModelConfig", "CriticConfig"]


@dataclass
class CriticModelConfig(BaseConfig):
    """``critic.model``."""

    SECTION = "critic.model"

    # HF folder of the critic's base model.
    path: str = "~/models/deepseek-llm-7b-chat"
    # Tokenizer of the critic; null = follows actor_rollout_ref.model.path.
    tokenizer_path: Optional[str] = None
    # Overrides applied to the critic's HF model config (its own).
    override_config: dict = field(default_factory=dict)
    # Allow custom modelling code; null = follows actor_rollout_ref.model.trust_remote_code.
    trust_remote_code: Optional[bool] = None
    # Module to import before loading the model; null = follows actor_rollout_ref.model.external_lib.
    external_lib: Optional[str] = None
    # Activation checkpointing.
    enable_gradient_checkpointing: bool = True
    # Unpad sequences in the critic forward.
    use_remove_padding: bool = False
    # FSDP settings of the critic.
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)

    def check(self, c: Checks) -> None:
        if not self.path and "path" not in c.bad:
            c.error(f"{c.key('path')} must name the value model's base checkpoint folder (got {self.path!r})")


@dataclass
class CriticConfig(BaseConfig):
    """``critic`` (only used by critic-based estimators such as gae)."""

    SECTION = "critic"

    # Rollouts per prompt; null = follows actor_rollout_ref.rollout.n.
    rollout_n: Optional[int] = None
    # Backend of the critic.
    strategy: str = "fsdp"
    # Seed of the value head's initialisation and of the mini-batch shuffle (same on every rank).
    seed: int = 0
    # Critic optimizer.
    optim: CriticOptimizerConfig = field(default_factory=CriticOptimizerConfig)
    # Critic model.
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    # Prompts per critic mini-batch; null = follows actor_rollout_ref.actor.ppo_mini_batch_size.
    ppo_mini_batch_size: Optional[int] = None
    # Deprecated global micro-batch size (divided by the data-parallel size).
    ppo_micro_batch_size: Optional[int] = None
    # Rows per critic micro-batch per GPU.
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    # Deprecated global forward micro-batch size; null = follows ppo_micro_batch_size.
    forward_micro_batch_size: Optional[int] = None
    # Rows per value-forward micro-batch per GPU; null = follows ppo_micro_batch_size_per_gpu.
    forward_micro_batch_size_per_gpu: Optional[int] = None
    # Token-budget micro-batches; null = follows actor_rollout_ref.actor.use_dynamic_bsz.
    use_dynamic_bsz: Optional[bool] = None
    # Token budget per GPU for critic updates.
    ppo_max_token_len_per_gpu: int = 32768
    # Token budget per GPU for value forwards; null = follows ppo_max_token_len_per_gpu.
    forward_max_token_len_per_gpu: Optional[int] = None
    # Ulysses sequence parallel size (only 1 is supported).
    ulysses_sequence_parallel_size: int = 1
    # Passes over each batch; null = follows actor_rollout_ref.actor.ppo_epochs.
    ppo_epochs: Optional[int] = None
    # Shuffle rows between epochs; null = follows actor_rollout_ref.actor.shuffle.
    shuffle: Optional[bool] = None
    # Gradient-norm clipping threshold; null = none.
    grad_clip: Optional[float] = 1.0
    # Value clipping range.
    cliprange_value: float = 0.5
    # Critic checkpoint settings.
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def check(self, c: Checks) -> None:
        c.choice("strategy", ACTOR_STRATEGIES)
        c.integer("ppo_mini_batch_size", 1, allow_none=True)
        c.integer("ppo_epochs", 1, allow_none=True)
        c.integer("ppo_max_token_len_per_gpu", 1)
        c.number("grad_clip", lambda v: v > 0, "> 0 or null", allow_none=True)
        c.number("cliprange_value", lambda v: v > 0, "> 0")
        _check_sequence_parallel(c)
