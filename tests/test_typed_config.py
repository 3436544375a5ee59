"""The typed config (verl/trainer/config/*.py, verl/workers/config/*.py) and ppo_trainer.yaml cannot drift:
every YAML key of a typed section is a dataclass field with the same default and every field is a YAML key;
the builder turns the composed YAML into those objects; validation names the full dotted key."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from verl.trainer.config import PPOConfig, from_config
from verl.workers.config import ActorConfig, BaseConfig, ConfigError, RolloutConfig

CONFIG_DIR = Path(__file__).resolve().parents[1] / "verl" / "trainer" / "config"
# Sub-trees that are not typed: the workflow sub-configs (recurrent.<name>, built by the workflow provider).
FREE_FORM = {"recurrent.trival", "recurrent.memory", "recurrent.tool_gsm8k"}


def compose_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _drift(cls: type, yaml_node: dict, path: str) -> list[str]:
    """Mismatches between a dataclass and the (unresolved) YAML section at ``path``."""
    problems = []
    fields = {f.name: f for f in dataclasses.fields(cls)}
    yaml_keys = {k for k in yaml_node if f"{path}.{k}".lstrip(".") not in FREE_FORM}
    for name in sorted(yaml_keys - set(fields)):
        problems.append(f"{path}.{name}: in the YAML, not a field of {cls.__name__}")
    for name in sorted(set(fields) - yaml_keys):
        problems.append(f"{path}.{name}: a field of {cls.__name__}, not in the YAML")
    for name in sorted(yaml_keys & set(fields)):
        key, value, default = f"{path}.{name}".lstrip("."), yaml_node[name], _default(fields[name])
        if isinstance(default, BaseConfig):
            problems += _drift(type(default), value or {}, key)
        elif isinstance(value, str) and "${" in value:
            if default is not None:  # an interpolated key defaults to None: "follows <target>"
                problems.append(f"{key}: YAML interpolates {value}, the field defaults to {default!r} (want None)")
        elif default != value or (type(default) is bool) != (type(value) is bool):
            problems.append(f"{key}: YAML {value!r}, field default {default!r}")
    return problems


def test_yaml_and_dataclasses_have_the_same_keys_and_defaults() -> None:
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "ppo_trainer.yaml"), resolve=False)
    assert _drift(PPOConfig, raw, "") == []


def test_drift_check_catches_a_changed_default() -> None:
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "ppo_trainer.yaml"), resolve=False)
    raw["actor_rollout_ref"]["rollout"]["max_num_seqs"] = 256
    raw["trainer"]["new_key"] = 1
    del raw["data"]["seed"]
    assert sorted(_drift(PPOConfig, raw, "")) == [
        "actor_rollout_ref.rollout.max_num_seqs: YAML 256, field default 1024",
        "data.seed: a field of DataConfig, not in the YAML",
        "trainer.new_key: in the YAML, not a field of TrainerConfig",
    ]


def _leaves(node: Any, path: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{path}.{key}".lstrip("."))
    else:
        yield path, node


def test_builder_carries_every_composed_value() -> None:
    """Every leaf of the composed (resolved) config reaches the typed object, overrides included."""
    cfg = compose_config(
        ["actor_rollout_ref.rollout.max_num_seqs=7", "data.train_batch_size=16", "critic.optim.betas=[0.5,0.6]"]
    )
    typed = from_config(cfg)
    assert typed.actor_rollout_ref.rollout.max_num_seqs == 7
    assert typed.actor_rollout_ref.actor.train_batch_size == 16  # the interpolation, resolved
    assert typed.critic.optim.betas == [0.5, 0.6] and typed.critic.optim.lr == 1e-5
    checked = 0
    for key, value in _leaves(OmegaConf.to_container(cfg, resolve=True)):
        if any(key == f or key.startswith(f + ".") for f in FREE_FORM):
            continue
        obj = typed
        for part in key.split("."):
            obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
        assert obj == value, key
        checked += 1
    assert checked > 200


def test_errors_name_the_full_key_and_are_collected() -> None:
    cfg = compose_config(
        [
            "actor_rollout_ref.actor.optim.lr=-1",
            "actor_rollout_ref.rollout.val_kwargs.top_p=0",
            "actor_rollout_ref.actor.use_kl_loss=maybe",
            "critic.model.fsdp_config.fsdp_size=0",
        ]
    )
    with pytest.raises(ConfigError) as info:
        from_config(cfg)
    assert sorted(info.value.errors) == [
        "actor_rollout_ref.actor.optim.lr must be > 0 (got -1)",
        "actor_rollout_ref.actor.use_kl_loss must be True or False (got 'maybe')",
        "actor_rollout_ref.rollout.val_kwargs.top_p must be in (0, 1] (got 0)",
        "critic.model.fsdp_config.fsdp_size must be an integer >= 1 or -1 (got 0)",
    ]


def test_a_section_built_alone_validates_in_post_init() -> None:
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.ppo_epochs must be an integer >= 1 \(got 0\)"):
        ActorConfig(ppo_epochs=0)
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.sleep_level must be 1 or 2, got 3"):
        RolloutConfig.from_config({"sleep_level": 3})
    rollout = RolloutConfig.from_config({"top_p": 1, "prompt_length": 10, "response_length": 6})
    assert rollout.top_p == 1.0 and isinstance(rollout.top_p, float) and rollout.engine_max_len == 16


def test_component_settings_take_the_yaml_defaults() -> None:
    """ActorSettings / CriticSettings are the typed sections plus the worker's overlay: one set of defaults."""
    from verl.workers.actor.settings import ActorSettings
    from verl.workers.critic.dp_critic import CriticSettings

    actor = ActorSettings.from_config({"ppo_micro_batch_size_per_gpu": 2})
    for f in dataclasses.fields(ActorConfig):
        if f.name != "ppo_micro_batch_size_per_gpu":
            assert getattr(actor, f.name) == getattr(ActorConfig(), f.name), f.name
    assert actor.ppo_mini_batch_size == 256 and actor.clip_ratio_low == 0.2 and actor.log_prob_micro_batch_size == 2
    critic = CriticSettings.from_config({"ppo_micro_batch_size_per_gpu": 2})
    # null critic keys follow the actor's (the YAML interpolates them): on their own, the actor's defaults
    assert (critic.ppo_mini_batch_size, critic.ppo_epochs, critic.use_dynamic_bsz) == (256, 1, False)
    assert critic.optim.lr == 1e-5 and critic.model.enable_gradient_checkpointing is True


