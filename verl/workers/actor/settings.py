"""The actor config as :class:`~verl.workers.actor.dp_actor.DataParallelPPOActor` uses it.

:class:`ActorSettings` is the typed ``actor_rollout_ref.actor`` section (:class:`verl.workers.config.ActorConfig`:
its fields, YAML defaults and checks) plus what the worker lays over it: ``use_remove_padding`` from the model
section and the ``log_prob_*`` micro-batching of the pass it runs (``rollout`` for old log-probs, ``ref`` for the
reference model). ``ActorSettings.from_config`` accepts an OmegaConf ``DictConfig``, a plain ``dict`` or a typed
config; absent keys take the YAML defaults; the deprecated global micro-batch keys are divided by the data-parallel
size as in verl.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from verl.workers.config.actor import ActorConfig
from verl.workers.config.base import BaseConfig, Checks, _is_int, to_plain

__all__ = ["ActorSettings", "per_gpu_from_global", "plain_values"]

logger = logging.getLogger(__name__)


def plain_values(config: Any) -> dict:
    """A plain dict of a DictConfig / mapping / typed config (None -> {})."""
    if isinstance(config, BaseConfig):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    config = to_plain(config)
    return dict(config) if isinstance(config, Mapping) else {}


def apply_legacy_micro_batches(
    values: dict, aliases: dict[str, str], dp_size: int, section: str, keep_legacy: tuple[str, ...] = ()
) -> dict:
    """``values`` with each deprecated global key of ``aliases`` (per-GPU key -> global key) divided by ``dp_size``
    into its per-GPU key (:func:`per_gpu_from_global`); the global key is then null (or dropped when it is not a
    field: ``keep_legacy`` lists those that are)."""
    values = dict(values)
    for new_key, old_key in aliases.items():
        legacy = values.pop(old_key, None)
        if legacy is not None:
            values[new_key] = per_gpu_from_global(legacy, dp_size, old_key, new_key, values.get(new_key), section)
        if old_key in keep_legacy:
            values[old_key] = None
    return values


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


@dataclass
class ActorSettings(ActorConfig):
    """``actor_rollout_ref.actor`` (every field of :class:`ActorConfig`, same defaults) plus the worker's overlay.

    Mini-batches: with ``train_batch_size`` set, each ``update_policy`` call takes exactly
    ``train_batch_size // ppo_mini_batch_size`` optimizer steps per epoch (docs/spec.md#policy-loss; the number of
    conversations per step varies, so rows are split into that many contiguous, possibly uneven mini-batches).
    Without it, mini-batches hold ``ppo_mini_batch_size`` rows (the last may be smaller).
    """

    # Unpad sequences (the worker copies actor_rollout_ref.model.use_remove_padding).
    use_remove_padding: bool = False
    # Rows with identical prompts packed with the prompt once (the worker copies actor_rollout_ref.model.share_prompts).
    share_prompts: bool = True
    # Rows per micro-batch per GPU of a log-prob pass (rollout's or ref's key); null = ppo_micro_batch_size_per_gpu.
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    # Token budget of a log-prob pass (rollout's or ref's key); null = ppo_max_token_len_per_gpu.
    log_prob_max_token_len_per_gpu: Optional[int] = None
    # Token-budget micro-batches for a log-prob pass (rollout's or ref's key); null = use_dynamic_bsz.
    log_prob_use_dynamic_bsz: Optional[bool] = None
    # Rows of logits turned into entropies at once (memory bound of the entropy pass).
    entropy_chunk_size: int = 2048
    # seq-mean-token-sum-norm divisor; null = the response length (Dr.GRPO).
    loss_scale_factor: Optional[float] = None
    # log-probs from hidden states without [tokens, vocab] logits (``actor_rollout_ref.model.use_fused_kernels``
    # and ``.fused_kernel_options`` {impl_backend, chunk_size}; see verl/workers/actor/fused_logprob.py)
    use_fused_kernels: bool = True
    fused_kernel_options: Optional[Any] = None

    @classmethod
    def from_config(cls, config: Any, dp_size: int = 1, path: Optional[str] = None) -> ActorSettings:
        """Build from a DictConfig / dict / typed config (absent keys take the defaults above); the deprecated
        global ``ppo_micro_batch_size`` / ``log_prob_micro_batch_size`` are divided by ``dp_size``."""
        values = apply_legacy_micro_batches(
            plain_values(config),
            {
                "ppo_micro_batch_size_per_gpu": "ppo_micro_batch_size",
                "log_prob_micro_batch_size_per_gpu": "log_prob_micro_batch_size",
            },
            dp_size,
            "actor",
            keep_legacy=("ppo_micro_batch_size",),
        )
        return super().from_config(values, path)

    def check(self, c: Checks) -> None:
        super().check(c)
        mini, train = self.ppo_mini_batch_size, self.train_batch_size
        if not c.bad & {"ppo_mini_batch_size", "train_batch_size"} and train is not None and train < mini:
            c.error(
                f"{c.key('train_batch_size')} ({train}) must be >= {c.key('ppo_mini_batch_size')} ({mini}): "
                "their ratio is the number of optimizer steps per batch"
            )
        per_gpu = self.ppo_micro_batch_size_per_gpu
        # a value of the wrong type already has its message (c.bad); comparing it would raise a TypeError
        if (
            not self.use_dynamic_bsz
            and "ppo_micro_batch_size_per_gpu" not in c.bad
            and (per_gpu is None or per_gpu < 1)
        ):
            c.error(
                f"{c.key('ppo_micro_batch_size_per_gpu')} must be >= 1 when use_dynamic_bsz is False, got {per_gpu}"
            )
        from verl.workers.actor.fused_logprob import FUSED_BACKENDS

        if self.fused_backend not in FUSED_BACKENDS:
            c.error(
                f"actor_rollout_ref.model.fused_kernel_options.impl_backend must be one of "
                f"[{', '.join(FUSED_BACKENDS)}], got {self.fused_backend!r}"
            )
        chunk = _option(self.fused_kernel_options, "chunk_size")
        if chunk is not None and not (_is_int(chunk) and chunk >= 1):
            c.error(f"actor_rollout_ref.model.fused_kernel_options.chunk_size must be >= 1, got {chunk!r}")

    # ------------------------------------------------------------------ derived values
    @property
    def policy_loss_mode(self) -> str:
        """``policy_loss.loss_mode`` (default ``vanilla``: PPO clip with dual clip)."""
        return self.policy_loss.loss_mode

    @property
    def fused_backend(self) -> str:
        """``fused_kernel_options.impl_backend`` (default ``torch``: the chunked path)."""
        value = _option(self.fused_kernel_options, "impl_backend")
        return "torch" if value is None else str(value)

    @property
    def fused_chunk_size(self) -> int:
        """``fused_kernel_options.chunk_size``: tokens per chunk of the fused head (default 1024)."""
        value = _option(self.fused_kernel_options, "chunk_size")
        return 1024 if value is None else int(value)

    @property
    def log_prob_dynamic(self) -> bool:
        return self.use_dynamic_bsz if self.log_prob_use_dynamic_bsz is None else bool(self.log_prob_use_dynamic_bsz)

    @property
    def log_prob_token_budget(self) -> int:
        return int(self.log_prob_max_token_len_per_gpu or self.ppo_max_token_len_per_gpu)

    @property
    def log_prob_micro_batch_size(self) -> int:
        """Rows per micro-batch of a log-prob pass (its own key, else the update's)."""
        return int(self.log_prob_micro_batch_size_per_gpu or self.ppo_micro_batch_size_per_gpu or 1)


def _option(options: Any, name: str) -> Any:
    """``options[name]`` of a mapping or typed section, or None (absent section or key)."""
    if options is None:
        return None
    if isinstance(options, Mapping):
        return options.get(name)
    return getattr(options, name, None)
