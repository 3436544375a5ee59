"""``verl.trainer.config_preflight.check_config``: every combination known to fail late is refused at launch, before
any model, tokenizer or Ray loads, with a message naming the key or the file/row/field; all problems in one
``ConfigError``.

Real tiny files in ``tmp_path``: a model folder (``config.json`` only: nothing is loaded), parquet/jsonl data, a
reward-function file, a checkpoint written by ``CheckpointManager`` with a real dataloader state. No Ray, no model.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

import verl.trainer.main_ppo as main_ppo
from verl.trainer.config_preflight import (
    NOT_IMPLEMENTED_ESTIMATORS,
    check_config,
    estimator_error,
    filter_groups_error,
)
from verl.trainer.config_schema import RECURRENT_ADV_ESTIMATORS, ConfigError, validate_config

CONFIG_DIR = str(Path(main_ppo.__file__).parent / "config")


def _model(tmp: Path) -> Path:
    folder = tmp / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return folder


def _row(i: int, source: str = "hotpotqa", truth=("x",)) -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": f"question {i}?"}],
        "context": f"context {i}",
        "reward_model": {"style": "rule", "ground_truth": None if truth is None else list(truth)},
        "extra_info": {"index": i},
    }


def _parquet(tmp: Path, name: str, rows: list[dict]) -> Path:
    path = tmp / f"{name}.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return path


def _cfg(tmp: Path, *extra: str, train=None, val=None):
    """A single-turn GRPO config that passes ``validate_config`` and ``check_config``, plus ``extra`` overrides."""
    train = train or _parquet(tmp, "train", [_row(i) for i in range(4)])
    val = val or _parquet(tmp, "val", [_row(i, "gsm8k") for i in range(2)])
    overrides = [
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.train_batch_size=2",
        f"actor_rollout_ref.model.path={_model(tmp)}",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "algorithm.adv_estimator=grpo",
        "recurrent.enable=null",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp / 'out' / 'ckpt'}",
        *extra,
    ]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def _errors(cfg) -> list[str]:
    with pytest.raises(ConfigError) as info:
        check_config(cfg)
    return info.value.errors


def _one(cfg, *needles: str) -> str:
    """The single error message of ``cfg``, which must contain every needle."""
    errors = _errors(cfg)
    assert len(errors) == 1, errors
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def test_a_valid_config_passes_and_the_folder_probe_leaves_nothing(tmp_path):
    cfg = _cfg(tmp_path)
    validate_config(cfg)
    check_config(cfg)
    assert not (tmp_path / "out").exists()  # the checkpoint folder was created, probed and removed again


# ------------------------------------------------------------------------------------------------ estimators, KL


def test_remax_and_grpo_multiconv_are_refused_in_single_turn_mode(tmp_path):
    _one(_cfg(tmp_path, "algorithm.adv_estimator=remax"), "algorithm.adv_estimator=remax", "greedy baseline")
    _one(
        _cfg(tmp_path, "algorithm.adv_estimator=grpo_multiconv"),
        "algorithm.adv_estimator='grpo_multiconv' is not a single-turn estimator",
        "needs recurrent.enable",
    )


def test_single_turn_estimators_are_refused_in_recurrent_mode(tmp_path):
    cfg = _cfg(tmp_path, "recurrent.enable=memory", "data.truncation=center", "algorithm.adv_estimator=rloo")
    _one(cfg, "algorithm.adv_estimator='rloo' is not a multi-turn estimator")


def test_gae_needs_a_loadable_critic_with_sequence_parallel_size_one(tmp_path):
    missing = tmp_path / "no_critic"
    errors = _errors(
        _cfg(
            tmp_path,
            "algorithm.adv_estimator=gae",
            f"critic.model.path={missing}",
            "critic.ulysses_sequence_parallel_size=2",
        )
    )
    assert errors == [
        "critic.ulysses_sequence_parallel_size must be 1: sequence parallelism is not implemented (got 2)",
        f"critic.model.path={missing} is not a local folder (nothing is downloaded at run time)",
    ]
    # the same critic settings are not read (and not checked) by an estimator without a critic
    check_config(_cfg(tmp_path, f"critic.model.path={missing}", "critic.ulysses_sequence_parallel_size=2"))
    check_config(_cfg(tmp_path, "algorithm.adv_estimator=gae", f"critic.model.path={_model(tmp_path)}"))


def test_ref_sequence_parallel_and_kl_estimators_without_implementation(tmp_path):
    kl = "actor_rollout_ref.actor.use_kl_loss=True"
    _one(
        _cfg(tmp_path, kl, "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2"),
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size must be 1",
        "(got 2)",
    )
    _one(
        _cfg(tmp_path, kl, "actor_rollout_ref.actor.kl_loss_type=full"),
        "actor_rollout_ref.actor.kl_loss_type=full is not implemented",
        "actor_rollout_ref.actor.use_kl_loss=True uses it",
    )
    _one(
        _cfg(tmp_path, kl, "algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=full"),
        "algorithm.kl_penalty=full is not implemented",
    )
    _one(
        _cfg(tmp_path, "algorithm.use_kl_in_reward=True"),
        "algorithm.use_kl_in_reward=True needs the reference model",
        "actor_rollout_ref.actor.use_kl_loss=True",
    )
    # unused: no reference model, no KL term -> nothing fails later, nothing refused now
    check_config(_cfg(tmp_path, "actor_rollout_ref.actor.kl_loss_type=full", "algorithm.kl_penalty=full"))


def test_filter_groups_is_refused_without_recurrent_mode(tmp_path):
    """The single-turn trainer has no DAPO group filter: enabling it would be silently ignored."""
    message = _one(
        _cfg(tmp_path, "algorithm.filter_groups.enable=True"),
        "algorithm.filter_groups.enable=True is only implemented in recurrent mode",
    )
    assert message == filter_groups_error(True, multi_turn=False)
    assert filter_groups_error(True, multi_turn=True) is None and filter_groups_error(False, multi_turn=False) is None
    # in recurrent mode the filter runs: no error about it
    check_config(
        _cfg(tmp_path, "recurrent.enable=memory", "data.truncation=center", "algorithm.filter_groups.enable=True")
    )


def test_the_trainers_refuse_with_the_same_rules():
    from verl.trainer.ppo.ray_trainer import MULTICONV_ESTIMATORS

    assert set(MULTICONV_ESTIMATORS) == set(RECURRENT_ADV_ESTIMATORS)
    assert set(NOT_IMPLEMENTED_ESTIMATORS) == {"remax"}
    assert estimator_error("grpo", multi_turn=False) is None and estimator_error("gae", multi_turn=False) is None
    assert estimator_error("grpo", multi_turn=True) is None and estimator_error("gae", multi_turn=True)


# ------------------------------------------------------------------------------------------------ parallelism, LoRA


def test_tensor_parallel_rollout_is_refused_only_where_it_cannot_run(tmp_path):
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    vllm = ["actor_rollout_ref.rollout.name=vllm", "trainer.n_gpus_per_node=4"]
    # TP groups sharing one engine: allowed when the size divides the ranks and the heads (validate_config owns
    # the rank rule, check_config the heads and the mode)
    check_config(_cfg(tmp_path, *vllm, f"{key}=2"))
    check_config(_cfg(tmp_path, *vllm, f"{key}=4"))
    check_config(_cfg(tmp_path, "actor_rollout_ref.rollout.name=vllm", f"{key}=1"))
    check_config(_cfg(tmp_path, f"{key}=2"))  # the HF engine runs one process per rank and ignores TP
    with pytest.raises(ConfigError) as refused:
        validate_config(_cfg(tmp_path, *vllm, f"{key}=3"))
    assert any(f"{key} (3) must divide trainer.nnodes x trainer.n_gpus_per_node (4)" in e for e in refused.value.errors)
    _one(
        _cfg(tmp_path, *vllm, f"{key}=2", "actor_rollout_ref.rollout.mode=async"),
        f"{key}=2 with actor_rollout_ref.rollout.mode=async",
        "identical batches",
        f"set {key}=1 or actor_rollout_ref.rollout.mode=sync",
    )
    # one-step-off training runs a rank's generation and its update in two threads: vLLM's TP collectives and
    # FSDP's would meet in no agreed order; one engine per rank (TP=1, or the HF engine) overlaps
    _one(
        _cfg(tmp_path, *vllm, f"{key}=2", "trainer.rollout_overlap=True"),
        f"trainer.rollout_overlap=True with {key}=2",
        "deadlock",
        f"set {key}=1 (one engine per rank) or trainer.rollout_overlap=False",
    )
    check_config(_cfg(tmp_path, *vllm, f"{key}=1", "trainer.rollout_overlap=True"))
    check_config(_cfg(tmp_path, f"{key}=2", "trainer.rollout_overlap=True"))
    model = _model(tmp_path)

    def heads(tp: int, **config) -> ConfigError | None:
        cfg = _cfg(tmp_path, *vllm, f"{key}={tp}")  # (writes a config.json without heads)
        (model / "config.json").write_text(json.dumps({"model_type": "qwen2", **config}))
        try:
            check_config(cfg)
        except ConfigError as err:
            return err
        return None

    assert heads(4, num_attention_heads=6).errors == [
        f"{key}=4 must divide the model's num_attention_heads (6, {model}/config.json)"
    ]
    assert heads(2, num_attention_heads=6) is None  # 3 query and 3 key/value heads per rank
    assert heads(2, num_attention_heads=12, num_key_value_heads=3).errors == [
        f"{key}=2 and the model's num_key_value_heads (3, {model}/config.json): one must divide the other for vLLM "
        "to split or replicate the key/value heads"
    ]
    assert heads(4, num_attention_heads=8, num_key_value_heads=2) is None  # each key/value head on 2 ranks
    assert heads(2, text_config={"num_attention_heads": 3}).errors[0].startswith(f"{key}=2 must divide")


def test_lora_passes_the_launch_checks(tmp_path):
    # LoRA trains end to end (merged weight sync, tests/test_lora.py): no longer refused at launch
    check_config(_cfg(tmp_path, "actor_rollout_ref.model.lora_rank=8"))


# ------------------------------------------------------------------------------------------------ paths


def test_model_path_missing_empty_or_not_a_model_folder(tmp_path):
    missing = tmp_path / "nope"
    _one(_cfg(tmp_path, f"actor_rollout_ref.model.path={missing}"), f"actor_rollout_ref.model.path={missing}")
    _one(_cfg(tmp_path, "actor_rollout_ref.model.path=''"), "actor_rollout_ref.model.path is empty")
    (tmp_path / "bare").mkdir()
    _one(_cfg(tmp_path, f"actor_rollout_ref.model.path={tmp_path / 'bare'}"), "has no config.json")


def test_checkpoint_folder_must_be_creatable_and_writable(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    _one(
        _cfg(tmp_path, f"trainer.default_local_dir={blocker / 'ckpt'}"),
        f"trainer.default_local_dir={blocker / 'ckpt'} is not a writable folder",
    )
    existing = tmp_path / "existing"
    existing.mkdir()
    check_config(_cfg(tmp_path, f"trainer.default_local_dir={existing}", f"trainer.log_dir={existing / 'logs'}"))
    assert sorted(os.listdir(existing)) == []  # the probe file is gone
    _one(
        _cfg(tmp_path, f"trainer.default_local_dir={existing}", f"trainer.log_dir={blocker / 'logs'}"),
        "trainer.log_dir=",
        "is not a writable folder",
    )


def test_custom_reward_function_must_import_and_be_callable(tmp_path):
    missing = tmp_path / "nope.py"
    _one(_cfg(tmp_path, f"custom_reward_function.path={missing}"), f"custom_reward_function.path={missing}")
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    _one(_cfg(tmp_path, f"custom_reward_function.path={broken}"), "cannot be imported", "SyntaxError")
    good = tmp_path / "reward.py"
    good.write_text(
        "THRESHOLD = 0.5\n\ndef my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    _one(
        _cfg(tmp_path, f"custom_reward_function.path={good}", "custom_reward_function.name=other"),
        "custom_reward_function.name='other' is not defined in",
    )
    _one(
        _cfg(tmp_path, f"custom_reward_function.path={good}", "custom_reward_function.name=THRESHOLD"),
        "custom_reward_function.name='THRESHOLD'",
        "is not callable",
    )
    check_config(_cfg(tmp_path, f"custom_reward_function.path={good}", "custom_reward_function.name=my_score"))


# ------------------------------------------------------------------------------------------------ data rows


def test_null_ground_truth_and_unknown_data_source_name_file_row_and_field(tmp_path):
    rows = [_row(0), _row(1, truth=None), _row(2), _row(3, truth=None)]
    train = _parquet(tmp_path, "train_bad", rows)
    val = _parquet(tmp_path, "val_bad", [_row(0, "gsm8k"), _row(1, "gsm8k"), _row(2, "mystery_set")])
    errors = _errors(_cfg(tmp_path, train=train, val=val))
    assert len(errors) == 2, errors
    assert errors[0].startswith(f"{train} rows 1, 3 (data.train_files): field reward_model.ground_truth is null")
    assert errors[1].startswith(f"{val} row 2 (data.val_files): field data_source='mystery_set' has no reward scorer")
    assert "hotpotqa" in errors[1]  # the known prefixes are listed
    # a custom reward function scores any data_source; a null ground truth is still refused
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    errors = _errors(_cfg(tmp_path, f"custom_reward_function.path={reward}", train=train, val=val))
    assert len(errors) == 1 and "rows 1, 3 (data.train_files): field reward_model.ground_truth" in errors[0]


def test_missing_reward_column_missing_file_and_jsonl_rows(tmp_path):
    no_reward = _parquet(
        tmp_path, "no_reward", [{k: v for k, v in _row(i).items() if k != "reward_model"} for i in range(2)]
    )
    _one(_cfg(tmp_path, train=no_reward), f"{no_reward}: missing column 'reward_model' (data.train_files)")
    missing = tmp_path / "missing.parquet"
    _one(_cfg(tmp_path, train=missing), f"data.train_files: data file not found: {missing}")
    jsonl = tmp_path / "val.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [_row(0), _row(1, "ruler_qa", truth=None)]) + "\n")
    _one(_cfg(tmp_path, val=jsonl), f"{jsonl} row 1 (data.val_files): field reward_model.ground_truth is null")
    many = _parquet(tmp_path, "many", [_row(i, truth=None) for i in range(8)])
    _one(_cfg(tmp_path, train=many), "rows 0, 1, 2, 3, 4 and 3 more (data.train_files)")


# ------------------------------------------------------------------------------------------------ resume


def _checkpoint(root: Path, step: int, batch_size: int, rows: int) -> Path:
    """A checkpoint folder as ``fit._save`` writes it (trainer_state.pkl with the real dataloader state)."""
    from verl.utils.checkpoint import CheckpointManager
    from verl.utils.dataset.sampler import train_dataloader

    loader = train_dataloader(list(range(rows)), {"train_batch_size": batch_size, "shuffle": True, "seed": 1})
    next(iter(loader))

    def write(tmp_dir: str) -> None:
        with open(os.path.join(tmp_dir, "trainer_state.pkl"), "wb") as f:
            pickle.dump({"global_step": step, "dataloader": loader.state_dict(), "rng": {}}, f)

    return Path(CheckpointManager(root, fsync=False).save(step, write))


def test_resume_with_another_batch_size_names_both_values(tmp_path):
    root = tmp_path / "runs"
    ckpt = _checkpoint(root, 1, batch_size=4, rows=4)
    message = _one(
        _cfg(tmp_path, f"trainer.default_local_dir={root}"),
        "data.train_batch_size is 2",
        f"the checkpoint {ckpt}",
        "written with 4",
        "trainer.resume_mode=disable",
    )
    assert "trainer.resume_mode=auto" in message
    check_config(_cfg(tmp_path, f"trainer.default_local_dir={root}", "data.train_batch_size=4"))
    check_config(_cfg(tmp_path, f"trainer.default_local_dir={root}", "trainer.resume_mode=disable"))
    # more training rows than when the checkpoint was written: the saved position would point elsewhere
    train = _parquet(tmp_path, "train6", [_row(i) for i in range(6)])
    _one(
        _cfg(tmp_path, f"trainer.default_local_dir={root}", "data.train_batch_size=4", train=train),
        "the number of rows of data.train_files is 6",
        "written with 4",
    )
    bogus = tmp_path / "nowhere"
    _one(
        _cfg(tmp_path, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={bogus}"),
        f"trainer.resume_from_path={bogus}",
        "does not exist",
    )


# ------------------------------------------------------------------------------------------------ at launch


def test_every_problem_in_one_error(tmp_path):
    errors = _errors(
        _cfg(
            tmp_path,
            "algorithm.adv_estimator=remax",
            f"actor_rollout_ref.model.path={tmp_path / 'none'}",
            f"custom_reward_function.path={tmp_path / 'none.py'}",
            train=_parquet(tmp_path, "t", [_row(0, truth=None), _row(1)]),
        )
    )
    keys = [
        "algorithm.adv_estimator=remax",
        "actor_rollout_ref.model.path=",
        "custom_reward_function.path=",
        "row 0 (data.train_files)",
    ]
    assert len(errors) == len(keys)
    for key in keys:
        assert any(key in e for e in errors), (key, errors)


def test_main_ppo_run_fails_at_launch_before_tokenizer_model_or_ray(tmp_path, monkeypatch):
    import ray

    import verl.utils.model_loading as model_loading

    def must_not_run(*args, **kwargs):
        raise AssertionError("loaded before the launch checks refused the config")

    ray_was_up = ray.is_initialized()  # the session's shared test cluster may be running
    monkeypatch.setattr(model_loading, "load_tokenizer", must_not_run)
    monkeypatch.setattr(model_loading, "load_causal_lm", must_not_run)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # any start of Ray reaches ray.init
    monkeypatch.setattr(ray, "init", must_not_run)
    missing = tmp_path / "no_model"
    # force_ray_workers: a layout that needs Ray (one in-process CPU rank alone runs without it)
    cfg = _cfg(
        tmp_path,
        f"actor_rollout_ref.model.path={missing}",
        "algorithm.adv_estimator=remax",
        "trainer.force_ray_workers=True",
    )
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        main_ppo.run(cfg)
    assert time.monotonic() - start < 20
    assert len(info.value.errors) == 2
    assert f"actor_rollout_ref.model.path={missing} is not a local folder" in str(info.value)
    assert "algorithm.adv_estimator=remax" in str(info.value)
    monkeypatch.undo()
    assert ray.is_initialized() == ray_was_up


def test_single_turn_trainer_raises_the_launch_check_message(tmp_path):
    from verl.trainer.ppo.single_turn import SingleTurnPPOTrainer

    tok = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 1})()
    cfg = _cfg(tmp_path, "algorithm.adv_estimator=remax")
    with pytest.raises(NotImplementedError) as info:
        SingleTurnPPOTrainer(cfg, tok, None, None, None, None, None)
    assert str(info.value) == estimator_error("remax", multi_turn=False)
    with pytest.raises(ValueError) as info:
        SingleTurnPPOTrainer(_cfg(tmp_path, "algorithm.filter_groups.enable=True"), tok, None, None, None, None, None)
    assert str(info.value) == filter_groups_error(True, multi_turn=False)


def test_tis_without_the_engines_log_probs_is_refused_at_launch(tmp_path):
    """The launch check runs ``rollout_log_prob_errors`` (its cases: tests/test_calculate_log_probs.py)."""
    off = "actor_rollout_ref.rollout.calculate_log_probs=False"
    _one(_cfg(tmp_path, off, "algorithm.rollout_is=True"), f"{off} with algorithm.rollout_is=True")
    check_config(_cfg(tmp_path, off))
