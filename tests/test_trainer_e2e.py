"""End to end: the memory agent trained with Multi-Conv GRPO through the real trainer (CPU, tiny model).

One module-scoped run of 2 steps with a checkpoint at step 2, a resumed run to step 3, and an
uninterrupted 3-step run to compare against.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

import verl.trainer.main_ppo as main_ppo

CONFIG_DIR = str(Path(main_ppo.__file__).parent / "config")


def _data(tmp: Path, n: int, name: str, doc_chars: int = 200) -> str:
    """``n`` memory-agent rows in ``tmp/<name>.parquet``; row ``i``'s document has ``doc_chars + 37 * i``
    characters of filler after the answer sentence."""
    words = " ".join(f"w{i}" for i in range(400))
    rows = [
        {
            "data_source": "hotpotqa",
            "prompt": [{"role": "user", "content": f"What is the code number {i}?"}],
            "context": f"The code is {i}. " + words[: doc_chars + 37 * i],
            "reward_model": {"style": "rule", "ground_truth": [str(i)]},
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]
    path = tmp / f"{name}.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def _cfg(tmp: Path, model: Path, out: str, steps: int, extra=()):
    train, val = _data(tmp, 4, "train"), _data(tmp, 2, "val")
    overrides = [
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.train_batch_size=2",
        "data.shuffle=True",
        "data.truncation=center",
        "+data.context_key=context",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.seed=123",
        "actor_rollout_ref.rollout.prompt_length=512",
        "actor_rollout_ref.rollout.response_length=16",
        "actor_rollout_ref.rollout.val_kwargs.n=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "algorithm.grpo_use_adv=False",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "reward_model.reward_manager=naive",
        "recurrent.enable=memory",
        "recurrent.memory.config.chunk_size=24",
        "recurrent.memory.config.max_memorization_length=8",
        "recurrent.memory.config.max_final_response_length=8",
        "recurrent.memory.config.max_chunks=4",
        "recurrent.memory.config.max_prompt_length=32",
        "trainer.device=cpu",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "trainer.val_before_train=True",
        "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={out}",
        "trainer.progress_bar=False",
        "trainer.project_name=t",
        "trainer.experiment_name=t",
        f"custom_reward_function.path={Path(__file__).parent / 'fixtures' / 'parity_reward.py'}",
        *extra,
    ]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


@pytest.fixture(scope="module")
def runs(tiny_model_path, tmp_path_factory, ray_cluster):
    tmp = tmp_path_factory.mktemp("e2e")
    torch.manual_seed(0)
    first = main_ppo.run(_cfg(tmp, tiny_model_path, str(tmp / "a"), 2))
    resumed = main_ppo.run(_cfg(tmp, tiny_model_path, str(tmp / "a"), 3))
    # the validation in two batches of one question: the dump numbers its trajectories across them
    dumps = ["data.val_batch_size=1", f"trainer.rollout_data_dir={tmp / 'rollouts'}"]
    dumps.append(f"trainer.validation_data_dir={tmp / 'validation'}")
    straight = main_ppo.run(_cfg(tmp, tiny_model_path, str(tmp / "b"), 3, extra=dumps))
    # the same first step on 2 Ray worker processes (FSDP2 over gloo), data split unevenly across ranks
    two_ranks = main_ppo.run(
        _cfg(
            tmp,
            tiny_model_path,
            str(tmp / "c"),
            1,
            extra=["trainer.n_gpus_per_node=2", "trainer.val_before_train=False"],
        )
    )
    return {"first": first, "resumed": resumed, "straight": straight, "two_ranks": two_ranks, "tmp": tmp}


def test_two_steps_with_multiple_chunks_and_finite_metrics(runs):
    steps = [h for h in runs["first"] if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:
        # contexts of 200+ words at chunk 24 tokens -> at least 3 memory turns + 1 final per trajectory
        assert h["trajectory/num_conv/min"] >= 4
        for k, v in h.items():
            if isinstance(v, float):
                assert v == v and abs(v) != float("inf"), k
        assert "actor/pg_loss" in h and "actor/grad_norm" in h and "timing_s/gen" in h
    # the parity reward gives groups with different rewards, so some advantages are non-zero
    assert any(h["critic/advantages/max"] > 0 > h["critic/advantages/min"] for h in steps)
    assert "val-core/hotpotqa/reward/mean@1" in runs["first"][0]


def test_resume_continues_at_step_3_like_an_uninterrupted_run(runs):
    resumed = [h for h in runs["resumed"] if h["step"] > 0]
    straight = {h["step"]: h for h in runs["straight"]}
    assert [h["step"] for h in resumed] == [3]
    r3, s3 = resumed[0], straight[3]
    assert r3["trajectory/num_conv/mean"] == s3["trajectory/num_conv/mean"]
    assert r3["response_length/mean"] == pytest.approx(s3["response_length/mean"])
    assert r3["actor/pg_loss"] == pytest.approx(s3["actor/pg_loss"], rel=1e-4, abs=1e-6)


def test_checkpoint_and_jsonl_logs_written(runs):
    out = runs["tmp"] / "a"
    assert (out / "global_step_2").is_dir()
    logged = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().strip().splitlines()]
    # validation before training, one line per step, and the resumed run appends its step 3
    assert [r["step"] for r in logged] == [0, 1, 2, 3]
    for row, hist in zip(logged, runs["first"] + [h for h in runs["resumed"] if h["step"] > 0]):
        assert row["step"] == hist["step"]
        for key in ("critic/score/mean", "actor/pg_loss", "val-core/hotpotqa/reward/mean@1"):
            if key in hist:
                assert row[key] == pytest.approx(hist[key])


def test_wall_time_limit_stops_with_a_checkpoint_and_the_next_command_resumes(tiny_model_path, tmp_path, runs):
    """trainer.max_wall_time_s: each command does one step past the limit, validates, saves, and stops; rerun
    continues."""
    extra = [
        "trainer.max_wall_time_s=0.001",
        "trainer.val_before_train=False",
        "trainer.test_freq=10",
        "trainer.save_freq=-1",
    ]
    out = tmp_path / "w"
    first = main_ppo.run(_cfg(tmp_path, tiny_model_path, str(out), 3, extra=extra))
    assert [h["step"] for h in first] == [1]
    assert any(k.startswith("val-core/") for k in first[0])  # stopped early: validated (test_freq=10 alone would not)
    assert (out / "global_step_1").is_dir() and not (out / "global_step_2").exists()
    second = main_ppo.run(_cfg(tmp_path, tiny_model_path, str(out), 3, extra=extra))
    assert [h["step"] for h in second] == [2]
    third = main_ppo.run(_cfg(tmp_path, tiny_model_path, str(out), 3, extra=extra))
    assert [h["step"] for h in third] == [3]  # the last step ends the run normally (save_freq=-1: no save)
    assert not (out / "global_step_3").exists()
    # the resumed steps follow an uninterrupted run with the same settings
    straight = {h["step"]: h for h in runs["straight"]}
    assert third[0]["trajectory/num_conv/mean"] == straight[3]["trajectory/num_conv/mean"]


def test_two_ray_ranks_match_one_process(runs):
    one = {h["step"]: h for h in runs["straight"]}[1]
    two = {h["step"]: h for h in runs["two_ranks"]}[1]
    assert two["trajectory/num_conv/mean"] == one["trajectory/num_conv/mean"]
    assert two["critic/score/mean"] == one["critic/score/mean"]
    assert two["actor/pg_loss"] == pytest.approx(one["actor/pg_loss"], rel=1e-4, abs=1e-6)
    assert one["actor/grad_norm"] > 1e-3  # non-zero advantages: the comparison means something
    assert two["actor/grad_norm"] == pytest.approx(one["actor/grad_norm"], rel=1e-3)
    # each rank computed part of both mini-batches (trainer/ppo/rank_spread.py): contiguous rows would have given
    # rank 0 mini-batch 0 and rank 1 mini-batch 1 only (2 idle rank-steps, the busier rank twice the mean)
    assert two["perf/update_idle_rank_steps"] == 0
    assert two["perf/update_rank_tokens_max_over_mean"] < 1.2
    assert "perf/update_idle_rank_steps" not in one  # one rank: nothing to spread


def test_dapo_dynamic_sampling_and_overlong_shaping(tiny_model_path, tmp_path, runs):
    """Filter on: every kept group has reward variance; the batch is refilled from more questions. Run without the
    engine's log-probs (``rollout.calculate_log_probs=False``): no engine-vs-actor metrics."""
    hist = main_ppo.run(
        _cfg(
            tmp_path,
            tiny_model_path,
            str(tmp_path / "d"),
            1,
            extra=[
                "trainer.val_before_train=False",
                "trainer.save_freq=-1",
                "trainer.test_freq=-1",
                "algorithm.filter_groups.enable=True",
                "algorithm.filter_groups.max_num_gen_batches=4",
                "algorithm.overlong_buffer.enable=True",
                "algorithm.overlong_buffer.len=4",
                "algorithm.overlong_buffer.penalty_factor=0.5",
                # no engine log-probs (tests/test_calculate_log_probs.py): the batch and its DAPO refills lack them
                "actor_rollout_ref.rollout.calculate_log_probs=False",
            ],
        )
    )
    h = {x["step"]: x for x in hist}[1]
    assert not [k for k in h if k.startswith("rollout/logprob_abs_diff")]
    assert h["train/total_groups"] >= h["train/kept_groups"]
    assert 1 <= h["train/num_gen_batches"] <= 4
    assert h["train/overlong_penalty_mean"] <= 0
    # after filtering, no kept group has all-equal rewards, so advantages are never all zero
    assert h["critic/advantages/max"] > 0 > h["critic/advantages/min"]


