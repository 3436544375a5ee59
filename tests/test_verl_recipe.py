"""A recipe written for upstream verl 0.9 runs here unmodified (issue: drop-in verl).

* ``compute_advantage`` (upstream's ``ray_trainer.compute_advantage``) calls every registered estimator with
  upstream's keyword inputs; the built-ins give what their direct calls give;
* a recipe's module is imported from ``algorithm.adv_estimator_module`` (or ``VERL_USE_EXTERNAL_MODULES``) once,
  even when it is also the ``custom_reward_function`` file; its estimator names then validate;
* the recipe of ``tests/fixtures/verl_style_recipe.py`` (estimator + reward function + DataProto manipulations)
  trains the single-turn trainer on a tiny model: its estimator runs every step, its advantages are what the actor
  optimises, its rewards are the logged scores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.fixtures import verl_style_recipe as recipe
from tests.test_config import compose_config
from verl import DataProto
from verl.trainer.config_schema import ConfigError, validate_config
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import compute_advantage  # upstream's import path
from verl.utils.import_utils import import_external_libs, load_module

RECIPE = Path(recipe.__file__).resolve()
REPO = Path(__file__).resolve().parents[1]


def _batch(rewards, mask, uid, **tensors) -> DataProto:
    tensors = {"token_level_rewards": torch.tensor(rewards), "response_mask": torch.tensor(mask), **tensors}
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": np.array(uid, dtype=object)})


# ----------------------------------------------------------------------------------------------------------
# the estimator call
# ----------------------------------------------------------------------------------------------------------


def test_recipe_estimator_gives_the_hand_computed_advantages():
    # weight 0.25 from the config; group a: scores [1, 0.25] -> baseline 0.25 * 0.625 = 0.15625;
    # group b: scores [0.5, 0] -> baseline 0.25 * 0.25 = 0.0625
    data = _batch(
        [[0.0, 1.0, 0.0], [0.0, 0.0, 0.5], [0.25, 0.0, 0.0], [0.0, 0.0, 0.0]],
        [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]],
        ["a", "b", "a", "b"],
    )
    config = OmegaConf.create({"adv_estimator": "recipe_partial_baseline", "recipe_baseline_weight": 0.25})
    out = compute_advantage(data, "recipe_partial_baseline", config=config)
    want = torch.tensor([[0.84375, 0.84375, 0], [0.4375, 0.4375, 0.4375], [0.09375, 0, 0], [-0.0625, -0.0625, -0.0625]])
    torch.testing.assert_close(out.batch["advantages"], want)
    torch.testing.assert_close(out.batch["returns"], want)
    # upstream's inputs: rewards, mask, index (uid) and config, plus norm_adv_by_std_in_grpo
    assert recipe.CALLS[-1]["extra_inputs"] == ["norm_adv_by_std_in_grpo"]
    assert recipe.CALLS[-1]["weight"] == 0.25 and recipe.CALLS[-1]["index"] == ["a", "b", "a", "b"]


def test_adv_estimator_module_reaches_the_single_turn_trainer(tiny_model_path, tmp_path):
    """The trainer imports the module itself (also when built without validate_config) and calls its estimator."""
    from tests.test_config_consumed_run import single_turn_trainer

    path = tmp_path / "trainer_estimator.py"
    path.write_text(
        "from verl.trainer.ppo.core_algos import register_adv_est\n"
        "@register_adv_est('trainer_tmp_estimator')\n"
        "def doubled(token_level_rewards, response_mask, index, config=None):\n"
        "    return 2 * token_level_rewards * response_mask, token_level_rewards\n"
    )
    trainer = single_turn_trainer(
        tiny_model_path, "algorithm.adv_estimator=trainer_tmp_estimator", f"algorithm.adv_estimator_module={path}"
    )
    batch = _batch([[0.0, 1.0], [0.0, 0.5]], [[1, 1], [1, 0]], ["a", "a"])
    trainer._compute_advantages(batch)
    assert batch.batch["advantages"].tolist() == [[0.0, 2.0], [0.0, 0.0]]
    assert batch.batch["returns"].tolist() == [[0.0, 1.0], [0.0, 0.5]]


def test_builtin_estimators_through_compute_advantage_equal_their_direct_calls():
    rewards = [[0.0, 0.0, 1.0], [0.0, 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 2.0, 0.0]]
    mask = [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]
    uid = ["a", "a", "b", "b"]
    r, m = torch.tensor(rewards), torch.tensor(mask)
    algo = OmegaConf.create({"gamma": 0.5, "lam": 0.9, "norm_adv_by_std_in_grpo": False})

    def advantages(name, **kwargs):
        data = compute_advantage(_batch(rewards, mask, uid), name, config=algo, **kwargs)
        return data.batch["advantages"]

    grpo = core_algos.compute_grpo_outcome_advantage
    torch.testing.assert_close(advantages("grpo", norm_adv_by_std_in_grpo=False), grpo(r, m, uid, 1e-6, False)[0])
    torch.testing.assert_close(advantages("grpo"), grpo(r, m, uid)[0])
    torch.testing.assert_close(advantages("rloo"), core_algos.compute_rloo_outcome_advantage(r, m, uid)[0])
    # upstream's other outcome estimators; grpo_passk reads norm_adv_by_std_in_grpo from the config (False)
    passk = core_algos.compute_grpo_passk_outcome_advantage(r, m, uid, norm_adv_by_std_in_grpo=False)[0]
    torch.testing.assert_close(advantages("grpo_passk", norm_adv_by_std_in_grpo=True), passk)
    for name in ("reinforce_plus_plus_baseline", "opo", "gpg"):
        torch.testing.assert_close(advantages(name), core_algos.get_adv_estimator_fn(name)(r, m, uid)[0])
    # REINFORCE++ reads gamma from the algorithm config (0.5), not from compute_advantage's gamma default (1.0)
    rpp = core_algos.compute_reinforce_plus_plus_outcome_advantage(r, m, gamma=0.5)[0]
    torch.testing.assert_close(advantages("reinforce_plus_plus"), rpp)
    # GAE gets values from the batch and gamma/lam from the call
    values = torch.tensor([[0.1, 0.2, 0.3], [0.0, -0.1, 0.0], [0.5, 0.0, 0.0], [0.2, 0.2, 0.2]])
    data = compute_advantage(_batch(rewards, mask, uid, values=values), "gae", gamma=0.5, lam=0.9, config=algo)
    gae = core_algos.compute_gae_advantage_return(r, values, m, 0.5, 0.9)
    torch.testing.assert_close(data.batch["advantages"], gae[0])
    torch.testing.assert_close(data.batch["returns"], gae[1])
    # ReMax takes reward_baselines when the batch has them
    baselines = torch.tensor([0.5, 0.0, 1.0, 0.0])
    data = compute_advantage(_batch(rewards, mask, uid, reward_baselines=baselines), "remax", config=algo)
    torch.testing.assert_close(data.batch["advantages"], core_algos.compute_remax_outcome_advantage(r, baselines, m)[0])


def test_apply_kl_penalty_and_compute_rewards_as_upstream():
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty

    data = DataProto.from_dict(
        tensors={
            "token_level_scores": torch.tensor([[0.0, 1.0], [0.0, 0.5]]),
            "old_log_probs": torch.tensor([[-1.0, -2.0], [-1.0, -1.0]]),
            "ref_log_prob": torch.tensor([[-1.5, -2.0], [-1.0, -3.0]]),
            "response_mask": torch.tensor([[1, 1], [1, 0]]),
        }
    )
    ctrl = core_algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=10)
    data, metrics = apply_kl_penalty(data, ctrl, kl_penalty="kl")
    # KL = old - ref = [[0.5, 0], [0, 2 (masked)]]; rewards = scores - 0.1 * KL
    torch.testing.assert_close(data.batch["token_level_rewards"], torch.tensor([[-0.05, 1.0], [0.0, 0.5]]))
    # mean over rows of the per-row token mean: (0.25 + 0) / 2
    assert metrics == {"actor/reward_kl_penalty": pytest.approx(0.125), "actor/reward_kl_penalty_coeff": 0.1}
    # the controller moved: error clip(0.125 / 0.1 - 1, +-0.2) = 0.2, times 2 rows / horizon 10
    assert ctrl.value == pytest.approx(0.1 * 1.04)
    rewards = core_algos.compute_rewards(
        data.batch["token_level_scores"], data.batch["old_log_probs"], data.batch["ref_log_prob"], 0.5
    )
    torch.testing.assert_close(rewards, torch.tensor([[-0.25, 1.0], [0.0, -0.5]]))


def test_response_mask_comes_from_the_attention_mask_when_absent():
    attention = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    data = DataProto.from_dict(
        tensors={
            "token_level_rewards": torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]),
            "responses": torch.zeros(2, 3, dtype=torch.long),
            "attention_mask": attention,
        },
        non_tensors={"uid": np.array(["a", "a"], dtype=object)},
    )
    compute_advantage(data, "grpo", config=OmegaConf.create({}))
    assert data.batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    # group scores [1, 0]: mean 0.5, std 0.7071 -> +-0.7071 on the response tokens
    assert data.batch["advantages"][0].tolist() == pytest.approx([0.70710, 0.70710, 0.0], abs=1e-4)


def test_estimator_errors_name_what_is_wrong():
    data = _batch([[1.0, 0.0]], [[1, 1]], ["a"])
    with pytest.raises(TypeError, match=r"needs \['values'\]"):
        compute_advantage(data, "gae", config=OmegaConf.create({}))
    with pytest.raises(TypeError, match=r"needs \['reward_baselines'\]"):
        compute_advantage(data, "remax", config=OmegaConf.create({}))
    with pytest.raises(ValueError, match="unknown adv_estimator 'nope'"):
        compute_advantage(data, "nope")

    def wrong_shape(token_level_rewards, response_mask, **kwargs):
        return token_level_rewards.sum(-1), token_level_rewards

    with pytest.raises(TypeError, match=r"wrong_shape returned advantages of shape \(1,\); expected \(1, 2\)"):
        core_algos.call_adv_estimator(wrong_shape, token_level_rewards=torch.ones(1, 2), response_mask=torch.ones(1, 2))


# ----------------------------------------------------------------------------------------------------------
# importing a recipe's module
# ----------------------------------------------------------------------------------------------------------


def test_a_recipe_file_loads_once_by_path_file_url_or_dotted_name(tmp_path):
    assert load_module(str(RECIPE)) is recipe  # already imported as tests.fixtures.verl_style_recipe
    assert load_module(f"file://{RECIPE}") is recipe
    assert import_external_libs(["tests.fixtures.verl_style_recipe", f"pkg://{recipe.__name__}"]) == [recipe, recipe]
    assert core_algos.get_adv_estimator_fn("recipe_partial_baseline") is recipe.compute_partial_baseline_advantage
    # a fresh file: executed on the first load only, so its registration does not collide with itself
    path = tmp_path / "fresh_estimator.py"
    path.write_text(
        "from verl.trainer.ppo.core_algos import register_adv_est\nLOADS = []\nLOADS.append(1)\n"
        "@register_adv_est('fresh_tmp_estimator')\ndef fresh(token_level_rewards, response_mask, **kwargs):\n"
        "    return token_level_rewards, token_level_rewards\n"
    )
    first = load_module(str(path))
    assert load_module(str(path)) is first and first.LOADS == [1]
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_module(str(tmp_path / "missing.py"))


def _small_config(*extra: str):
    return compose_config(
        [
            "actor_rollout_ref.rollout.name=hf",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "recurrent.enable=null",
            "trainer.n_gpus_per_node=1",
            "trainer.device=cpu",
            *extra,
        ]
    )


def test_adv_estimator_module_registers_names_before_validation(tmp_path):
    path = tmp_path / "late_estimator.py"
    path.write_text(
        "from verl.trainer.ppo.core_algos import register_adv_est\n"
        "@register_adv_est('late_tmp_estimator')\ndef late(token_level_rewards, response_mask, **kwargs):\n"
        "    return token_level_rewards, token_level_rewards\n"
    )
    with pytest.raises(ConfigError) as err:
        validate_config(_small_config("algorithm.adv_estimator=late_tmp_estimator"))
    assert "algorithm.adv_estimator must be one of [" in str(err.value)
    assert "(got 'late_tmp_estimator'); an estimator of your own" in str(err.value)
    assert "algorithm.adv_estimator_module" in str(err.value)
    validate_config(
        _small_config("algorithm.adv_estimator=late_tmp_estimator", f"algorithm.adv_estimator_module={path}")
    )
    assert "late_tmp_estimator" in core_algos.ADV_ESTIMATORS


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.adv_estimator=grpo", "algorithm.adv_estimator_module=no_such_recipe_module"],
            "algorithm.adv_estimator_module='no_such_recipe_module' could not be imported: ModuleNotFoundError",
        ),
        (
            ["algorithm.adv_estimator=grpo", "algorithm.adv_estimator_module=/nonexistent/recipe.py"],
            "algorithm.adv_estimator_module='/nonexistent/recipe.py' could not be imported: FileNotFoundError",
        ),
        (
            ["algorithm.adv_estimator=grpo", "algorithm.adv_estimator_module=5"],
            "algorithm.adv_estimator_module must be a module name, a .py file path, a list of them, or null (got 5)",
        ),
    ],
)
def test_bad_estimator_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate_config(_small_config(*overrides))
    assert message in str(err.value)


def test_registered_estimators_run_in_single_turn_mode_except_remax_and_grpo_multiconv():
    from verl.trainer.config_preflight import estimator_error

    for name in ("recipe_partial_baseline", "grpo_passk", "opo", "gpg", "reinforce_plus_plus_baseline", "gae"):
        assert estimator_error(name, multi_turn=False) is None, name
    assert "greedy baseline rollout" in estimator_error("remax", multi_turn=False)
    assert "'grpo_multiconv' is not a single-turn estimator" in estimator_error("grpo_multiconv", multi_turn=False)
    # recurrent mode keeps its trajectory-level estimators only
    assert "is not a multi-turn estimator" in estimator_error("recipe_partial_baseline", multi_turn=True)


def test_verl_use_external_modules_imports_a_recipe_with_import_verl():
    code = (
        "import verl\nfrom verl.trainer.ppo.core_algos import ADV_ESTIMATORS\n"
        "print('recipe_partial_baseline' in ADV_ESTIMATORS)"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": f" {RECIPE} ", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


# ----------------------------------------------------------------------------------------------------------
# the recipe trains the single-turn trainer
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recipe_run(tiny_model_path, tmp_path_factory):
    """2 steps of 2 prompts x 2 responses, one mini-batch per step, with the recipe's estimator and reward (in the
    test's process: the recipe records its calls)."""
    from tests.test_critic import _cfg
    from verl.trainer import main_ppo

    tmp = tmp_path_factory.mktemp("recipe")
    recipe.CALLS.clear()
    recipe.SCORES.clear()
    cfg = _cfg(
        tmp,
        tiny_model_path,
        str(tmp / "out"),
        2,
        "recipe_partial_baseline",
        extra=[
            f"algorithm.adv_estimator_module={RECIPE}",
            f"custom_reward_function.path={RECIPE}",  # the same file: loaded once
            "custom_reward_function.name=compute_score",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "trainer.save_freq=-1",
        ],
    )
    history = main_ppo.run(cfg)
    return {"steps": {h["step"]: h for h in history if h["step"] > 0}, "calls": list(recipe.CALLS)}