def test_actor_settings_report_a_mistyped_key_instead_of_crashing() -> None:
    """The worker overlay's own checks skip a value of the wrong type: the message names the key (no TypeError)."""
    from verl.workers.actor.settings import ActorSettings

    with pytest.raises(ConfigError) as info:
        ActorSettings.from_config({"ppo_micro_batch_size_per_gpu": "x"})
    assert info.value.errors == [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu must be an integer or null (got 'x')"
    ]
    options = {"ppo_micro_batch_size_per_gpu": 2}
    for chunk in ("big", 0, 2.5):
        with pytest.raises(ConfigError) as info:
            ActorSettings.from_config({**options, "fused_kernel_options": {"chunk_size": chunk}})
        assert info.value.errors == [
            f"actor_rollout_ref.model.fused_kernel_options.chunk_size must be >= 1, got {chunk!r}"
        ]
    assert ActorSettings.from_config({**options, "fused_kernel_options": {"chunk_size": 7}}).fused_chunk_size == 7


def test_rollout_worker_uses_the_yaml_engine_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine gets the YAML's values (the worker once fell back to max_num_seqs=256, tp=1 when a key was
    absent); a partial rollout section takes the same defaults."""
    import verl.workers.rollout.base as rollout_base
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    seen: dict = {}

    def engine(name, **kw):
        seen.update(name=name, **kw)
        return SimpleNamespace(tp_group_ranks=[0, 1])

    monkeypatch.setattr(rollout_base, "get_rollout_engine", engine)
    monkeypatch.setenv("WORLD_SIZE", "2")  # the YAML's tp=2: one engine shared by ranks 0 and 1
    monkeypatch.setenv("RANK", "0")
    partial = OmegaConf.create({"rollout": {"prompt_length": 8, "response_length": 8}})
    for config in (compose_config([]).actor_rollout_ref, partial):
        seen.clear()
        worker = object.__new__(ActorRolloutRefWorker)
        worker.config, worker.model_path, worker.device_name = config, "/m", "cuda"
        worker._init_rollout()
        assert seen["name"] == "vllm" and seen["max_num_seqs"] == 1024 and seen["tensor_parallel_size"] == 2
        assert seen["max_num_batched_tokens"] == 8192 and seen["gpu_memory_utilization"] == 0.5
        assert seen["distributed_executor_backend"] == "external_launcher"
