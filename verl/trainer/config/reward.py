"""Reward sections: ``reward_model`` (learned model + the rule-based reward manager) and
``custom_reward_function``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from verl.workers.config.base import BaseConfig, Checks
from verl.workers.config.engine import RewardFSDPConfig

__all__ = ["RewardModelModelConfig", "RewardModelConfig", "CustomRewardFunctionConfig", "REWARD_MANAGERS"]

# Reward managers (verl/workers/reward_manager); extend when a new one is registered.
REWARD_MANAGERS = ("naive", "thread")


@dataclass
class RewardModelModelConfig(BaseConfig):
    """``reward_model.model``: the learned reward model's weights."""

    SECTION = "reward_model.model"

    # Tokenizer of the policy; null = follows actor_rollout_ref.model.path.
    input_tokenizer: Optional[str] = None
    # HF folder of the reward model.
    path: str = "~/models/FsfairX-LLaMA3-RM-v0.1"
    # Module to import before loading the model; null = follows actor_rollout_ref.model.external_lib.
    external_lib: Optional[str] = None
    # Unpad sequences in the reward-model forward.
    use_remove_padding: bool = False
    # FSDP settings of the reward model.
    fsdp_config: RewardFSDPConfig = field(default_factory=RewardFSDPConfig)


@dataclass
class RewardModelConfig(BaseConfig):
    """``reward_model``."""

    SECTION = "reward_model"

    # Use a learned reward model (not supported in recurrent mode).
    enable: bool = False
    # Backend of the reward model.
    strategy: str = "fsdp"
    # Reward model weights.
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    # Deprecated global micro-batch size.
    micro_batch_size: Optional[int] = None
    # Rows per reward-model micro-batch per GPU.
    micro_batch_size_per_gpu: Optional[int] = None
    # Max sequence length for the reward model; null = no limit.
    max_length: Optional[int] = None
    # Ulysses sequence parallel size (only 1 is supported).
    ulysses_sequence_parallel_size: int = 1
    # Token-budget micro-batches; null = follows critic.use_dynamic_bsz.
    use_dynamic_bsz: Optional[bool] = None
    # Token budget per GPU; null = follows critic.forward_max_token_len_per_gpu.
    forward_max_token_len_per_gpu: Optional[int] = None
    # Rule-based reward manager: naive | thread.
    reward_manager: str = "naive"
    # Extra keyword arguments passed to the scoring function (free-form).
    reward_kwargs: dict = field(default_factory=dict)
    # Compute the rule-based reward asynchronously on CPU while log-probs run.
    launch_reward_fn_async: bool = False

    def check(self, c: Checks) -> None:
        c.choice("reward_manager", REWARD_MANAGERS)
        if isinstance(self.reward_kwargs, dict) and self.reward_kwargs:
            from verl.workers.reward_manager import reserved_reward_kwargs

            reserved = reserved_reward_kwargs()
            for name, value in self.reward_kwargs.items():
                if name in reserved:
                    c.error(
                        f"{c.key('reward_kwargs')}.{name}={value!r}: the name {name!r} is {reserved[name]}, not a "
                        f"free scorer keyword; use another name (reserved: {', '.join(sorted(reserved))})",
                        "reward_kwargs",
                    )


@dataclass
class CustomRewardFunctionConfig(BaseConfig):
    """``custom_reward_function``: a user scoring function replacing the built-in per-data_source scorers."""

    SECTION = "custom_reward_function"

    # Python file defining the function; null = built-in scorers.
    path: Optional[str] = None
    # Function name inside that file.
    name: str = "compute_score"