@pytest.mark.gpu
def test_trainer_on_gpus_fsdp2_nccl(tiny_model_path, tmp_path, ray_cluster):
    """The same launch path on GPUs: Ray workers, FSDP2 over NCCL (bf16 compute), HF engine on CUDA."""
    ngpu = min(2, torch.cuda.device_count())
    hist = main_ppo.run(
        _cfg(
            tmp_path,
            tiny_model_path,
            str(tmp_path / "g"),
            2,
            extra=[
                "trainer.device=cuda",
                f"trainer.n_gpus_per_node={ngpu}",
                "trainer.val_before_train=False",
                "trainer.test_freq=-1",
                "actor_rollout_ref.model.use_remove_padding=True",
                "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            ],
        )
    )
    steps = {h["step"]: h for h in hist}
    assert set(steps) >= {1, 2}
    for h in steps.values():
        assert h["actor/grad_norm"] > 0 and h["actor/grad_norm"] == h["actor/grad_norm"]
        assert h["perf/throughput"] > 0
    assert (tmp_path / "g" / "global_step_2" / "COMPLETE").exists()


@pytest.mark.parametrize("free_running_calls", [0, 8], ids=["batched_calls", "free_running"])
def test_async_memory_agent_training_step(tiny_model_path, tmp_path, runs, free_running_calls):
    """actor_rollout_ref.rollout.mode=async: the memory agent as one coroutine per sample, served by
    the engines of 2 Ray worker processes (least-loaded routing, sticky sessions); with
    ``rollout.async_free_running_calls`` each request is a call of its own, 8 at once per worker."""
    hist = main_ppo.run(
        _cfg(
            tmp_path,
            tiny_model_path,
            str(tmp_path / "am"),
            1,
            extra=[
                "actor_rollout_ref.rollout.mode=async",
                f"actor_rollout_ref.rollout.async_free_running_calls={free_running_calls}",
                "trainer.n_gpus_per_node=2",
                "trainer.val_before_train=False",
                "trainer.save_freq=-1",
                "trainer.test_freq=-1",
            ],
        )
    )
    h = {x["step"]: x for x in hist}[1]
    assert h["trajectory/num_conv/min"] >= 4  # >= 3 memory turns + the final answer, as in sync mode
    assert h["actor/grad_norm"] == h["actor/grad_norm"] and "actor/pg_loss" in h
    if free_running_calls:  # a call per chat request: one per conversation of the memory agent
        assert h["async/replica_calls"] == h["async/engine_turns"]
    else:  # a rank's requests of a turn in one call
        assert h["async/replica_calls"] < h["async/engine_turns"] / 2


def test_async_tool_gsm8k_training_step(tiny_model_path, tmp_path, runs):
    """The tool-calling GSM8K agent (async) trains one step from the preprocessed fixture."""
    import subprocess
    import sys

    fixture = Path(__file__).parent / "fixtures" / "gsm8k_small.jsonl"
    script = Path(__file__).parents[1] / "examples" / "data_preprocess" / "gsm8k_multiturn_w_tools.py"
    subprocess.run(
        [
            sys.executable,
            str(script),
            "--train_file",
            str(fixture),
            "--test_file",
            str(fixture),
            "--local_dir",
            str(tmp_path / "gsm"),
        ],
        check=True,
    )
    overrides = [
        f"data.train_files={tmp_path / 'gsm' / 'train.parquet'}",
        f"data.val_files={tmp_path / 'gsm' / 'test.parquet'}",
        "data.train_batch_size=2",
        "data.max_prompt_length=512",
        "data.truncation=left",
        f"actor_rollout_ref.model.path={tiny_model_path}",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.seed=1",
        "actor_rollout_ref.rollout.prompt_length=1024",
        "actor_rollout_ref.rollout.response_length=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "reward_model.reward_manager=naive",
        "recurrent.enable=tool_gsm8k",
        "recurrent.tool_gsm8k.config.max_turn=2",
        "recurrent.tool_gsm8k.config.max_generation_per_turn=16",
        "trainer.device=cpu",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=1",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=False",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path / 'tg'}",
        "trainer.progress_bar=False",
    ]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    h = {x["step"]: x for x in main_ppo.run(cfg)}[1]
    assert h["trajectory/num_conv/min"] >= 1
    assert "actor/pg_loss" in h and h["actor/grad_norm"] == h["actor/grad_norm"]
    # the in-process worker's engine ran the chats under its RolloutGuard (recurrent.replicas.WorkerReplica)
    assert h["perf/rollout/generate_s"] > 0


