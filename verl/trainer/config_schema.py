"""Typed validation of the trainer config (``verl/trainer/config/ppo_trainer.yaml``).

``validate_config(cfg)`` checks the composed config before any worker starts and raises one
:class:`ConfigError` listing every problem found, each message naming the full key, what was expected and
what was given, e.g. ``data.train_batch_size must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size
(got 128 and 10)``. It never touches the filesystem or the network. The checks of single keys live in the typed
sections (``verl/trainer/config``, ``verl/workers/config``: their ``__post_init__``); this module adds those that
relate keys of different sections and the free-form workflow sub-configs (``recurrent.<name>``).

Helpers used by the entry point:

* :func:`resolve_grpo_use_adv` maps MemAgent's ``algorithm.grpo_use_adv`` onto ``norm_adv_by_std_in_grpo``;
* :func:`apply_config_aliases` applies all aliases (that one, ``ray_init.num_cpus``) and resolves
  ``trainer.device``;
* :func:`active_recurrent_name` returns the selected ``recurrent.<name>`` workflow, or None.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from verl.trainer.config.recurrent import RECURRENT_OFF as _RECURRENT_OFF
from verl.trainer.config.reward import REWARD_MANAGERS
from verl.trainer.config.trainer import DEVICES, RESUME_MODES, VALID_LOGGERS
from verl.workers.config.base import Checks, ConfigError, _is_int, collect_errors
from verl.workers.config.rollout import ROLLOUT_MODES, ROLLOUT_NAMES

logger = logging.getLogger(__name__)

__all__ = [
    "ConfigError",
    "validate_config",
    "resolve_grpo_use_adv",
    "apply_config_aliases",
    "resolve_device",
    "active_recurrent_name",
    "VALID_LOGGERS",
    "ROLLOUT_NAMES",
    "ROLLOUT_MODES",
    "DEVICES",
    "RESUME_MODES",
    "REWARD_MANAGERS",
    "RECURRENT_ADV_ESTIMATORS",
]

# Estimators that work on trajectory-level outcome rewards, i.e. in recurrent (multi-conversation) mode.
RECURRENT_ADV_ESTIMATORS = ("grpo", "grpo_multiconv")

_ABSENT = object()


# --------------------------------------------------------------------------------------------------
# access helpers
# --------------------------------------------------------------------------------------------------


def _as_omegaconf(cfg: Any) -> DictConfig:
    if isinstance(cfg, DictConfig):
        return cfg
    if isinstance(cfg, Mapping):
        return OmegaConf.create(dict(cfg))
    raise TypeError(f"config must be a DictConfig or a mapping, got {type(cfg).__name__}")


def _get(cfg: DictConfig, key: str, default: Any = _ABSENT) -> Any:
    """Value at dotted ``key`` (interpolations resolved); ``default`` when the key does not exist."""
    return OmegaConf.select(cfg, key, default=default, throw_on_missing=False)


class _Checker(Checks):
    """Cross-section checks on the raw config: :class:`Checks` (same messages) reading full dotted keys from
    ``cfg``, where a key missing from the config is itself an error."""

    def __init__(self, cfg: DictConfig):
        super().__init__(obj=None, prefix="", errors=[])
        self.cfg = cfg

    def get(self, key: str, default: Any = None) -> Any:
        value = _get(self.cfg, key)
        return default if value is _ABSENT else value

    def _value(self, key: str) -> tuple[bool, Any]:
        value = _get(self.cfg, key)
        if value is _ABSENT:
            self.error(f"{key} is missing from the config")
            return False, None
        return True, value


# --------------------------------------------------------------------------------------------------
# public helpers
# --------------------------------------------------------------------------------------------------


def active_recurrent_name(cfg: Any) -> Optional[str]:
    """Name of the workflow selected by ``recurrent.enable`` (e.g. ``"memory"``), or None when off.

    Raises :class:`ConfigError` when ``recurrent.enable`` is ``True`` (it is a name, not a switch) or names a
    sub-config that does not exist.
    """
    cfg = _as_omegaconf(cfg)
    enable = _get(cfg, "recurrent.enable", None)
    if enable is _ABSENT or enable in _RECURRENT_OFF:
        return None
    available = sorted(k for k in (_get(cfg, "recurrent", None) or {}) if k not in ("enable", "provider"))
    if enable is True or not isinstance(enable, str):
        raise ConfigError(
            [
                f"recurrent.enable must be the NAME of a workflow sub-config (one of [{', '.join(available)}]) "
                f"or False, not {enable!r}"
            ]
        )
    sub = _get(cfg, f"recurrent.{enable}", None)
    if enable == "enable" or not isinstance(sub, DictConfig):
        raise ConfigError(
            [
                f"recurrent.enable={enable!r} but there is no sub-config recurrent.{enable}; "
                f"available: [{', '.join(available)}]"
            ]
        )
    return enable


def resolve_grpo_use_adv(cfg: Any) -> bool:
    """Apply MemAgent's alias: a non-null ``algorithm.grpo_use_adv`` overwrites ``norm_adv_by_std_in_grpo``.

    Returns the effective ``algorithm.norm_adv_by_std_in_grpo`` (mutates ``cfg`` in place when needed).
    ``grpo_use_adv=False`` (the MemAgent scripts) gives Dr.GRPO advantages ``A = R - mean(R_group)``.
    """
    use_adv = _get(cfg, "algorithm.grpo_use_adv", None)
    if use_adv is not _ABSENT and use_adv is not None:
        if not isinstance(use_adv, bool):
            raise ConfigError([f"algorithm.grpo_use_adv must be True, False or null (got {use_adv!r})"])
        cfg.algorithm.norm_adv_by_std_in_grpo = use_adv
    return bool(cfg.algorithm.norm_adv_by_std_in_grpo)


def resolve_device(cfg: Any) -> str:
    """``trainer.device``, with null meaning ``cuda`` when a CUDA device is visible, else ``cpu``."""
    device = _get(cfg, "trainer.device", None)
    if device in (None, _ABSENT):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)


def apply_config_aliases(cfg: DictConfig) -> DictConfig:
    """Resolve the aliases in place and return ``cfg``.

    * ``algorithm.grpo_use_adv`` -> ``algorithm.norm_adv_by_std_in_grpo`` (see :func:`resolve_grpo_use_adv`);
    * ``ray_init.num_cpus`` (upstream key), when set, -> ``trainer.ray_num_cpus``;
    * ``trainer.device: null`` -> ``cuda`` or ``cpu`` (see :func:`resolve_device`).
    """
    resolve_grpo_use_adv(cfg)
    num_cpus = _get(cfg, "ray_init.num_cpus", None)
    if num_cpus not in (None, _ABSENT):
        cfg.trainer.ray_num_cpus = num_cpus
    cfg.trainer.device = resolve_device(cfg)
    return cfg


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------


def validate_config(cfg: Any) -> None:
    """Raise :class:`ConfigError` (a ``ValueError``) listing every invalid key; return None when valid.

    The per-key checks (types, ranges, choices) are the typed sections' ``__post_init__``
    (``verl.trainer.config.from_config``); the checks below relate keys of different sections."""
    from verl.trainer.config import PPOConfig

    cfg = _as_omegaconf(cfg)
    c = _Checker(cfg)
    with collect_errors() as typed_errors:
        PPOConfig.from_config(cfg)
    c.errors.extend(typed_errors)
    _check_batch_sizes(c)
    _check_log_prob_passes(c)
    _check_rollout(c)
    _check_compile_layers(c)
    _check_fused_adamw(c)
    _check_algorithm(c)
    _check_recurrent(c)
    if c.errors:
        raise ConfigError(list(dict.fromkeys(c.errors)))


def _check_batch_sizes(c: _Checker) -> None:
    a = "actor_rollout_ref.actor"
    train_bs, mini_bs = c.get("data.train_batch_size"), c.get(f"{a}.ppo_mini_batch_size")
    if _is_int(train_bs) and _is_int(mini_bs) and mini_bs >= 1 and train_bs % mini_bs != 0:
        c.error(f"data.train_batch_size must be divisible by {a}.ppo_mini_batch_size (got {train_bs} and {mini_bs})")
    _check_micro_batch(c, a, "ppo_micro_batch_size", f"{a}.use_dynamic_bsz", f"{a}.ppo_max_token_len_per_gpu")
    gen_bs = c.get("data.gen_batch_size")
    dapo = c.get("recurrent.enable") and c.get("algorithm.filter_groups.enable")
    if _is_int(gen_bs) and _is_int(train_bs) and gen_bs != train_bs and not dapo:
        # upstream trains on the whole generation batch then; here each update takes train_batch_size //
        # ppo_mini_batch_size optimizer steps of train_batch_size prompts, so only the DAPO refill uses it
        c.error(
            f"data.gen_batch_size={gen_bs} differs from data.train_batch_size={train_bs}: that needs "
            "algorithm.filter_groups.enable=True in recurrent mode (generation batches are drawn until "
            "train_batch_size groups survive the filter); set data.gen_batch_size=null otherwise"
        )


def _check_micro_batch(c: _Checker, section: str, name: str, dynamic_key: str, token_key: str) -> None:
    """``<name>_per_gpu`` (or the deprecated ``<name>``) is needed unless batches are built by token budget."""
    per_gpu_key, legacy_key = f"{section}.{name}_per_gpu", f"{section}.{name}"
    per_gpu, legacy = c.get(per_gpu_key), c.get(legacy_key)
    for key, value in ((per_gpu_key, per_gpu), (legacy_key, legacy)):
        if value is not None and not (_is_int(value) and value >= 1):
            c.error(f"{key} must be an integer >= 1 or null (got {value!r})")
    if per_gpu is not None and legacy is not None:
        c.error(f"set only one of {per_gpu_key} and the deprecated {legacy_key} (got {per_gpu} and {legacy})")
    if c.get(dynamic_key):
        c.integer(token_key, 1)
    elif per_gpu is None and legacy is None:
        c.error(f"{per_gpu_key} must be set (integer >= 1) when {dynamic_key} is False")


def _check_log_prob_passes(c: _Checker) -> None:
    r, ref = "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
    _check_micro_batch(
        c, r, "log_prob_micro_batch_size", f"{r}.log_prob_use_dynamic_bsz", f"{r}.log_prob_max_token_len_per_gpu"
    )
    needs_ref = c.get("actor_rollout_ref.actor.use_kl_loss") or c.get("algorithm.use_kl_in_reward")
    if needs_ref:
        _check_micro_batch(
            c,
            ref,
            "log_prob_micro_batch_size",
            f"{ref}.log_prob_use_dynamic_bsz",
            f"{ref}.log_prob_max_token_len_per_gpu",
        )
    if c.get("algorithm.adv_estimator") == "gae":
        _check_micro_batch(
            c, "critic", "ppo_micro_batch_size", "critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu"
        )


def _check_rollout(c: _Checker) -> None:
    r = "actor_rollout_ref.rollout"
    if c.get(f"{r}.name") == "vllm":
        tp = c.get(f"{r}.tensor_model_parallel_size")
        world = _world_size(c)
        if _is_int(tp) and tp >= 1 and world is not None and world % tp != 0:
            c.error(
                f"{r}.tensor_model_parallel_size ({tp}) must divide trainer.nnodes x trainer.n_gpus_per_node ({world})"
            )


def _check_fused_adamw(c: _Checker) -> None:
    """``optim.fused=True`` asks for torch's fused AdamW; ``optimizer_offload`` builds OffloadedAdamW, whose streamed
    step is its own (``verl.utils.fsdp_utils.resolve_fused_adamw``)."""
    a = "actor_rollout_ref.actor"
    if c.get(f"{a}.optim.fused") is True and c.get(f"{a}.fsdp_config.optimizer_offload") is True:
        c.error(
            f"{a}.optim.fused=True does not apply with {a}.fsdp_config.optimizer_offload=True (OffloadedAdamW streams "
            f"the state through its own step); set {a}.optim.fused=null or False"
        )


def _check_compile_layers(c: _Checker) -> None:
    """Per-layer compile does not take flex_attention, on any device (``verl/utils/compile_layers.py``); an automatic
    choice (null) never is flex_attention under compile_layers (``model_loading.resolve_attn_implementation``). Nor
    liger-kernel asked for (``use_liger=True``: dynamo cannot trace it, ``verl/utils/liger.py``); null resolves off
    under compile_layers."""
    from verl.utils.compile_layers import unsupported
    from verl.utils.liger import compile_conflict

    m = "actor_rollout_ref.model"
    if c.get(f"{m}.compile_layers"):
        reason = unsupported(c.get(f"{m}.attn_implementation"), on_cuda=resolve_device(c.cfg) == "cuda", section=m)
        if reason:
            c.error(f"{reason} (trainer.device={resolve_device(c.cfg)})")
        if c.get(f"{m}.use_liger") is True:
            c.error(compile_conflict(m))


def _world_size(c: _Checker) -> Optional[int]:
    nnodes, per_node = c.get("trainer.nnodes"), c.get("trainer.n_gpus_per_node")
    return nnodes * per_node if _is_int(nnodes) and _is_int(per_node) else None


def _check_algorithm(c: _Checker) -> None:
    if c.get("algorithm.overlong_buffer.enable", False):
        length, max_resp = c.get("algorithm.overlong_buffer.len"), c.get("data.max_response_length")
        if not _is_int(length) or length < 1 or (_is_int(max_resp) and length > max_resp):
            c.error(
                f"algorithm.overlong_buffer.len must be an integer in [1, data.max_response_length={max_resp}] "
                f"(got {length!r})"
            )


def _check_recurrent(c: _Checker) -> None:
    try:
        name = active_recurrent_name(c.cfg)
    except ConfigError as err:
        c.errors.extend(err.errors)
        return
    if name is None:
        return
    sub = f"recurrent.{name}"
    mode = c.get("actor_rollout_ref.rollout.mode")
    path_key, obj_key = (
        (f"{sub}.async_path", f"{sub}.async_name") if mode == "async" else (f"{sub}.path", f"{sub}.name")
    )
    for key in (path_key, obj_key):
        if not c.get(key):
            hint = (
                ""
                if mode == "async"
                else " (this workflow may exist only in async mode: actor_rollout_ref.rollout.mode=async)"
            )
            c.error(
                f"{key} must be set to use recurrent.enable={name} with actor_rollout_ref.rollout.mode={mode}{hint}"
            )
    config = c.get(f"{sub}.config")
    if config is not None and not isinstance(config, DictConfig):
        c.error(f"{sub}.config must be a mapping of keyword arguments or null (got {config!r})")
    if name == "memory":
        _check_memory(c, sub)
    estimator = c.get("algorithm.adv_estimator")
    if estimator not in RECURRENT_ADV_ESTIMATORS:
        c.error(
            f"algorithm.adv_estimator must be one of [{', '.join(RECURRENT_ADV_ESTIMATORS)}] in recurrent mode "
            f"(recurrent.enable={name}; got {estimator!r})"
        )
    if c.get("algorithm.use_kl_in_reward"):
        c.error(
            "algorithm.use_kl_in_reward=True is not supported in recurrent mode; use actor_rollout_ref.actor.use_kl_loss"
        )
    if c.get("reward_model.enable"):
        c.error("reward_model.enable=True (a learned reward model) is not supported in recurrent mode")


def _check_memory(c: _Checker, sub: str) -> None:
    if c.get("data.truncation") != "center":
        c.error(
            f"data.truncation must be center when recurrent.enable=memory (got {c.get('data.truncation')!r}): "
            "long contexts keep their first and last halves"
        )
    for field in (
        "chunk_size",
        "max_prompt_length",
        "max_memorization_length",
        "max_chunks",
        "max_final_response_length",
    ):
        c.integer(f"{sub}.config.{field}", 1)
    context_key = c.get(f"{sub}.config.context_key")
    if not isinstance(context_key, str) or not context_key:
        c.error(f"{sub}.config.context_key must be a column name (got {context_key!r})")
    data_key = c.get("data.context_key")
    if data_key is not None and data_key != context_key:
        logger.warning(
            "data.context_key=%r is informational; the memory dataset reads %s.config.context_key=%r",
            data_key,
            sub,
            context_key,
        )
