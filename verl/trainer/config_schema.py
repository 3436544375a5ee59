"""Typed validation of the trainer config (``verl/trainer/config/ppo_trainer.yaml``).

``validate_config(cfg)`` checks the composed config before any worker starts and raises one
:class:`ConfigError` listing every problem found, each message naming the full key, what was expected and
what was given, e.g. ``data.train_batch_size must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size
(got 128 and 10)``. It never touches the filesystem or the network.

Helpers used by the entry point:

* :func:`resolve_grpo_use_adv` maps MemAgent's ``algorithm.grpo_use_adv`` onto ``norm_adv_by_std_in_grpo``;
* :func:`apply_config_aliases` applies all aliases (that one, ``ray_init.num_cpus``) and resolves
  ``trainer.device``;
* :func:`active_recurrent_name` returns the selected ``recurrent.<name>`` workflow, or None.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

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

# Logger backends implemented by verl.utils.tracking.Tracking.
VALID_LOGGERS = ("console", "wandb", "tensorboard", "jsonl")
# Rollout engines (verl.workers.rollout.base.get_rollout_engine).
ROLLOUT_NAMES = ("vllm", "hf")
ROLLOUT_MODES = ("sync", "async")
DEVICES = ("cpu", "cuda")
RESUME_MODES = ("auto", "disable", "resume_path")
ACTOR_STRATEGIES = ("fsdp", "fsdp2")
# Reward managers (verl/workers/reward_manager); extend when a new one is registered.
REWARD_MANAGERS = ("naive", "thread")
WARMUP_STYLES = ("constant", "cosine")
KL_CTRL_TYPES = ("fixed", "adaptive")
FILTER_GROUP_METRICS = ("score", "reward")
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")
# Estimators that work on trajectory-level outcome rewards, i.e. in recurrent (multi-conversation) mode.
RECURRENT_ADV_ESTIMATORS = ("grpo", "grpo_multiconv")
# Values of recurrent.enable that mean "off".
_RECURRENT_OFF = (None, False, "", "false", "False", "none", "None", "null")

_ABSENT = object()


class ConfigError(ValueError):
    """Invalid trainer configuration; ``errors`` holds one message per problem."""

    def __init__(self, errors: Sequence[str]):
        self.errors = list(errors)
        super().__init__("invalid config:\n  - " + "\n  - ".join(self.errors))


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_list(value: Any) -> list:
    if isinstance(value, ListConfig):
        return list(OmegaConf.to_container(value, resolve=True))
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


class _Checker:
    """Collects error messages; every check names the full key and the offending value."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.errors: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:
        value = _get(self.cfg, key)
        return default if value is _ABSENT else value

    def error(self, message: str) -> None:
        self.errors.append(message)

    def present(self, key: str) -> bool:
        if _get(self.cfg, key) is _ABSENT:
            self.error(f"{key} is missing from the config")
            return False
        return True

    def choice(self, key: str, choices: Sequence[Any], allow_none: bool = False) -> None:
        if not self.present(key):
            return
        value = self.get(key)
        if value is None and allow_none:
            return
        if value not in choices:
            valid = ", ".join(map(str, choices)) + (", null" if allow_none else "")
            self.error(f"{key} must be one of [{valid}] (got {value!r})")

    def integer(
        self, key: str, minimum: Optional[int] = None, allow_none: bool = False, also: Sequence[int] = ()
    ) -> None:
        """Integer >= minimum (or one of ``also``, e.g. -1 meaning 'off'), or null when allowed."""
        if not self.present(key):
            return
        value = self.get(key)
        if value is None and allow_none:
            return
        if not (_is_int(value) and (value in also or minimum is None or value >= minimum)):
            parts = ([f">= {minimum}"] if minimum is not None else []) + [str(v) for v in also]
            parts += ["null"] if allow_none else []
            expected = "an integer" + (" " + " or ".join(parts) if parts else "")
            self.error(f"{key} must be {expected} (got {value!r})")

    def number(self, key: str, check: Callable[[float], bool], expected: str, allow_none: bool = False) -> None:
        if not self.present(key):
            return
        value = self.get(key)
        if value is None and allow_none:
            return
        if not _is_number(value) or not check(float(value)):
            self.error(f"{key} must be {expected} (got {value!r})")

    def boolean(self, key: str) -> None:
        if self.present(key) and not isinstance(self.get(key), bool):
            self.error(f"{key} must be True or False (got {self.get(key)!r})")


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
    """Raise :class:`ConfigError` (a ``ValueError``) listing every invalid key; return None when valid."""
    cfg = _as_omegaconf(cfg)
    c = _Checker(cfg)
    _check_data(c)
    _check_actor(c)
    _check_log_prob_passes(c)
    _check_rollout(c)
    _check_algorithm(c)
    _check_reward(c)
    _check_trainer(c)
    _check_recurrent(c)
    if c.errors:
        raise ConfigError(c.errors)


