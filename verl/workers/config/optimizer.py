"""Optimizer (AdamW) and learning-rate schedule sections: ``actor_rollout_ref.actor.optim`` and ``critic.optim``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from verl.workers.config.base import BaseConfig, Checks

__all__ = ["OptimizerConfig", "CriticOptimizerConfig", "WARMUP_STYLES"]

WARMUP_STYLES = ("constant", "cosine")


@dataclass
class OptimizerConfig(BaseConfig):
    """AdamW and its schedule (verl keys); ``verl.utils.fsdp_utils.build_optim_and_scheduler`` reads every field."""

    SECTION = "actor_rollout_ref.actor.optim"

    # Learning rate.
    lr: float = 1e-6
    # Linear warm-up steps; 0 = none; negative = use lr_warmup_steps_ratio.
    lr_warmup_steps: int = -1
    # Warm-up steps as a fraction of total_training_steps (when lr_warmup_steps < 0).
    lr_warmup_steps_ratio: float = 0.0
    # Floor of the cosine decay as a fraction of lr, in [0, 1]; null = 0.
    min_lr_ratio: Optional[float] = None
    # Schedule after warm-up: constant | cosine.
    warmup_style: str = "constant"
    # Set at run time from the dataloader length x epochs (or trainer.total_training_steps).
    total_training_steps: int = -1
    # AdamW weight decay.
    weight_decay: float = 0.01
    # AdamW betas.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    # torch's fused AdamW: null = fused when every trainable parameter is on CUDA (and not optimizer_offload), else
    # torch's default (foreach); True = fused (an error where torch has no fused kernel); False = torch's default.
    fused: Optional[bool] = None

    def check(self, c: Checks) -> None:
        c.number("lr", lambda v: v > 0, "> 0")
        c.integer("lr_warmup_steps", 0, also=(-1,))
        c.number("lr_warmup_steps_ratio", lambda v: 0 <= v <= 1, "in [0, 1]")
        c.number("min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1] or null", allow_none=True)
        c.choice("warmup_style", WARMUP_STYLES)
        c.number("weight_decay", lambda v: v >= 0, ">= 0")
        if "betas" not in c.bad:
            betas = list(self.betas)
            if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
                c.error(f"{c.key('betas')} must be two numbers in [0, 1) (got {betas})")


@dataclass
class CriticOptimizerConfig(OptimizerConfig):
    """``critic.optim``: the same keys, the critic's learning rate."""

    SECTION = "critic.optim"

    # Critic learning rate.
    lr: float = 1e-5
