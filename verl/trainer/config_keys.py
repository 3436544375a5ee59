"""Which trainer config keys exist, and which are accepted but do nothing.

The valid keys are those of the config the run was composed from, before the command-line overrides: inside a
Hydra app (``main_ppo`` with ``--config-name``/``--config-path``) Hydra's ``job.config_name`` composed again from
the same config sources; otherwise (a config composed by hand, tests) the default config
``verl/trainer/config/ppo_trainer.yaml`` (it has no Hydra defaults list, so the composed default is the file
itself). The few keys of :data:`EXTRA_KEYS` that code reads but the YAML leaves out are valid too. :func:`check_config_keys` runs first in ``main_ppo.run``:

* a key the user added that is none of those (``+actor_rollout_ref.actor.ppo_mini_batchsize=2``: Hydra's own
  advice for a typo) is an :class:`UnknownConfigKeyError` naming it and the closest valid key, e.g.
  ``unknown key actor_rollout_ref.actor.ppo_mini_batchsize; did you mean
  actor_rollout_ref.actor.ppo_mini_batch_size?``; keys below a :data:`FREE_FORM` section are not checked;
* every key of :data:`INERT` (accepted, no effect) that the user set to a value other than its default is
  reported once, as one warning line of a table logged at start-up (and returned).

``tests/test_config_contract.py`` holds the other half of the contract: every key of the YAML is consumed (a
test shows it reaching code), in :data:`INERT`, or under a :data:`FREE_FORM` section. A new key must go into
one of them (CONTRIBUTING.md, "Adding things").
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterator, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import DictConfig, ListConfig, OmegaConf

from verl.trainer.config_schema import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "CONFIG_PATH",
    "EXTRA_KEYS",
    "FREE_FORM",
    "INERT",
    "UPSTREAM_NAMES",
    "InertKey",
    "UnknownConfigKeyError",
    "check_config_keys",
    "default_config",
    "find_inert_keys",
    "find_unknown_keys",
    "format_inert_table",
    "is_free_form",
    "leaf_keys",
    "valid_keys",
]

CONFIG_PATH = Path(__file__).resolve().parent / "config" / "ppo_trainer.yaml"

# Sections whose sub-keys are not checked: key (or pattern, ``*`` = one component) -> why they are free-form.
FREE_FORM: dict[str, str] = {
    "actor_rollout_ref.model.override_config": "attributes of the HF model config, set on actor, ref and rollout "
    "engine; any attribute of the model's config class (transformers checks them)",
    "critic.model.override_config": "attributes of the critic's HF model config (any attribute of its config class)",
    "actor_rollout_ref.rollout.engine_kwargs": "vLLM EngineArgs fields, passed to vLLM as given (vLLM checks them)",
    "reward_model.reward_kwargs": "keyword arguments of the scoring function; their names are the function's",
    "recurrent.*": "a workflow section of one's own (recurrent.<name>: path/name/async_path/async_name/config); "
    "sections of the YAML (memory, tool_gsm8k, trival) are checked key by key",
}

# Keys accepted although the YAML does not hold them (code reads them); key -> why they are not in the YAML.
# Each is also in INERT or consumed (tests/test_config_contract.py).
EXTRA_KEYS: dict[str, str] = {
    "data.context_key": "the original scripts pass +data.context_key='context' and '+' fails on a key that exists",
    "recurrent.memory.config.style": "field of the original MemoryConfig (declared without a default)",
}

# Current upstream verl's names of keys this config has under another name: an unknown-key error names ours.
UPSTREAM_NAMES: dict[str, str] = {
    "algorithm.rollout_correction.bypass_mode": "algorithm.bypass_mode",
    "algorithm.rollout_correction.rollout_is": "algorithm.rollout_is",
    "algorithm.rollout_correction.rollout_is_threshold": "algorithm.rollout_is_threshold",
}

_SP_REASON = "sequence parallelism is not implemented: 1 is the only supported value (others are rejected)"
_NO_RM = "no learned reward model exists (rewards come from reward_model.reward_manager and the scorers)"
_WRAP = "FSDP2 always wraps each transformer layer; the size threshold is not read"

# Keys that are accepted and have no effect: key -> reason (docs/config.md, "Keys that do nothing").
INERT: dict[str, str] = {
    "data.tokenizer": "the tokenizer is always actor_rollout_ref.model.path's",
    "data.return_raw_input_ids": "not read: the datasets return the fields the trainers need",
    "data.return_raw_chat": "not read: the datasets return the fields the trainers need",
    "data.return_full_prompt": "not read: the datasets return the fields the trainers need",
    "data.filter_overlong_prompts_workers": "the filter runs in the loading process",
    "data.image_key": "multimodal datasets are not supported",
    "data.video_key": "multimodal datasets are not supported",
    "data.custom_cls.path": "custom dataset classes are not loaded: RLHFDataset or the workflow register's dataset",
    "data.custom_cls.name": "custom dataset classes are not loaded: RLHFDataset or the workflow register's dataset",
    "data.context_key": "informational: the memory dataset reads recurrent.memory.config.context_key "
    "(a warning is logged when the two differ)",
    "actor_rollout_ref.hybrid_engine": "actor and rollout are always colocated",
    "actor_rollout_ref.actor.strategy": "fsdp and fsdp2 both mean the one FSDP2 engine (validated only)",
    "actor_rollout_ref.actor.use_torch_compile": "the log-prob/entropy helpers are not compiled",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": _SP_REASON,
    "actor_rollout_ref.actor.checkpoint.contents": "a checkpoint always holds model, optimizer, lr scheduler and rng "
    "(verl/utils/checkpoint/model_state.py); HF weights come from verl.utils.checkpoint.hf_export",
    "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params": _WRAP,
    "actor_rollout_ref.ref.strategy": "the reference model uses the actor's FSDP2 engine",
    "actor_rollout_ref.ref.fsdp_config.wrap_policy.min_num_params": _WRAP,
    "actor_rollout_ref.ref.use_torch_compile": "the log-prob helpers are not compiled",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": _SP_REASON,
    "actor_rollout_ref.rollout.use_fire_sampling": "FIRE sampling is not implemented (True is rejected)",
    "actor_rollout_ref.rollout.ignore_eos": "not passed to the engines: generation stops at EOS",
    "actor_rollout_ref.rollout.load_format": "not passed to vLLM: the engine loads model.path's weights, then the weight sync overwrites them",
    "actor_rollout_ref.rollout.disable_log_stats": "not passed to vLLM (use engine_kwargs.disable_log_stats)",
    "actor_rollout_ref.rollout.enable_chunked_prefill": "not passed to vLLM (use engine_kwargs.enable_chunked_prefill)",
    "actor_rollout_ref.rollout.do_sample": "training rollouts always sample; temperature=0 gives greedy decoding",
    "critic.rollout_n": "the critic's batches come from the trainer; rollout.n is read there",
    "critic.strategy": "the critic uses the one FSDP2 engine (validated only)",
    "critic.model.tokenizer_path": "the critic uses the policy's tokenizer (same token ids)",
    "critic.model.fsdp_config.param_offload": "critic offload is not implemented",
    "critic.model.fsdp_config.optimizer_offload": "critic offload is not implemented",
    "critic.model.fsdp_config.wrap_policy.min_num_params": _WRAP,
    "critic.ulysses_sequence_parallel_size": _SP_REASON,
    "critic.checkpoint.contents": "a checkpoint always holds model, optimizer, lr scheduler and rng",
    "reward_model.enable": _NO_RM + "; True is rejected in recurrent mode",
    "reward_model.strategy": _NO_RM,
    "reward_model.model.input_tokenizer": _NO_RM,
    "reward_model.model.path": _NO_RM,
    "reward_model.model.external_lib": _NO_RM,
    "reward_model.model.use_remove_padding": _NO_RM,
    "reward_model.model.fsdp_config.wrap_policy.min_num_params": _NO_RM,
    "reward_model.model.fsdp_config.param_offload": _NO_RM,
    "reward_model.model.fsdp_config.fsdp_size": _NO_RM,
    "reward_model.model.fsdp_config.reshard_after_forward": _NO_RM,
    "reward_model.micro_batch_size": _NO_RM,
    "reward_model.micro_batch_size_per_gpu": _NO_RM,
    "reward_model.max_length": _NO_RM,
    "reward_model.ulysses_sequence_parallel_size": _NO_RM,
    "reward_model.use_dynamic_bsz": _NO_RM,
    "reward_model.forward_max_token_len_per_gpu": _NO_RM,
    "reward_model.launch_reward_fn_async": "rewards are computed when the rollout returns",
    "trainer.default_hdfs_dir": "checkpoints are not copied to HDFS",
    "trainer.del_local_ckpt_after_load": "checkpoints are kept after loading",
    "trainer.max_critic_ckpt_to_keep": "a checkpoint folder holds actor and critic: trainer.max_actor_ckpt_to_keep "
    "decides for both",
    "trainer.ray_wait_register_center_timeout": "not read: worker start-up has no register-center wait",
    "recurrent.memory.config.style": "accepted and ignored, as in the original (docs/spec.md#bug-style-field)",
}


class UnknownConfigKeyError(ConfigError):
    """Keys that are not in the default config (nor in EXTRA_KEYS, nor under a FREE_FORM section); a
    :class:`~verl.trainer.config_schema.ConfigError` (``ValueError``) whose ``messages`` name each key."""

    def __init__(self, messages: list[str]):
        self.messages = list(messages)
        super().__init__(self.messages)


class InertKey(NamedTuple):
    """An INERT key the user set away from its default."""

    key: str
    value: Any
    default: Any
    reason: str


_ABSENT = "<absent>"


def _to_tree(cfg: Any) -> Any:
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=False)
    return cfg


def leaf_keys(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, unresolved value)`` of every leaf; a non-empty mapping is descended into, lists and empty
    mappings are leaves."""
    tree = _to_tree(cfg)
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            yield from leaf_keys(value, path)
        else:
            yield path, value