def _check_data(c: _Checker) -> None:
    from verl.utils.dataset.rl_dataset import TRUNCATIONS

    c.integer("data.max_prompt_length", 1)
    c.integer("data.max_response_length", 1)
    c.integer("data.train_batch_size", 1)
    c.integer("data.val_batch_size", 1, allow_none=True)
    c.integer("data.gen_batch_size", 1, allow_none=True)
    c.integer("data.dataloader_num_workers", 0)
    c.choice("data.truncation", TRUNCATIONS)
    c.boolean("data.shuffle")
    c.boolean("data.filter_overlong_prompts")
    c.boolean("data.return_raw_chat")
    for key in ("data.train_files", "data.val_files"):
        if c.present(key) and c.get(key) in (None, "", []):
            c.error(f"{key} must name at least one file (got {c.get(key)!r})")
    train_bs, gen_bs = c.get("data.train_batch_size"), c.get("data.gen_batch_size")
    if _is_int(train_bs) and _is_int(gen_bs) and gen_bs < train_bs:
        c.error(f"data.gen_batch_size must be >= data.train_batch_size or null (got {gen_bs} and {train_bs})")


def _check_actor(c: _Checker) -> None:
    from verl.trainer.ppo.core_algos import AGG_MODES, KL_PENALTY_TYPES, TURN_WEIGHTING_MODES

    a = "actor_rollout_ref.actor"
    c.choice(f"{a}.strategy", ACTOR_STRATEGIES)
    c.integer(f"{a}.ppo_mini_batch_size", 1)
    c.integer(f"{a}.train_batch_size", 1)
    train_bs, mini_bs = c.get("data.train_batch_size"), c.get(f"{a}.ppo_mini_batch_size")
    if _is_int(train_bs) and _is_int(mini_bs) and mini_bs >= 1 and train_bs % mini_bs != 0:
        c.error(f"data.train_batch_size must be divisible by {a}.ppo_mini_batch_size (got {train_bs} and {mini_bs})")
    c.boolean(f"{a}.use_dynamic_bsz")
    _check_micro_batch(c, a, "ppo_micro_batch_size", f"{a}.use_dynamic_bsz", f"{a}.ppo_max_token_len_per_gpu")
    c.number(f"{a}.grad_clip", lambda v: v > 0, "> 0 or null", allow_none=True)
    c.number(f"{a}.clip_ratio", lambda v: 0 < v < 1, "in (0, 1)")
    c.number(f"{a}.clip_ratio_low", lambda v: 0 < v < 1, "in (0, 1) or null", allow_none=True)
    c.number(f"{a}.clip_ratio_high", lambda v: v > 0, "> 0 or null", allow_none=True)
    c.number(f"{a}.clip_ratio_c", lambda v: v > 1, "> 1 (dual-clip lower bound)")
    c.choice(f"{a}.loss_agg_mode", AGG_MODES)
    c.choice(f"{a}.turn_weighting", TURN_WEIGHTING_MODES)
    c.number(f"{a}.entropy_coeff", lambda v: True, "a number")
    c.boolean(f"{a}.use_kl_loss")
    c.number(f"{a}.kl_loss_coef", lambda v: v >= 0, ">= 0")
    c.choice(f"{a}.kl_loss_type", KL_PENALTY_TYPES)
    c.integer(f"{a}.ppo_epochs", 1)
    c.integer(f"{a}.ulysses_sequence_parallel_size", 1)
    sp = c.get(f"{a}.ulysses_sequence_parallel_size")
    if _is_int(sp) and sp != 1:
        c.error(f"{a}.ulysses_sequence_parallel_size must be 1: sequence parallelism is not implemented (got {sp})")
    contents = _as_list(c.get(f"{a}.checkpoint.contents", []))
    unknown = [x for x in contents if x not in CHECKPOINT_CONTENTS]
    if unknown:
        c.error(f"{a}.checkpoint.contents entries must be in [{', '.join(CHECKPOINT_CONTENTS)}] (got {unknown})")
    o = f"{a}.optim"
    c.number(f"{o}.lr", lambda v: v > 0, "> 0")
    c.integer(f"{o}.lr_warmup_steps", 0, also=(-1,))
    c.number(f"{o}.lr_warmup_steps_ratio", lambda v: 0 <= v <= 1, "in [0, 1]")
    c.number(f"{o}.min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1] or null", allow_none=True)
    c.choice(f"{o}.warmup_style", WARMUP_STYLES)
    c.number(f"{o}.weight_decay", lambda v: v >= 0, ">= 0")
    betas = c.get(f"{o}.betas")
    if betas is not None:
        values = _as_list(betas)
        if len(values) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in values):
            c.error(f"{o}.betas must be two numbers in [0, 1) (got {values})")
    c.integer(f"{a}.fsdp_config.fsdp_size", 1, also=(-1,))
    _check_fused_kernels(c)