def _expected_advantages(call: dict) -> torch.Tensor:
    """The recipe's rule, recomputed by hand: A_i = s_i - 0.5 * mean of the scores of row i's group."""
    scores = call["rewards"].sum(-1).tolist()
    groups: dict[str, list[float]] = {}
    for uid, score in zip(call["index"], scores):
        groups.setdefault(uid, []).append(score)
    rows = [s - 0.5 * sum(groups[u]) / len(groups[u]) for u, s in zip(call["index"], scores)]
    return torch.tensor(rows).unsqueeze(-1) * call["response_mask"].float()


@pytest.mark.slow
def test_recipe_estimator_runs_every_step_with_upstream_inputs(recipe_run):
    calls = recipe_run["calls"]
    assert sorted(recipe_run["steps"]) == [1, 2]
    assert len(calls) == 2  # one call per training step, none elsewhere
    for call in calls:
        assert call["rewards"].shape[0] == 4 and call["weight"] == 0.5  # the recipe's default
        assert call["config_estimator"] == "recipe_partial_baseline"  # config is the algorithm section
        assert call["extra_inputs"] == ["norm_adv_by_std_in_grpo"]
        # 2 prompts x rollout.n=2: two uids, each on two rows
        assert sorted(call["index"].count(u) for u in set(call["index"])) == [2, 2]
        torch.testing.assert_close(call["advantages"], _expected_advantages(call))


