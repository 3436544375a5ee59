"""FSDP sections of the models: ``actor_rollout_ref.{actor,ref}.fsdp_config``, ``critic.model.fsdp_config``,
``reward_model.model.fsdp_config``."""

from __future__ import annotations

from dataclasses import dataclass, field

from verl.workers.config.base import BaseConfig, Checks

__all__ = ["WrapPolicyConfig", "FSDPConfig", "RefFSDPConfig", "RewardFSDPConfig"]


@dataclass
class WrapPolicyConfig(BaseConfig):
    """Which modules become FSDP units."""

    SECTION = "actor_rollout_ref.actor.fsdp_config.wrap_policy"

    # Wrap modules with at least this many parameters (0 = wrap transformer layers).
    min_num_params: int = 0


@dataclass
class RefFSDPConfig(BaseConfig):
    """FSDP settings of the reference model (its mesh is the actor's)."""

    SECTION = "actor_rollout_ref.ref.fsdp_config"

    # Keep parameters on CPU between uses.
    param_offload: bool = False
    # Which modules become FSDP units.
    wrap_policy: WrapPolicyConfig = field(default_factory=WrapPolicyConfig)
    # Free each layer's gathered parameters after its forward (ZeRO-3); False keeps them until the backward (and
    # across the micro-batches of a log-prob pass): no second gather in the backward, one gathered copy more.
    reshard_after_forward: bool = True


@dataclass
class RewardFSDPConfig(RefFSDPConfig):
    """FSDP settings of the learned reward model."""

    SECTION = "reward_model.model.fsdp_config"

    # Shard group size; -1 = all ranks.
    fsdp_size: int = -1


@dataclass
class FSDPConfig(RewardFSDPConfig):
    """FSDP settings of a trained model (actor, critic)."""

    SECTION = "actor_rollout_ref.actor.fsdp_config"

    # Keep the AdamW states in host memory, streamed through the GPU per bucket in each step (OffloadedAdamW).
    optimizer_offload: bool = False

    def check(self, c: Checks) -> None:
        # HSDP: shard within groups of fsdp_size ranks; -1 = plain FSDP over all ranks
        c.integer("fsdp_size", 1, also=(-1,))
