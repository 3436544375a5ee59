"""Tests of the critic (value model) and of the single-turn PPO/GAE trainer path (CPU, float32, tiny Qwen2).

What is checked:
* ``compute_values`` equals a plain padded forward of the value model at the response positions (the position
  before each response token), with and without remove-padding and dynamic micro-batches; with remove-padding the
  packed layout is planned from host copies of the masks (no packing of device tensors);
* one ``update_critic`` on a hand-made batch: the first micro-batch's loss term and the first mini-batch's
  ``critic/vf_loss`` equal the clipped value loss computed here by hand (normalised by the mini-batch's token
  count, clipping active on some tokens), and the value error on the batch goes down;
* the loss, the metrics and the updated parameters do not depend on the micro-batch split (1 row, 3 rows,
  token budgets, packed rows);
* ``main_ppo.run`` single-turn PPO with ``adv_estimator=gae`` for 2 steps (finite metrics, ``critic/vf_loss``
  logged, the critic checkpoint's parameters differ from the initial value model), resumed to step 3 (the
  critic checkpoint loads), and step 1 on 2 Ray ranks (actor + critic groups sharing one pool) equal to one
  process; ``critic_warmup`` skips the actor; ``grpo`` for 1 step without a critic; ``rloo`` with KL-in-reward;
  clear errors for ``remax``, KL-in-reward without a reference model, and ``gae`` without a critic group;
* (GPU only) the gae path on CUDA with FSDP2/NCCL, bf16 compute and packed rows.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

import verl.trainer.main_ppo as main_ppo
from recurrent.utils import build_conversation_batch
from verl.protocol import DataProto
from verl.workers.critic import DataParallelPPOCritic
from verl.workers.critic.critic_worker import load_value_model

CONFIG_DIR = str(Path(main_ppo.__file__).parent / "config")
PARITY_REWARD = Path(__file__).parent / "fixtures" / "parity_reward.py"
CLIP = 0.2


@pytest.fixture(scope="module")
def value_model(tiny_model_path):
    torch.manual_seed(0)
    return load_value_model(tiny_model_path, dtype="float32", attn_implementation="sdpa")


def make_batch(num_rows: int = 5, seed: int = 0) -> DataProto:
    """Random prompts (3-9 tokens, left-padded) and responses (2-8 tokens, right-padded)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(10, 2000, (int(torch.randint(3, 10, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(num_rows)
    ]
    responses = [
        torch.randint(10, 2000, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(num_rows)
    ]
    return DataProto.from_dict(tensors=build_conversation_batch(prompts, responses, pad_id=0))


def plain_values(model, data: DataProto) -> torch.Tensor:
    """Head output at the position before each response token, zero on padding (no critic code involved)."""
    b = data.batch
    with torch.no_grad():
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    r = b["responses"].shape[1]
    return out[:, -r - 1 : -1, 0] * b["attention_mask"][:, -r:]


def critic_config(**overrides) -> dict:
    config = dict(
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=2,
        cliprange_value=CLIP,
        grad_clip=1.0,
        loss_agg_mode="token-mean",
        ppo_epochs=1,
    )
    config.update(overrides)
    return config


def make_update_data(model, num_rows: int = 5, seed: int = 1) -> DataProto:
    """Old values = current values + offsets of +-0.5 on every other token (beyond the 0.2 clip range, so the
    clipped term is active there), returns = random in [1, 3]; two mini-batches (rows 0-2 and 3-4)."""
    data = make_batch(num_rows, seed)
    mask = data.batch["response_mask"].float()
    gen = torch.Generator().manual_seed(seed + 7)
    current = plain_values(model, data)
    offsets = torch.zeros_like(current)
    offsets[:, ::2] = 0.5
    offsets[::2, ::2] = -0.5
    data.batch["values"] = (current + offsets) * mask
    data.batch["returns"] = (1.0 + 2.0 * torch.rand(current.shape, generator=gen)) * mask
    data.batch["mini_batch_id"] = torch.tensor([0, 0, 0, 1, 1])[:num_rows]
    return data


def hand_value_loss(vpreds, returns, values, mask, total_tokens) -> torch.Tensor:
    """0.5 * sum over masked tokens of max((v - R)^2, (clip(v, V - c, V + c) - R)^2) / total_tokens."""
    total = torch.tensor(0.0)
    for i in range(vpreds.shape[0]):
        for t in range(vpreds.shape[1]):
            if mask[i, t]:
                v, r, old = float(vpreds[i, t]), float(returns[i, t]), float(values[i, t])
                clipped = min(max(v, old - CLIP), old + CLIP)
                total += max((v - r) ** 2, (clipped - r) ** 2)
    return 0.5 * total / total_tokens


# ----------------------------------------------------------------------------------------------------------
# DataParallelPPOCritic
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"use_remove_padding": True},
        {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 20},
    ],
)
def test_compute_values_equals_plain_forward(value_model, options):
    data = make_batch(5, seed=3)
    critic = DataParallelPPOCritic(critic_config(forward_micro_batch_size_per_gpu=2, **options), value_model)
    values = critic.compute_values(data)
    want = plain_values(value_model, data)
    assert values.shape == data.batch["responses"].shape
    torch.testing.assert_close(values, want, atol=1e-5, rtol=0)
    assert values.abs().sum() > 0 and torch.all(values[data.batch["response_mask"] == 0] == 0)


def test_packed_layout_is_planned_from_host_copies(value_model, monkeypatch):
    """With remove-padding, every micro-batch's packed layout comes from host copies of its masks (``host_plan``,
    computed before the device work, so the passes do not wait on the device): the device-side ``pack_rows`` is
    never called, the plans carry the flat target positions, and the values and the update are those of the padded
    critic."""
    import verl.workers.actor.forward as forward
    import verl.workers.critic.dp_critic as dp_critic

    def no_device_packing(*args, **kwargs):
        raise AssertionError("pack_rows called on the device tensors")

    monkeypatch.setattr(dp_critic, "pack_rows", no_device_packing)
    seen = []
    original = forward.host_plan  # what the data-parallel base plans each micro-batch with

    def recording_host_plan(input_ids, *args, **kwargs):
        plan = original(input_ids, *args, **kwargs)
        seen.append((input_ids.device.type, plan.packed is not None and plan.packed.target_index is not None))
        return plan

    monkeypatch.setattr(forward, "host_plan", recording_host_plan)
    data = make_batch(5, seed=3)
    packed = DataParallelPPOCritic(critic_config(use_remove_padding=True), value_model)
    torch.testing.assert_close(packed.compute_values(data), plain_values(value_model, data), atol=1e-5, rtol=0)
    assert len(seen) == 3 and all(entry == ("cpu", True) for entry in seen)  # 5 rows, 2 per micro-batch

    models = [copy.deepcopy(value_model) for _ in range(2)]
    update = make_update_data(models[0])
    for model, remove_padding in zip(models, (False, True)):
        critic = DataParallelPPOCritic(
            critic_config(use_remove_padding=remove_padding), model, torch.optim.SGD(model.parameters(), lr=0.1)
        )
        critic.update_critic(copy.deepcopy(update))
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert any(not torch.equal(a, b) for a, b in zip(models[0].parameters(), value_model.parameters()))


def test_update_critic_matches_hand_computed_loss_and_lowers_the_error(value_model):
    model = copy.deepcopy(value_model)
    data = make_update_data(model)
    b = data.batch
    mask = b["response_mask"]
    critic = DataParallelPPOCritic(critic_config(), model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    recorded = []
    original = critic._micro_batch_backward

    def record(micro, norm_kwargs, zero_weight, plan):
        out = original(micro, norm_kwargs, zero_weight, plan=plan)
        recorded.append(out.clone())
        return out

    critic._micro_batch_backward = record
    before = plain_values(model, data)
    metrics = critic.update_critic(data)

    first_tokens = float(mask[:3].sum())  # mini-batch 0 = rows 0-2; its first micro-batch = rows 0-1
    micro0 = hand_value_loss(before[:2], b["returns"][:2], b["values"][:2], mask[:2], first_tokens)
    mini0 = hand_value_loss(before[:3], b["returns"][:3], b["values"][:3], mask[:3], first_tokens)
    assert float(recorded[0][0]) == pytest.approx(float(micro0), rel=1e-5)
    assert critic.mini_batch_metrics[0]["critic/vf_loss"] == pytest.approx(float(mini0), rel=1e-5)
    assert 0 < critic.mini_batch_metrics[0]["critic/vf_clipfrac"] < 1  # both branches of the max occur
    assert metrics["critic/num_mini_batches"] == 2 and math.isfinite(metrics["critic/grad_norm"])

    after = plain_values(model, data)

    def mse(v):
        return float((((v - b["returns"]) ** 2) * mask).sum() / mask.sum())

    assert mse(after) < mse(before)


@pytest.mark.parametrize(
    "options",
    [
        {"ppo_micro_batch_size_per_gpu": 1},
        {"ppo_micro_batch_size_per_gpu": 3},
        {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 14},
        {"ppo_micro_batch_size_per_gpu": 1, "use_remove_padding": True},
    ],
)
def test_update_is_invariant_to_the_micro_batch_split(value_model, options):
    data = make_update_data(value_model)

    def run(config):
        model = copy.deepcopy(value_model)
        critic = DataParallelPPOCritic(critic_config(**config), model, torch.optim.SGD(model.parameters(), lr=0.1))
        critic.update_critic(data)
        return critic.mini_batch_metrics, model.state_dict()

    want_steps, want_state = run({"ppo_micro_batch_size_per_gpu": 5})  # each mini-batch in one micro-batch
    got_steps, got_state = run(options)
    for got, want in zip(got_steps, want_steps):
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    for name, value in want_state.items():
        torch.testing.assert_close(got_state[name], value, atol=1e-6, rtol=0, msg=name)
    assert not torch.equal(want_state["score.weight"], value_model.state_dict()["score.weight"])


# ----------------------------------------------------------------------------------------------------------
# single-turn trainer end to end
# ----------------------------------------------------------------------------------------------------------


def _prompts(tmp: Path, n: int, name: str) -> str:
    rows = [
        {
            "data_source": "toy",
            "prompt": [{"role": "user", "content": f"Say a word about the number {i}."}],
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]
    path = tmp / f"{name}.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def _cfg(tmp: Path, model: Path, out: str, steps: int, estimator: str, extra=()):
    overrides = [
        f"data.train_files={_prompts(tmp, 4, 'train')}",
        f"data.val_files={_prompts(tmp, 2, 'val')}",
        "data.train_batch_size=2",
        "data.max_prompt_length=64",
        "data.max_response_length=12",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.seed=7",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        f"critic.model.path={model}",
        "critic.model.enable_gradient_checkpointing=False",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "critic.optim.lr=1e-3",
        f"algorithm.adv_estimator={estimator}",
        "recurrent.enable=null",
        "trainer.device=cpu",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=2",
        "trainer.test_freq=-1",
        "trainer.val_before_train=False",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={out}",
        "trainer.progress_bar=False",
        f"custom_reward_function.path={PARITY_REWARD}",
        *extra,
    ]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def _finite_floats(h: dict) -> None:
    for key, value in h.items():
        if isinstance(value, float):
            assert math.isfinite(value), key


@pytest.fixture(scope="module")
def gae_runs(tiny_model_path, tmp_path_factory, ray_cluster):
    """2 steps (checkpoint at step 2), resumed to step 3, and step 1 again on 2 Ray ranks."""
    tmp = tmp_path_factory.mktemp("gae")
    # the validation in two batches of one prompt: the dump numbers its rows across them
    dumps = ["data.val_batch_size=1", f"trainer.rollout_data_dir={tmp / 'rollouts'}"]
    dumps.append(f"trainer.validation_data_dir={tmp / 'validation'}")
    first = main_ppo.run(
        _cfg(tmp, tiny_model_path, str(tmp / "a"), 2, "gae", extra=["trainer.val_before_train=True", *dumps])
    )
    resumed = main_ppo.run(_cfg(tmp, tiny_model_path, str(tmp / "a"), 3, "gae"))
    # actor and critic groups share one Ray pool (max_colocate_count=2); FSDP2 over gloo in each group
    two_ranks = main_ppo.run(
        _cfg(
            tmp, tiny_model_path, str(tmp / "b"), 1, "gae", extra=["trainer.n_gpus_per_node=2", "trainer.save_freq=-1"]
        )
    )
    return {"first": first, "resumed": resumed, "two_ranks": two_ranks, "tmp": tmp}


def test_single_turn_generations_are_dumped_one_line_per_row(gae_runs):
    """A single-turn rollout's dump: one conversation (turn 0, final) per row, the row's own score and prompt."""
    tmp = gae_runs["tmp"]
    assert sorted(p.name for p in (tmp / "rollouts").iterdir()) == ["1.jsonl", "2.jsonl"]
    assert sorted(p.name for p in (tmp / "validation").iterdir()) == ["0.jsonl"]
    for path, rows in ((tmp / "rollouts" / "2.jsonl", 4), (tmp / "validation" / "0.jsonl", 2)):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["trajectory"] for r in records] == list(range(rows))
        assert {(r["turn"], r["final"], r["step"], r["data_source"]) for r in records} == {
            (0, True, int(path.stem), "toy")
        }
        for r in records:
            assert r["score"] == float(len(r["output"]) % 2 == 0)  # the parity reward of this row's answer
            assert f"Say a word about the number {r['gts']}." in r["input"]


def test_single_turn_ppo_with_gae_trains_the_critic(gae_runs, tiny_model_path):
    from verl.utils.checkpoint import load_model_shards

    hist = gae_runs["first"]
    assert "val-core/toy/reward/mean@1" in hist[0]
    steps = {h["step"]: h for h in hist if h["step"] > 0}
    assert sorted(steps) == [1, 2]
    for h in steps.values():
        _finite_floats(h)
        for key in (
            "critic/vf_loss",
            "critic/vf_clipfrac",
            "critic/values/mean",
            "critic/vf_explained_var",
            "actor/pg_loss",
            "actor/grad_norm",
            "critic/advantages/mean",
            "timing_s/update_critic",
        ):
            assert key in h, key
        assert h["critic/vf_loss"] > 0 and h["critic/grad_norm"] > 0
        # train_batch_size 2 / ppo_mini_batch_size 1: two optimizer steps each
        assert h["critic/num_mini_batches"] == 2 and h["actor/num_mini_batches"] == 2
        # GAE with gamma = lam = 1 and the score on the last token: returns are the scores (0 or 1)
        assert -1e-6 <= h["critic/returns/min"] <= h["critic/returns/max"] <= 1.0 + 1e-6
    # the values move between steps: the critic was updated
    assert steps[1]["critic/values/mean"] != steps[2]["critic/values/mean"]

    # the critic checkpoint holds trained parameters: every tensor differs from the freshly loaded value model
    torch.manual_seed(0)
    initial = load_value_model(tiny_model_path, dtype="float32")
    trained = copy.deepcopy(initial)
    load_model_shards(gae_runs["tmp"] / "a" / "global_step_2" / "critic", trained, load_rng=False)
    changed = [k for k, v in trained.state_dict().items() if not torch.equal(v, initial.state_dict()[k])]
    assert len(changed) == len(initial.state_dict())


def test_resume_loads_the_critic_checkpoint(gae_runs):
    resumed = gae_runs["resumed"]
    assert [h["step"] for h in resumed] == [3]
    assert math.isfinite(resumed[0]["critic/vf_loss"]) and resumed[0]["critic/grad_norm"] > 0


def test_two_ray_ranks_match_one_process(gae_runs):
    one = {h["step"]: h for h in gae_runs["first"]}[1]
    two = {h["step"]: h for h in gae_runs["two_ranks"]}[1]
    assert two["critic/score/mean"] == one["critic/score/mean"]
    for key in ("critic/values/mean", "critic/vf_loss", "actor/pg_loss"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    for key in ("critic/grad_norm", "actor/grad_norm"):
        assert two[key] == pytest.approx(one[key], rel=1e-3), key
    # both ranks computed part of both mini-batches, actor and critic (trainer/ppo/rank_spread.py)
    assert two["perf/update_idle_rank_steps"] == 0 and two["perf/critic_update_idle_rank_steps"] == 0


def test_critic_warmup_skips_the_actor(tiny_model_path, tmp_path):
    hist = main_ppo.run(
        _cfg(
            tmp_path,
            tiny_model_path,
            str(tmp_path / "w"),
            1,
            "gae",
            extra=["trainer.critic_warmup=1", "trainer.save_freq=-1"],
        )
    )
    h = {x["step"]: x for x in hist}[1]
    assert "critic/vf_loss" in h and "actor/pg_loss" not in h and "timing_s/update_actor" not in h


def test_single_turn_grpo_without_critic(tiny_model_path, tmp_path):
    hist = main_ppo.run(
        _cfg(
            tmp_path,
            tiny_model_path,
            str(tmp_path / "grpo"),
            1,
            "grpo",
            extra=["critic.model.path=/nonexistent", "trainer.save_freq=-1"],
        )
    )
    h = {x["step"]: x for x in hist}[1]
    _finite_floats(h)
    assert "actor/pg_loss" in h and "critic/vf_loss" not in h and "critic/values/mean" not in h
    assert h["critic/score/mean"] == h["critic/score/mean"]


def test_rloo_with_kl_in_reward(tiny_model_path, tmp_path):
    """Rewards = score - beta * KL(actor || ref) per token: 0 at step 1 (same weights), > 0 once the actor moved."""
    hist = main_ppo.run(
        _cfg(
            tmp_path,
            tiny_model_path,
            str(tmp_path / "kl"),
            2,
            "rloo",
            extra=[
                "algorithm.use_kl_in_reward=True",
                "algorithm.kl_penalty=low_var_kl",
                "algorithm.kl_ctrl.kl_coef=0.1",
                "actor_rollout_ref.actor.use_kl_loss=True",
                "actor_rollout_ref.actor.kl_loss_coef=0",
                "actor_rollout_ref.actor.optim.lr=1e-2",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
                "trainer.save_freq=-1",
            ],
        )
    )
    steps = {h["step"]: h for h in hist}
    assert steps[1]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert steps[1]["critic/rewards/mean"] == pytest.approx(steps[1]["critic/score/mean"], abs=1e-6)
    assert steps[2]["actor/reward_kl_penalty"] > 0 and steps[2]["actor/reward_kl_penalty_coeff"] == 0.1
    assert steps[2]["critic/rewards/mean"] < steps[2]["critic/score/mean"]


def test_unsupported_settings_are_refused_with_clear_messages(tiny_model_path, tmp_path):
    from verl.trainer.ppo.single_turn import SingleTurnPPOTrainer

    cfg = _cfg(tmp_path, tiny_model_path, str(tmp_path / "r"), 1, "remax")
    tok = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 1})()
    with pytest.raises(NotImplementedError, match="remax"):
        SingleTurnPPOTrainer(
            cfg, tok, worker_group=None, train_dataset=None, val_dataset=None, reward_fn=None, val_reward_fn=None
        )
    cfg = _cfg(tmp_path, tiny_model_path, str(tmp_path / "r"), 1, "grpo", extra=["algorithm.use_kl_in_reward=True"])
    with pytest.raises(ValueError, match="use_kl_loss"):
        SingleTurnPPOTrainer(
            cfg, tok, worker_group=None, train_dataset=None, val_dataset=None, reward_fn=None, val_reward_fn=None
        )
    with pytest.raises(ValueError, match="critic"):
        SingleTurnPPOTrainer(
            _cfg(tmp_path, tiny_model_path, str(tmp_path / "r"), 1, "gae"),
            tok,
            worker_group=None,
            train_dataset=None,
            val_dataset=None,
            reward_fn=None,
            val_reward_fn=None,
        )


@pytest.mark.gpu
def test_single_turn_gae_on_gpus(tiny_model_path, tmp_path, ray_cluster):
    """The same path on GPUs: actor and critic groups on one Ray pool (half a GPU each), FSDP2 over NCCL with
    bf16 compute, the HF engine on CUDA, packed rows; checkpoint of both groups at step 2."""
    ngpu = min(2, torch.cuda.device_count())
    hist = main_ppo.run(
        _cfg(
            tmp_path,
            tiny_model_path,
            str(tmp_path / "g"),
            2,
            "gae",
            extra=[
                "trainer.device=cuda",
                f"trainer.n_gpus_per_node={ngpu}",
                "actor_rollout_ref.model.use_remove_padding=True",
                "critic.model.use_remove_padding=True",
                "critic.model.enable_gradient_checkpointing=True",
            ],
        )
    )
    steps = {h["step"]: h for h in hist}
    assert set(steps) >= {1, 2}
    for h in steps.values():
        _finite_floats(h)
        assert h["critic/grad_norm"] > 0 and h["actor/grad_norm"] > 0 and h["critic/vf_loss"] > 0
    assert (tmp_path / "g" / "global_step_2" / "critic" / "model").is_dir()
    assert (tmp_path / "g" / "global_step_2" / "COMPLETE").exists()