def test_generations_are_dumped_per_step_and_per_validation(runs):
    """``trainer.rollout_data_dir`` / ``validation_data_dir``: one line per conversation, each trajectory's turns in
    order with its final answer last, the score it trained on (the parity reward of that final answer) on every turn,
    and the question's ground truth; the mean over the lines is the step's turn-weighted ``critic/score/mean``."""
    tmp = runs["tmp"]
    history = {h["step"]: h for h in runs["straight"]}
    assert sorted(p.name for p in (tmp / "rollouts").iterdir()) == ["1.jsonl", "2.jsonl", "3.jsonl"]
    assert sorted(p.name for p in (tmp / "validation").iterdir()) == ["0.jsonl", "2.jsonl", "3.jsonl"]
    for folder, step, trajectories in [("rollouts", 1, 8), ("rollouts", 3, 8), ("validation", 0, 2)]:
        records = [json.loads(line) for line in (tmp / folder / f"{step}.jsonl").read_text().splitlines()]
        assert {r["step"] for r in records} == {step}
        by_trajectory: dict[int, list[dict]] = {}
        for r in records:
            by_trajectory.setdefault(r["trajectory"], []).append(r)
        assert sorted(by_trajectory) == list(range(trajectories))
        for turns in by_trajectory.values():
            assert [r["turn"] for r in turns] == list(range(len(turns))) and len(turns) >= 4
            assert [r["final"] for r in turns] == [False] * (len(turns) - 1) + [True]
            final = turns[-1]
            assert final["score"] == float(len(final["output"]) % 2 == 0)  # tests/fixtures/parity_reward.py
            assert {r["score"] for r in turns} == {final["score"]} and len({r["uid"] for r in turns}) == 1
            code = final["gts"][0]
            assert all(f"What is the code number {code}?" in r["input"] for r in turns)
        n = 4 if folder == "rollouts" else 1
        assert len({r["uid"] for r in records}) == trajectories // n
        if folder == "rollouts":
            mean = sum(r["score"] for r in records) / len(records)
            assert mean == pytest.approx(history[step]["critic/score/mean"], abs=1e-6)