@pytest.mark.slow
def test_recipe_rewards_are_the_logged_scores(recipe_run):
    steps, calls = recipe_run["steps"], recipe_run["calls"]
    scores = recipe.SCORES
    assert len(scores) == 8  # 4 responses per step, no validation (test_freq=-1)
    assert all(0.0 <= s <= 1.0 for s in scores) and len(set(scores)) > 1
    for step, call in zip((1, 2), calls):
        mine = scores[4 * (step - 1) : 4 * step]
        # the reward function's values are the estimator's input (on the last response token) and the metrics
        assert call["rewards"].sum(-1).tolist() == pytest.approx(mine, abs=1e-6)
        assert steps[step]["critic/score/mean"] == pytest.approx(sum(mine) / 4, abs=1e-6)
        assert steps[step]["critic/score/max"] == pytest.approx(max(mine), abs=1e-6)
        assert steps[step]["critic/score/min"] == pytest.approx(min(mine), abs=1e-6)


@pytest.mark.slow
def test_recipe_advantages_are_what_the_actor_optimises(recipe_run):
    steps, calls = recipe_run["steps"], recipe_run["calls"]
    for step, call in zip((1, 2), calls):
        adv, mask = call["advantages"], call["response_mask"].bool()
        token_mean = float(adv[mask].mean())
        assert steps[step]["critic/advantages/mean"] == pytest.approx(token_mean, abs=1e-6)
        assert steps[step]["critic/advantages/max"] == pytest.approx(float(adv[mask].max()), abs=1e-6)
        # one mini-batch per step, updated once from the rollout's weights: ratio = 1, so the token-mean PPO loss
        # is -mean(A) over the response tokens (GRPO's advantages would give another value: their mean is ~0 here)
        assert steps[step]["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
        assert abs(token_mean) > 1e-3
        assert steps[step]["actor/pg_loss"] == pytest.approx(-token_mean, rel=1e-4, abs=1e-6)


# ----------------------------------------------------------------------------------------------------------
# upstream's DataProto helpers (verl/protocol_ops.py, verl/utils/py_functional.py)
# ----------------------------------------------------------------------------------------------------------


def test_fold_unfold_and_dict_unions_as_upstream():
    from verl.protocol import fold_batch_dim, unfold_batch_dim, union_numpy_dict
    from verl.utils.py_functional import append_to_dict, union_two_dict

    data = DataProto.from_dict(
        tensors={"x": torch.arange(12).reshape(6, 2)},
        non_tensors={"uid": np.array(list("aabbcc"), dtype=object)},
        meta_info={"t": 1},
    )
    folded = fold_batch_dim(data, 2)
    assert len(folded) == 2 and folded.batch["x"].shape == (2, 3, 2)
    assert folded.batch["x"][1, 0].tolist() == [6, 7] and folded.non_tensor_batch["uid"][1].tolist() == list("bcc")
    back = unfold_batch_dim(folded, batch_dims=2)
    assert torch.equal(back.batch["x"], data.batch["x"]) and back.non_tensor_batch["uid"].tolist() == list("aabbcc")
    assert back.meta_info == {"t": 1}
    with pytest.raises(ValueError, match="6 rows cannot be folded into 4"):
        fold_batch_dim(data, 4)

    nan = np.array([1.0, np.nan])
    merged = union_numpy_dict({"a": nan, "o": np.array([{"k": 1}], dtype=object)}, {"a": nan.copy(), "b": nan})
    assert sorted(merged) == ["a", "b", "o"]
    with pytest.raises(ValueError, match="'a' differs"):
        union_numpy_dict({"a": nan}, {"a": np.array([1.0, 2.0])})
    assert union_two_dict({"a": 1}, {"a": 1, "b": 2}) == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match="'a' differs"):
        union_two_dict({"a": 1}, {"a": 2})
    # the same equality as DataProto's meta_info: tensors by value, arrays NaN-aware
    both = union_two_dict({"t": torch.ones(2), "n": nan}, {"t": torch.ones(2), "n": nan.copy(), "c": 3})
    assert sorted(both) == ["c", "n", "t"] and both["c"] == 3
    with pytest.raises(ValueError, match="'t' differs"):
        union_two_dict({"t": torch.ones(2)}, {"t": torch.zeros(2)})
    log: dict = {}
    append_to_dict(log, {"loss": 1.0})
    append_to_dict(log, {"loss": 0.5, "kl": 0.1})
    assert log == {"loss": [1.0, 0.5], "kl": [0.1]}


