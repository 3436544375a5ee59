"""The actor and reference-model sections: ``actor_rollout_ref.actor`` and ``actor_rollout_ref.ref``.

Fields whose YAML value is an interpolation (``actor.train_batch_size: ${data.train_batch_size}``) default to
None here, meaning "follows that key": a config composed from the YAML always has them resolved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from verl.workers.config.base import BaseConfig, Checks
from verl.workers.config.engine import FSDPConfig, RefFSDPConfig
from verl.workers.config.optimizer import OptimizerConfig

__all__ = [
    "PolicyLossConfig",
    "CheckpointConfig",
    "ActorConfig",
    "RefConfig",
    "ACTOR_STRATEGIES",
    "CHECKPOINT_CONTENTS",
]

ACTOR_STRATEGIES = ("fsdp", "fsdp2")
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


@dataclass
class PolicyLossConfig(BaseConfig):
    """verl's ``policy_loss`` section."""

    SECTION = "actor_rollout_ref.actor.policy_loss"

    # Registered loss name (core_algos.register_policy_loss): vanilla = PPO clip, clip-higher, dual clip.
    loss_mode: str = "vanilla"

    def check(self, c: Checks) -> None:
        from verl.trainer.ppo.core_algos import POLICY_LOSSES

        c.choice("loss_mode", sorted(POLICY_LOSSES))


@dataclass
class CheckpointConfig(BaseConfig):
    """What a checkpoint of a trained model holds."""

    SECTION = "actor_rollout_ref.actor.checkpoint"

    # What to save: model, optimizer, extra (lr scheduler, rng), hf_model (HF-format weights).
    contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])

    def check(self, c: Checks) -> None:
        unknown = [x for x in self.contents if x not in CHECKPOINT_CONTENTS] if "contents" not in c.bad else []
        if unknown:
            c.error(f"{c.key('contents')} entries must be in [{', '.join(CHECKPOINT_CONTENTS)}] (got {unknown})")


@dataclass
class ActorConfig(BaseConfig):
    """``actor_rollout_ref.actor`` (the policy update)."""

    SECTION = "actor_rollout_ref.actor"

    # Training backend: fsdp | fsdp2 (both mean the FSDP2 engine).
    strategy: str = "fsdp"
    # Seed of the actor's initialisation (LoRA adapters) and of the mini-batch shuffle (same on every rank).
    seed: int = 0
    # Prompts per step as seen by the actor (optimizer steps = train_batch_size / ppo_mini_batch_size);
    # null = follows data.train_batch_size (without it mini-batches hold ppo_mini_batch_size rows).
    train_batch_size: Optional[int] = None
    # Prompts per PPO mini-batch (one optimizer step each).
    ppo_mini_batch_size: int = 256
    # Deprecated global micro-batch size (divided by the data-parallel size); use ppo_micro_batch_size_per_gpu.
    ppo_micro_batch_size: Optional[int] = None
    # Rows per forward/backward micro-batch per GPU (ignored when use_dynamic_bsz).
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    # Build micro-batches by token budget instead of row count.
    use_dynamic_bsz: bool = False
    # Token budget per GPU micro-batch when use_dynamic_bsz.
    ppo_max_token_len_per_gpu: int = 16384
    # Gradient-norm clipping threshold; null = no clipping.
    grad_clip: Optional[float] = 1.0
    # PPO clip epsilon, used when clip_ratio_low / clip_ratio_high are null.
    clip_ratio: float = 0.2
    # Lower clip epsilon (ratio >= 1 - clip_ratio_low).
    clip_ratio_low: Optional[float] = 0.2
    # Upper clip epsilon (ratio <= 1 + clip_ratio_high; DAPO clip-higher when > low).
    clip_ratio_high: Optional[float] = 0.2
    # Dual-clip constant c (> 1) bounding the loss for negative advantages.
    clip_ratio_c: float = 3.0
    # The policy loss, selected from the core_algos registry.
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    # Loss aggregation: token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm.
    loss_agg_mode: str = "token-mean"
    # How the turns of a trajectory weigh in the loss: token | trajectory.
    turn_weighting: str = "token"
    # Entropy bonus coefficient.
    entropy_coeff: float = 0.0
    # Compute the policy entropy in the update for the actor/entropy metric even when entropy_coeff is 0.
    calculate_entropy: bool = False
    # Add a KL(pi || pi_ref) term to the loss (GRPO style).
    use_kl_loss: bool = False
    # torch.compile the log-prob/entropy helpers.
    use_torch_compile: bool = True
    # Weight of the KL loss term.
    kl_loss_coef: float = 0.001
    # KL estimator for the loss: kl | abs | mse | low_var_kl | full (and k1/k2/k3 aliases).
    kl_loss_type: str = "low_var_kl"
    # Passes over each rollout batch.
    ppo_epochs: int = 1
    # Shuffle rows between PPO epochs.
    shuffle: bool = False
    # Ulysses sequence parallel size (only 1 is supported).
    ulysses_sequence_parallel_size: int = 1
    # Checkpoint settings of the actor.
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # Optimizer (AdamW) and learning-rate schedule.
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    # FSDP settings of the actor.
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)

    def check(self, c: Checks) -> None:
        from verl.trainer.ppo.core_algos import AGG_MODES, KL_PENALTY_TYPES, TURN_WEIGHTING_MODES

        c.choice("strategy", ACTOR_STRATEGIES)
        c.integer("ppo_mini_batch_size", 1)
        c.integer("train_batch_size", 1, allow_none=True)
        c.integer("ppo_max_token_len_per_gpu", 1)
        c.number("grad_clip", lambda v: v > 0, "> 0 or null", allow_none=True)
        c.number("clip_ratio", lambda v: 0 < v < 1, "in (0, 1)")
        c.number("clip_ratio_low", lambda v: 0 < v < 1, "in (0, 1) or null", allow_none=True)
        c.number("clip_ratio_high", lambda v: v > 0, "> 0 or null", allow_none=True)
        c.number("clip_ratio_c", lambda v: v > 1, "> 1 (dual-clip lower bound)")
        c.choice("loss_agg_mode", AGG_MODES)
        c.choice("turn_weighting", TURN_WEIGHTING_MODES)
        c.number("kl_loss_coef", lambda v: v >= 0, ">= 0")
        c.choice("kl_loss_type", KL_PENALTY_TYPES)
        c.integer("ppo_epochs", 1)
        _check_sequence_parallel(c)

    @property
    def clip_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