def test_rollout_engine_follows_the_actor(runs):
    """Engine log-probs of its own samples equal the actor's after every weight sync (HF engine)."""
    for h in runs["straight"]:
        if h["step"] > 0:
            assert h["rollout/logprob_abs_diff_max"] < 1e-3, h["step"]


def test_actor_log_probs_use_the_rollout_temperature(tiny_model_path, tmp_path, runs):
    """At rollout temperature 0.7 the actor's recomputed log-probs must be those of the distribution
    the engine sampled from (logits / 0.7), as at temperature 1; else PPO optimises another policy."""
    hist = main_ppo.run(
        _cfg(
            tmp_path,
            tiny_model_path,
            str(tmp_path / "t"),
            1,
            extra=[
                "actor_rollout_ref.rollout.temperature=0.7",
                "trainer.val_before_train=False",
                "trainer.save_freq=-1",
                "trainer.test_freq=-1",
            ],
        )
    )
    step = {h["step"]: h for h in hist}[1]
    assert step["rollout/logprob_abs_diff_max"] < 1e-3


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_rollout_training_with_weight_sync(tiny_model_path, tmp_path, runs):
    """rollout.name=vllm (in-process vLLM, CPU build): 2 steps; after the first update the engine's
    sampling log-probs must still match the actor's, which only holds if the weights were synced."""
    hist = main_ppo.run(
        _cfg(
            tmp_path,
            tiny_model_path,
            str(tmp_path / "v"),
            2,
            extra=[
                "actor_rollout_ref.rollout.name=vllm",
                "actor_rollout_ref.rollout.enforce_eager=True",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                "actor_rollout_ref.rollout.gpu_memory_utilization=0.2",
                "trainer.val_before_train=False",
                "trainer.save_freq=-1",
                "trainer.test_freq=-1",
            ],
        )
    )
    steps = {h["step"]: h for h in hist}
    assert steps[1]["actor/grad_norm"] > 0
    assert steps[2]["rollout/logprob_abs_diff_max"] < 1e-3