def _config_source() -> tuple[str, ...] | None:
    """``(config_name, config sources...)`` of the running Hydra app, or None outside one (or in a bare
    ``initialize``/``compose`` context, which has no job)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    if not (HydraConfig.initialized() and GlobalHydra.instance().is_initialized()):
        return None
    hydra_cfg = HydraConfig.get()
    sources = tuple(f"{s.provider}={s.schema}://{s.path}" for s in hydra_cfg.runtime.config_sources)
    return (str(hydra_cfg.job.config_name), *sources)


@lru_cache(maxsize=8)
def _tree_of(source: tuple[str, ...] | None) -> dict:
    if source is None:
        return OmegaConf.to_container(OmegaConf.load(CONFIG_PATH), resolve=False)
    from hydra import compose

    # the same config name and search path as the run, without its command-line overrides
    return OmegaConf.to_container(compose(config_name=source[0]), resolve=False)


def _default_tree() -> dict:
    """The config the run was composed from (see the module docstring), unresolved."""
    return _tree_of(_config_source())


def default_config() -> DictConfig:
    """The default config, unresolved (a fresh copy)."""
    return OmegaConf.create(_default_tree())


def _pattern_match(pattern: str, key: str) -> bool:
    p, k = pattern.split("."), key.split(".")
    return len(k) >= len(p) and all(a in ("*", b) for a, b in zip(p, k))


def is_free_form(key: str) -> bool:
    """True when ``key`` lies strictly below a FREE_FORM section (the ``recurrent.*`` pattern: below a workflow
    section the YAML does not define)."""
    for pattern in FREE_FORM:
        if "*" in pattern:
            section = ".".join(key.split(".")[: pattern.count(".") + 1])
            if _pattern_match(pattern, key) and not _has_node(section):
                return True
        elif key.startswith(pattern + "."):
            return True
    return False


def _has_node(key: str) -> bool:
    node: Any = _default_tree()
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def valid_keys() -> tuple[str, ...]:
    """Every leaf key of the default config plus EXTRA_KEYS (the candidates of "did you mean")."""
    return _valid_keys_of(_config_source())


@lru_cache(maxsize=8)
def _valid_keys_of(source: tuple[str, ...] | None) -> tuple[str, ...]:
    return tuple(sorted({k for k, _ in leaf_keys(_tree_of(source))} | set(EXTRA_KEYS)))


def _closest(key: str) -> str | None:
    """The valid key nearest to ``key``: a sibling with a similar last name, else a similar full key."""
    parent, name = key.rsplit(".", 1) if "." in key else ("", key)
    siblings = {k.rsplit(".", 1)[-1]: k for k in valid_keys() if (k.rsplit(".", 1)[0] if "." in k else "") == parent}
    match = difflib.get_close_matches(name, list(siblings), n=1, cutoff=0.6)
    if match:
        return siblings[match[0]]
    match = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.85)
    return match[0] if match else None


def find_unknown_keys(cfg: Any) -> list[str]:
    """One message per key of ``cfg`` that the default config does not know, with the closest valid key."""
    messages = []
    for key, _ in leaf_keys(cfg):
        if _has_node(key) or key in EXTRA_KEYS or is_free_form(key):
            continue
        if any(extra.startswith(key + ".") for extra in EXTRA_KEYS):  # e.g. an empty section holding extras
            continue
        if key in UPSTREAM_NAMES:
            messages.append(f"unknown key {key} (upstream verl's name); here it is {UPSTREAM_NAMES[key]}")
            continue
        closest = _closest(key)
        hint = f"; did you mean {closest}?" if closest else ""
        messages.append(f"unknown key {key}{hint}")
    return messages


def _select(tree: Any, key: str) -> Any:
    node = tree
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def find_inert_keys(cfg: Any) -> list[InertKey]:
    """INERT keys whose value in ``cfg`` differs from the default (unresolved values are compared, so a key
    that follows another by interpolation is reported only when set itself)."""
    tree, default = _to_tree(cfg), _default_tree()
    found = []
    for key, reason in INERT.items():
        value, base = _select(tree, key), _select(default, key)
        if value is not _ABSENT and value != base:
            found.append(InertKey(key, value, base, reason))
    return found


def format_inert_table(inert: list[InertKey]) -> list[str]:
    """Rows ``key = value  (default ...): reason`` aligned on the key column."""
    width = max((len(i.key) for i in inert), default=0)
    rows = []
    for i in inert:
        default = "not set" if i.default is _ABSENT else repr(i.default)
        rows.append(f"{i.key.ljust(width)} = {i.value!r} (default {default}): {i.reason}")
    return rows


def check_config_keys(cfg: Any) -> list[InertKey]:
    """Raise :class:`UnknownConfigKeyError` listing every unknown key; log the INERT keys set away from their
    default, one warning line each under one header, and return them."""
    unknown = find_unknown_keys(cfg)
    if unknown:
        raise UnknownConfigKeyError(unknown)
    inert = find_inert_keys(cfg)
    if inert:
        logger.warning("%d config key(s) you set have no effect (INERT in %s):", len(inert), Path(__file__).name)
        for row in format_inert_table(inert):
            logger.warning("  %s", row)
    return inert