def _check_fused_kernels(c: _Checker) -> None:
    """``model.use_fused_kernels`` and ``model.fused_kernel_options`` (each checked when present)."""
    from verl.workers.actor.fused_logprob import FUSED_BACKENDS

    m = "actor_rollout_ref.model"
    if _get(c.cfg, f"{m}.use_fused_kernels") is not _ABSENT:
        c.boolean(f"{m}.use_fused_kernels")
    if _get(c.cfg, f"{m}.fused_kernel_options.impl_backend") is not _ABSENT:
        c.choice(f"{m}.fused_kernel_options.impl_backend", FUSED_BACKENDS)
    if _get(c.cfg, f"{m}.fused_kernel_options.chunk_size") is not _ABSENT:
        c.integer(f"{m}.fused_kernel_options.chunk_size", 1)


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
    c.choice(f"{r}.name", ROLLOUT_NAMES)
    c.choice(f"{r}.mode", ROLLOUT_MODES)
    c.integer(f"{r}.n", 1)
    c.integer(f"{r}.val_kwargs.n", 1)
    for prefix in (r, f"{r}.val_kwargs"):
        c.number(f"{prefix}.temperature", lambda v: v >= 0, ">= 0")
        c.number(f"{prefix}.top_p", lambda v: 0 < v <= 1, "in (0, 1]")
        c.integer(f"{prefix}.top_k", 1, also=(-1,))
        c.boolean(f"{prefix}.do_sample")
    c.integer(f"{r}.prompt_length", 1)
    c.integer(f"{r}.response_length", 1)
    c.integer(f"{r}.max_model_len", 1, allow_none=True)
    c.integer(f"{r}.max_num_batched_tokens", 1)
    c.integer(f"{r}.cudagraph_max_tokens", 1, allow_none=True)
    graphs, step_budget = c.get(f"{r}.cudagraph_max_tokens"), c.get(f"{r}.max_num_batched_tokens")
    if _is_int(graphs) and _is_int(step_budget) and graphs > step_budget:
        c.error(f"{r}.cudagraph_max_tokens ({graphs}) must be <= {r}.max_num_batched_tokens ({step_budget})")
    c.integer(f"{r}.max_num_seqs", 1)
    c.integer(f"{r}.tensor_model_parallel_size", 1)
    c.number(f"{r}.gpu_memory_utilization", lambda v: 0 < v <= 1, "in (0, 1]")
    if c.get(f"{r}.use_fire_sampling", False):
        c.error(f"{r}.use_fire_sampling=True is not implemented; set it to False")
    if c.get(f"{r}.name") == "vllm":
        tp = c.get(f"{r}.tensor_model_parallel_size")
        world = _world_size(c)
        if _is_int(tp) and tp >= 1 and world is not None and world % tp != 0:
            c.error(
                f"{r}.tensor_model_parallel_size ({tp}) must divide trainer.nnodes x trainer.n_gpus_per_node ({world})"
            )
        max_len = c.get(f"{r}.max_model_len")
        if max_len is None and _is_int(c.get(f"{r}.prompt_length")) and _is_int(c.get(f"{r}.response_length")):
            max_len = c.get(f"{r}.prompt_length") + c.get(f"{r}.response_length")
        budget = c.get(f"{r}.max_num_batched_tokens")
        if not c.get(f"{r}.enable_chunked_prefill", True) and _is_int(budget) and _is_int(max_len) and budget < max_len:
            c.error(
                f"{r}.max_num_batched_tokens ({budget}) must be >= the max model length ({max_len}) when "
                f"{r}.enable_chunked_prefill is False"
            )