def test_every_parameter_changed_and_checkpoint_merges_to_hf(runs, tiny_model_path):
    """The step-2 checkpoint, merged to a HF folder, loads with transformers; every parameter moved."""
    from transformers import AutoModelForCausalLM

    from verl.utils.checkpoint import merge_checkpoint_to_hf

    out = merge_checkpoint_to_hf(runs["tmp"] / "a" / "global_step_2", runs["tmp"] / "merged")
    trained = AutoModelForCausalLM.from_pretrained(out).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    unchanged = [k for k, v in initial.items() if torch.equal(v, trained[k])]
    assert not unchanged


def test_lora_training_syncs_the_merged_weights_and_exports_them(runs, tiny_model_path, tmp_path):
    """``actor_rollout_ref.model.lora_rank=4`` through the real trainer: after the first update the engine scores
    its samples like the LoRA actor (the weight sync handed it the merged weights), and the step-2 checkpoint
    exports to a plain HF model in which exactly the adapted linear weights moved (tests/test_lora.py checks the
    merge itself)."""
    from transformers import AutoModelForCausalLM

    from verl.utils.checkpoint import merge_checkpoint_to_hf

    out = tmp_path / "lora"
    extra = [
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.actor.optim.lr=5e-2",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
    ]
    steps = {h["step"]: h for h in main_ppo.run(_cfg(tmp_path, tiny_model_path, str(out), 2, extra=extra))}
    assert steps[1]["actor/grad_norm"] > 0
    assert steps[2]["rollout/logprob_abs_diff_max"] < 1e-3
    trained = AutoModelForCausalLM.from_pretrained(merge_checkpoint_to_hf(out / "global_step_2", tmp_path / "hf"))
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    changed = {k for k, v in trained.state_dict().items() if not torch.equal(v, initial[k])}
    attn, mlp = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
    adapted = {f"model.layers.{i}.self_attn.{n}.weight" for i in range(2) for n in attn}
    adapted |= {f"model.layers.{i}.mlp.{n}.weight" for i in range(2) for n in mlp}
    assert changed == adapted  # biases, norms and the embedding are frozen


def test_bypass_mode_trains_like_the_recomputed_run_without_its_pass(tiny_model_path, tmp_path, runs):
    """The HF engine's log-probs equal the actor's (test above), so taking them as PPO's old log-probs
    (``algorithm.bypass_mode``) gives the recomputed run's first step, without the old-log-prob pass."""
    extra = ["algorithm.bypass_mode=True", "trainer.val_before_train=False", "trainer.save_freq=-1"]
    hist = main_ppo.run(
        _cfg(tmp_path, tiny_model_path, str(tmp_path / "bypass"), 1, extra=[*extra, "trainer.test_freq=-1"])
    )
    bypass, straight = {h["step"]: h for h in hist}[1], {h["step"]: h for h in runs["straight"]}[1]
    assert "timing_s/old_log_prob" not in bypass and "timing_s/old_log_prob" in straight
    assert "rollout/logprob_abs_diff_max" not in bypass
    assert bypass["response_length/mean"] == pytest.approx(straight["response_length/mean"])
    assert bypass["actor/pg_loss"] == pytest.approx(straight["actor/pg_loss"], rel=1e-3, abs=1e-5)
    assert bypass["actor/grad_norm"] == pytest.approx(straight["actor/grad_norm"], rel=1e-3)
    assert bypass["actor/ppo_kl"] == pytest.approx(straight["actor/ppo_kl"], abs=1e-4)  # the later mini-batches'