def _check_sequence_parallel(c: Checks, allow_none: bool = False) -> None:
    c.integer("ulysses_sequence_parallel_size", 1, allow_none=allow_none)
    sp = c.obj.ulysses_sequence_parallel_size
    if "ulysses_sequence_parallel_size" not in c.bad and isinstance(sp, int) and sp > 1:
        c.error(
            f"{c.key('ulysses_sequence_parallel_size')} must be 1: sequence parallelism is not implemented (got {sp})"
        )


@dataclass
class RefConfig(BaseConfig):
    """``actor_rollout_ref.ref`` (the frozen reference model of the KL term); null = follows the actor's key."""

    SECTION = "actor_rollout_ref.ref"

    # Backend of the reference model.
    strategy: str = "fsdp"
    # FSDP settings of the reference model.
    fsdp_config: RefFSDPConfig = field(default_factory=RefFSDPConfig)
    # torch.compile the reference log-prob helpers; null = follows actor.use_torch_compile.
    use_torch_compile: Optional[bool] = None
    # Deprecated global log-prob micro-batch size (divided by the data-parallel size).
    log_prob_micro_batch_size: Optional[int] = None
    # Rows per reference log-prob micro-batch per GPU; null = actor.ppo_micro_batch_size_per_gpu.
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    # Token-budget micro-batches for reference log-probs; null = follows actor.use_dynamic_bsz.
    log_prob_use_dynamic_bsz: Optional[bool] = None
    # Token budget per GPU micro-batch; null = follows actor.ppo_max_token_len_per_gpu.
    log_prob_max_token_len_per_gpu: Optional[int] = None
    # Ulysses sequence parallel size; null = follows actor.ulysses_sequence_parallel_size.
    ulysses_sequence_parallel_size: Optional[int] = None

    def check(self, c: Checks) -> None:
        c.choice("strategy", ACTOR_STRATEGIES)
        c.integer("log_prob_max_token_len_per_gpu", 1, allow_none=True)
        _check_sequence_parallel(c, allow_none=True)