def test_torch_functional_data_helpers_as_upstream(tiny_model_path):
    from transformers import AutoTokenizer

    from verl.utils import torch_functional as F
    from verl.utils.model import compute_position_id_with_mask

    ids, mask = torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 1]])
    padded = F.postprocess_data(ids, mask, 5, pad_token_id=0, left_pad=True)
    assert padded[0].tolist() == [[0, 0, 5, 6, 7]] and padded[1].tolist() == [[0, 0, 1, 1, 1]]
    assert F.postprocess_data(ids, mask, 2, 0, truncation="left")[0].tolist() == [[6, 7]]
    assert F.postprocess_data(ids, mask, 2, 0, truncation="right")[0].tolist() == [[5, 6]]
    with pytest.raises(ValueError, match="sequence length 3 is larger than max_length 2"):
        F.postprocess_data(ids, mask, 2, 0)
    assert F.remove_pad_token(padded[0], padded[1]) == [[5, 6, 7]]
    assert compute_position_id_with_mask(padded[1]).tolist() == [[0, 0, 0, 1, 2]]
    indices, cu_seqlens, longest = F.get_unpad_data(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert indices.tolist() == [1, 2, 3, 4, 5] and cu_seqlens.tolist() == [0, 2, 5] and longest == 3
    # the logits at position t score token t + 1
    logits = torch.log_softmax(torch.randn(1, 3, 8), dim=-1)
    tokens = torch.tensor([[1, 4, 2]])
    want = torch.stack([logits[0, 0, 4], logits[0, 1, 2]]).unsqueeze(0)
    torch.testing.assert_close(F.log_probs_from_logits_response(tokens, logits, 2), want)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    text_ids, text_mask = F.tokenize_and_postprocess_data("hello world", tokenizer, 16, tokenizer.pad_token_id)
    plain = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    assert text_ids.shape == (1, 16) and text_ids[0, -len(plain) :].tolist() == plain
    assert int(text_mask.sum()) == len(plain)
