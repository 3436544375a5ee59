"""Typed view of the actor section of the config (``actor_rollout_ref.actor``), with verl's key names.

``ActorSettings.from_config`` accepts an OmegaConf ``DictConfig``, a plain ``dict`` or any attribute object,
reads the keys below (unknown keys such as ``optim`` or ``fsdp_config`` are ignored: they belong to the
worker) and validates them with errors that name the key and the value.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Optional

__all__ = ["ActorSettings", "per_gpu_from_global", "settings_from_config"]

logger = logging.getLogger(__name__)

_LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


_MISSING = object()


def _lookup(config: Any, key: str) -> Any:
    """``config[key]`` / ``config.key``, or ``_MISSING`` when absent."""
    if config is None:
        return _MISSING
    if isinstance(config, Mapping) or hasattr(config, "get"):
        try:
            return config.get(key, _MISSING)
        except Exception:  # noqa: BLE001 - e.g. OmegaConf missing-value errors
            return _MISSING
    return getattr(config, key, _MISSING)


def per_gpu_from_global(
    global_size: Any, dp_size: int, old_key: str, new_key: str, per_gpu: Any = None, section: str = "actor"
) -> Optional[int]:
    """Upstream verl's meaning of a deprecated global micro-batch key (``ppo_micro_batch_size``,
    ``log_prob_micro_batch_size``, ``forward_micro_batch_size``): rows per micro-batch summed over the ``dp_size``
    data-parallel ranks, i.e. ``global_size // dp_size`` rows per GPU (with a deprecation warning).

    Returns ``per_gpu`` unchanged when ``global_size`` is None. ``ValueError`` naming the keys when both are set
    (as upstream) or when ``global_size < dp_size`` (less than one row per GPU).
    """
    if global_size is None:
        return per_gpu
    if per_gpu is not None:
        raise ValueError(
            f"{section}.{old_key}={global_size} and {section}.{new_key}={per_gpu} are both set: remove the deprecated "
            f"global size {section}.{old_key} (only {new_key} is supported together with it, as in verl)"
        )
    global_size, dp_size = int(global_size), max(1, int(dp_size))
    if global_size < dp_size:
        raise ValueError(
            f"{section}.{old_key}={global_size} is a global micro-batch size (deprecated; divided over the "
            f"{dp_size} data-parallel ranks) and must be >= {dp_size}; set {section}.{new_key} instead"
        )
    value = global_size // dp_size
    logger.warning(
        "%s.%s=%d is deprecated: a global size over %d data-parallel ranks, i.e. %s=%d per GPU%s; set %s.%s instead",
        section,
        old_key,
        global_size,
        dp_size,
        new_key,
        value,
        f" ({global_size % dp_size} rows rounded away)" if global_size % dp_size else "",
        section,
        new_key,
    )
    return value


def settings_from_config(
    cls: type, config: Any, legacy_aliases: dict[str, str], dp_size: int = 1, section: str = "actor"
) -> Any:
    """Build the settings dataclass ``cls`` from a DictConfig / dict / attribute object and validate it.

    Absent keys take the field defaults; an explicit None keeps its meaning only for Optional fields
    (e.g. ``grad_clip=None``: no clipping). ``legacy_aliases`` maps a per-GPU field to the deprecated global
    key that fills it (verl's ``ppo_micro_batch_size`` -> ``ppo_micro_batch_size_per_gpu``), divided by the
    data-parallel size ``dp_size`` (``per_gpu_from_global``).
    """
    values = {}
    for f in fields(cls):
        value = _lookup(config, f.name)
        if value is _MISSING or (value is None and "Optional" not in str(f.type)):
            value = f.default
        values[f.name] = value
    for new_key, old_key in legacy_aliases.items():
        legacy = _lookup(config, old_key)
        if legacy is not _MISSING:
            values[new_key] = per_gpu_from_global(legacy, dp_size, old_key, new_key, values[new_key], section)
    settings = cls(**values)
    settings.validate()
    return settings


@dataclass
class ActorSettings:
    """Actor options (verl names). See ``verl/workers/actor/dp_actor.py`` for how each is used.

    Mini-batches: with ``train_batch_size`` set, each ``update_policy`` call takes exactly
    ``train_batch_size // ppo_mini_batch_size`` optimizer steps per epoch (docs/spec.md#policy-loss; the number of
    conversations per step varies, so rows are split into that many contiguous, possibly uneven mini-batches).
    Without it, mini-batches hold ``ppo_mini_batch_size`` rows (the last may be smaller).
    """

    ppo_mini_batch_size: int = 1
    train_batch_size: Optional[int] = None
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_max_token_len_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: Optional[bool] = None
    use_remove_padding: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    ppo_epochs: int = 1
    shuffle: bool = False
    seed: int = 0
    grad_clip: Optional[float] = 1.0
    ulysses_sequence_parallel_size: int = 1
    entropy_chunk_size: int = 2048
    # log-probs from hidden states without [tokens, vocab] logits (``actor_rollout_ref.model.use_fused_kernels``
    # and ``.fused_kernel_options`` {impl_backend, chunk_size}; see verl/workers/actor/fused_logprob.py)
    use_fused_kernels: bool = True
    fused_kernel_options: Optional[Any] = None
    # verl's ``policy_loss`` section: ``loss_mode`` names the policy loss in the core_algos registry
    policy_loss: Optional[Any] = None

    @classmethod
    def from_config(cls, config: Any, dp_size: int = 1) -> ActorSettings:
        """Build from a DictConfig / dict / attribute object (missing keys take the defaults above); the
        deprecated global ``ppo_micro_batch_size`` / ``log_prob_micro_batch_size`` are divided by ``dp_size``."""
        return settings_from_config(
            cls,
            config,
            {
                "ppo_micro_batch_size_per_gpu": "ppo_micro_batch_size",
                "log_prob_micro_batch_size_per_gpu": "log_prob_micro_batch_size",
            },
            dp_size=dp_size,
        )

    # ------------------------------------------------------------------ derived values
    @property
    def clip_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    @property
    def policy_loss_mode(self) -> str:
        """``policy_loss.loss_mode`` (default ``vanilla``: PPO clip with dual clip)."""
        mode = _lookup(self.policy_loss, "loss_mode") if self.policy_loss is not None else _MISSING
        return "vanilla" if mode in (_MISSING, None) else str(mode)

    @property
    def fused_backend(self) -> str:
        """``fused_kernel_options.impl_backend`` (default ``torch``: the chunked path)."""
        value = _lookup(self.fused_kernel_options, "impl_backend") if self.fused_kernel_options is not None else None
        return "torch" if value in (_MISSING, None) else str(value)

    @property
    def fused_chunk_size(self) -> int:
        """``fused_kernel_options.chunk_size``: tokens per chunk of the fused head (default 1024)."""
        value = _lookup(self.fused_kernel_options, "chunk_size") if self.fused_kernel_options is not None else None
        return 1024 if value in (_MISSING, None) else int(value)

    @property
    def log_prob_dynamic(self) -> bool:
        return self.use_dynamic_bsz if self.log_prob_use_dynamic_bsz is None else bool(self.log_prob_use_dynamic_bsz)

    @property
    def log_prob_token_budget(self) -> int:
        return int(self.log_prob_max_token_len_per_gpu or self.ppo_max_token_len_per_gpu)

    @property
    def log_prob_micro_batch_size(self) -> int:
        return int(self.log_prob_micro_batch_size_per_gpu or self.ppo_micro_batch_size_per_gpu or 1)

    def validate(self) -> None:
        """Raise ValueError naming the offending key and value."""
        from verl.trainer.ppo.core_algos import POLICY_LOSSES

        if self.policy_loss_mode not in POLICY_LOSSES:
            raise ValueError(
                f"actor.policy_loss.loss_mode must be one of [{', '.join(sorted(POLICY_LOSSES))}], "
                f"got {self.policy_loss_mode!r}"
            )
        if self.ppo_mini_batch_size is None or int(self.ppo_mini_batch_size) < 1:
            raise ValueError(f"actor.ppo_mini_batch_size must be >= 1, got {self.ppo_mini_batch_size}")
        if self.train_batch_size is not None and int(self.train_batch_size) < int(self.ppo_mini_batch_size):
            raise ValueError(
                f"actor.train_batch_size ({self.train_batch_size}) must be >= actor.ppo_mini_batch_size "
                f"({self.ppo_mini_batch_size}): their ratio is the number of optimizer steps per batch"
            )
        if not self.use_dynamic_bsz and (
            self.ppo_micro_batch_size_per_gpu is None or self.ppo_micro_batch_size_per_gpu < 1
        ):
            raise ValueError(
                "actor.ppo_micro_batch_size_per_gpu must be >= 1 when use_dynamic_bsz is False, "
                f"got {self.ppo_micro_batch_size_per_gpu}"
            )
        if self.use_dynamic_bsz and int(self.ppo_max_token_len_per_gpu) < 1:
            raise ValueError(f"actor.ppo_max_token_len_per_gpu must be >= 1, got {self.ppo_max_token_len_per_gpu}")
        if self.loss_agg_mode not in _LOSS_AGG_MODES:
            raise ValueError(f"actor.loss_agg_mode '{self.loss_agg_mode}' unknown; valid: {', '.join(_LOSS_AGG_MODES)}")
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"actor.clip_ratio_c must be > 1.0, got {self.clip_ratio_c}")
        if self.ppo_epochs < 1:
            raise ValueError(f"actor.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        from verl.workers.actor.fused_logprob import FUSED_BACKENDS

        if self.fused_backend not in FUSED_BACKENDS:
            raise ValueError(
                f"model.fused_kernel_options.impl_backend must be one of [{', '.join(FUSED_BACKENDS)}], "
                f"got {self.fused_backend!r}"
            )
        if self.fused_chunk_size < 1:
            raise ValueError(f"model.fused_kernel_options.chunk_size must be >= 1, got {self.fused_chunk_size}")
        if int(self.ulysses_sequence_parallel_size) != 1:
            raise ValueError(
                f"actor.ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size} is not supported "
                "(sequence parallelism is not implemented); use 1"
            )