def _world_size(c: _Checker) -> Optional[int]:
    nnodes, per_node = c.get("trainer.nnodes"), c.get("trainer.n_gpus_per_node")
    return nnodes * per_node if _is_int(nnodes) and _is_int(per_node) else None


def _check_algorithm(c: _Checker) -> None:
    from verl.trainer.ppo.core_algos import ADV_ESTIMATORS, KL_PENALTY_TYPES

    c.choice("algorithm.adv_estimator", sorted(ADV_ESTIMATORS))
    c.boolean("algorithm.norm_adv_by_std_in_grpo")
    use_adv = c.get("algorithm.grpo_use_adv")
    if use_adv is not None and not isinstance(use_adv, bool):
        c.error(f"algorithm.grpo_use_adv must be True, False or null (got {use_adv!r})")
    c.number("algorithm.gamma", lambda v: 0 <= v <= 1, "in [0, 1]")
    c.number("algorithm.lam", lambda v: 0 <= v <= 1, "in [0, 1]")
    c.boolean("algorithm.use_kl_in_reward")
    c.choice("algorithm.kl_penalty", KL_PENALTY_TYPES)
    c.choice("algorithm.kl_ctrl.type", KL_CTRL_TYPES)
    c.number("algorithm.kl_ctrl.kl_coef", lambda v: v >= 0, ">= 0")
    if c.get("algorithm.kl_ctrl.type") == "adaptive":
        c.number("algorithm.kl_ctrl.horizon", lambda v: v > 0, "> 0 for the adaptive controller")
        c.number("algorithm.kl_ctrl.target_kl", lambda v: v > 0, "> 0 for the adaptive controller")
    if c.get("algorithm.filter_groups.enable", False):
        c.choice("algorithm.filter_groups.metric", FILTER_GROUP_METRICS)
        c.integer("algorithm.filter_groups.max_num_gen_batches", 0)
    if c.get("algorithm.overlong_buffer.enable", False):
        length, max_resp = c.get("algorithm.overlong_buffer.len"), c.get("data.max_response_length")
        if not _is_int(length) or length < 1 or (_is_int(max_resp) and length > max_resp):
            c.error(
                f"algorithm.overlong_buffer.len must be an integer in [1, data.max_response_length={max_resp}] "
                f"(got {length!r})"
            )
        c.number("algorithm.overlong_buffer.penalty_factor", lambda v: v >= 0, ">= 0")


def _check_reward(c: _Checker) -> None:
    c.choice("reward_model.reward_manager", REWARD_MANAGERS)
    c.boolean("reward_model.enable")


def _check_trainer(c: _Checker) -> None:
    t = "trainer"
    loggers = _as_list(c.get(f"{t}.logger", []))
    for name in loggers:
        if name not in VALID_LOGGERS:
            c.error(f"{t}.logger entries must be in [{', '.join(VALID_LOGGERS)}] (got {name!r} in {loggers})")
    c.choice(f"{t}.device", DEVICES, allow_none=True)
    c.choice(f"{t}.resume_mode", RESUME_MODES)
    if c.get(f"{t}.resume_mode") == "resume_path" and not c.get(f"{t}.resume_from_path"):
        c.error(f"{t}.resume_from_path must be set when {t}.resume_mode=resume_path")
    c.integer(f"{t}.nnodes", 1)
    c.integer(f"{t}.n_gpus_per_node", 1)
    c.integer(f"{t}.total_epochs", 1)
    c.integer(f"{t}.total_training_steps", 1, allow_none=True)
    c.integer(f"{t}.save_freq", 1, also=(-1,))
    c.integer(f"{t}.test_freq", 1, also=(-1,))
    c.number(f"{t}.max_wall_time_s", lambda v: v > 0, "> 0 seconds (or null for no limit)", allow_none=True)
    c.integer(f"{t}.critic_warmup", 0)
    c.integer(f"{t}.log_val_generations", 0)
    c.integer(f"{t}.max_actor_ckpt_to_keep", 1, allow_none=True)
    c.integer(f"{t}.max_critic_ckpt_to_keep", 1, allow_none=True)
    c.integer(f"{t}.ray_num_cpus", 1, allow_none=True)
    c.boolean(f"{t}.val_before_train")
    if not c.get(f"{t}.default_local_dir"):
        c.error(f"{t}.default_local_dir must be a folder path (got {c.get(f'{t}.default_local_dir')!r})")


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
