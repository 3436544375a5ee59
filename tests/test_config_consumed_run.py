"""Config keys reach the entry point, the training loop, the trainers and the workflows (evidence for
tests/test_config_contract.py's CONSUMED table).

* ``main_ppo.run`` for real on a tiny single-turn dataset, with the parts that would start processes or train
  replaced by recorders (worker groups, ``ray.init``, the loggers, ``fit``): what each key became;
* ``fit`` with a scripted trainer: when it validates, logs and checkpoints, and where it resumes;
* the trainers' sampling parameters, advantages and rollout counts; the memory workflow's config; the async
  manager's options.
"""

from __future__ import annotations

import types
from pathlib import Path

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from recurrent.async_utils import ChatCompletionProxy, Replica
from tests.test_config import compose_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def write_rows(path: Path, n: int) -> str:
    rows = [
        {
            "data_source": "hotpotqa",
            "prompt": [{"role": "user", "content": f"question {i}?"}],
            "context": "some context words " * 5,
            "reward_model": {"style": "rule", "ground_truth": ["42"]},
        }
        for i in range(n)
    ]
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


class Recorder:
    """Stands in for a class or function: records its arguments, has every method."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __getattr__(self, name):
        return lambda *a, **k: None


@pytest.fixture
def recorded_run(tmp_path, tiny_model_path, monkeypatch):
    """``run(overrides)`` -> what ``main_ppo.run`` handed to the recorders."""
    import ray

    import verl.single_controller.cluster as cluster
    import verl.trainer.ppo.fit as fit_module
    import verl.trainer.ppo.local_worker_group as local_wg
    import verl.trainer.ppo.ray_worker_group as ray_wg
    import verl.utils.tracking as tracking
    import verl.workers.reward_manager as reward_manager
    from verl.trainer import main_ppo

    seen: dict = {}

    def fit(trainer, train_loader, val_loader, ckpt, total_steps):
        seen.update(trainer=trainer, train_loader=train_loader, val_loader=val_loader, ckpt=ckpt, steps=total_steps)
        return []

    def reward(name, tokenizer, compute_score=None, num_examine=0, **kwargs):
        seen.setdefault("reward", []).append((name, compute_score))
        seen.setdefault("reward_kwargs", []).append(kwargs)
        return Recorder()

    class Tracking(Recorder):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            seen["tracking"] = kwargs

    monkeypatch.setattr(fit_module, "fit", fit)
    monkeypatch.setattr(reward_manager, "load_reward_manager", reward)
    monkeypatch.setattr(tracking, "Tracking", Tracking)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.setdefault("ray_init", kw))
    monkeypatch.setattr(cluster, "describe_cluster", lambda: [])  # init_ray logs the (here: absent) cluster's nodes
    monkeypatch.setattr(local_wg, "LocalWorkerGroup", lambda cfg, device: seen.setdefault("wg", ("local", device)))
    monkeypatch.setattr(ray_wg, "build_ray_worker_group", lambda cfg, device: seen.setdefault("wg", ("ray", device)))
    monkeypatch.setattr(main_ppo, "build_worker_group", _recording(main_ppo.build_worker_group, seen))
    train, val = write_rows(tmp_path / "train.parquet", 4), write_rows(tmp_path / "val.parquet", 3)
    base = [
        f"actor_rollout_ref.model.path={tiny_model_path}",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.train_batch_size=2",
        "data.max_prompt_length=64",
        "data.dataloader_num_workers=0",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "trainer.n_gpus_per_node=1",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
    ]

    def run(*overrides: str) -> dict:
        seen.clear()
        cfg = compose_config(base + list(overrides))
        main_ppo.run(cfg)
        seen["cfg"] = cfg
        return dict(seen)

    run.tmp_path, run.train, run.val = tmp_path, train, val
    return run


def _recording(build, seen):
    def wrapper(cfg, device):
        group = build(cfg, device)
        return types.SimpleNamespace(
            world_size=1, init_model=lambda: None, shutdown_engines=lambda: None, shutdown=lambda: None, built=group
        )

    return wrapper


def test_run_passes_logging_checkpoint_and_ray_keys(recorded_run):
    tmp = recorded_run.tmp_path
    seen = recorded_run(
        "trainer.project_name=proj",
        "trainer.experiment_name=exp",
        "trainer.logger=[console,jsonl]",
        f"trainer.log_dir={tmp / 'logs2'}",
        f"trainer.default_local_dir={tmp / 'ck2'}",
        "trainer.max_actor_ckpt_to_keep=2",
        "trainer.ray_address=auto",
        "trainer.ray_num_cpus=3",
        "trainer.force_ray_workers=True",  # a worker group on Ray: the trainer starts (here: joins) Ray
    )
    t = seen["tracking"]
    assert (t["project_name"], t["experiment_name"], t["default_backend"]) == ("proj", "exp", ["console", "jsonl"])
    assert t["log_dir"] == str(tmp / "logs2")
    assert seen["ckpt"].root == tmp / "ck2" and seen["ckpt"].max_ckpt_to_keep == 2
    # joining a running cluster: its size is its own (Ray refuses num_cpus there), so ray_num_cpus is dropped with a
    # log line (verl/single_controller/cluster.py); it sizes a cluster the trainer starts itself (below)
    assert seen["ray_init"]["address"] == "auto" and seen["ray_init"]["num_cpus"] is None
    # ray_init.num_cpus (upstream) wins over trainer.ray_num_cpus
    ray_run = recorded_run("trainer.ray_num_cpus=3", "ray_init.num_cpus=5", "trainer.force_ray_workers=True")
    assert ray_run["ray_init"]["num_cpus"] == 5
    assert recorded_run("trainer.ray_num_cpus=3", "trainer.force_ray_workers=True")["ray_init"]["num_cpus"] == 3


def test_run_sizes_the_loaders_and_the_step_count(recorded_run):
    seen = recorded_run("trainer.total_epochs=3", "data.val_batch_size=2", "data.shuffle=False", "data.seed=11")
    sampler = seen["train_loader"].sampler
    assert (sampler.batch_size, sampler.shuffle, sampler.seed) == (2, False, 11)
    assert seen["val_loader"].sampler.batch_size == 2
    assert seen["steps"] == 2 * 3  # 4 rows / 2 per batch x 3 epochs
    assert seen["cfg"].actor_rollout_ref.actor.optim.total_training_steps == 6
    assert seen["trainer"].train_dataset.files == [recorded_run.train]
    assert seen["trainer"].val_dataset.files == [recorded_run.val]
    assert recorded_run("trainer.total_training_steps=5")["steps"] == 5


def test_run_resolves_the_engine_stream_for_the_workers(recorded_run):
    """``rollout.engine_stream: null`` reaches the workers resolved: shared here (CPU: nothing to overlap on a
    stream); a value given stands. The rule itself: ``resolve_engine_stream`` below."""
    assert recorded_run()["cfg"].actor_rollout_ref.rollout.engine_stream == "shared"
    given = recorded_run("actor_rollout_ref.rollout.engine_stream=high_priority")
    assert given["cfg"].actor_rollout_ref.rollout.engine_stream == "high_priority"


def test_engine_stream_null_is_high_priority_only_beside_training_on_a_gpu():
    from verl.workers.config.rollout import resolve_engine_stream

    assert resolve_engine_stream(None, rollout_overlap=True, uses_vllm_on_gpu=True) == "high_priority"
    assert resolve_engine_stream(None, rollout_overlap=False, uses_vllm_on_gpu=True) == "shared"
    assert resolve_engine_stream(None, rollout_overlap=True, uses_vllm_on_gpu=False) == "shared"
    assert resolve_engine_stream("shared", rollout_overlap=True, uses_vllm_on_gpu=True) == "shared"


def test_run_sets_engine_reserved_sms_to_0_with_a_warning_where_nothing_runs_beside_training(recorded_run, caplog):
    """CPU run: no vLLM on a GPU beside training, so the workers get 0 and the log says why."""
    with caplog.at_level("WARNING", logger="verl.trainer.main_ppo"):
        seen = recorded_run("actor_rollout_ref.rollout.engine_reserved_sms=16")
    assert seen["cfg"].actor_rollout_ref.rollout.engine_reserved_sms == 0
    assert (
        "actor_rollout_ref.rollout.engine_reserved_sms=16 has no effect: trainer.rollout_overlap is off" in caplog.text
    )


def test_run_turns_balance_reserved_sms_off_with_a_warning_where_nothing_runs_beside_training(recorded_run, caplog):
    with caplog.at_level("WARNING", logger="verl.trainer.main_ppo"):
        seen = recorded_run("actor_rollout_ref.rollout.balance_reserved_sms=True")
    assert seen["cfg"].actor_rollout_ref.rollout.balance_reserved_sms is False
    assert (
        "actor_rollout_ref.rollout.balance_reserved_sms=True has no effect: trainer.rollout_overlap is off"
        in caplog.text
    )


def test_run_turns_free_running_turns_off_with_a_warning_for_single_turn_rollouts(recorded_run, caplog):
    with caplog.at_level("WARNING", logger="verl.trainer.main_ppo"):
        seen = recorded_run("actor_rollout_ref.rollout.free_running_turns=True")
    assert seen["cfg"].actor_rollout_ref.rollout.free_running_turns is False  # so no generate threads either
    assert "free_running_turns=True has no effect without a multi-turn workflow" in caplog.text


def test_engine_reserved_sms_stands_only_beside_training_in_the_workers_process_on_a_gpu():
    from verl.workers.config.rollout import resolve_engine_reserved_sms as resolve

    assert resolve(16, rollout_overlap=True, uses_vllm_on_gpu=True, engine_process="worker") == (16, None)
    assert resolve(0, rollout_overlap=False, uses_vllm_on_gpu=False, engine_process="child") == (0, None)
    value, why = resolve(16, rollout_overlap=False, uses_vllm_on_gpu=True, engine_process="worker")
    assert value == 0 and "trainer.rollout_overlap is off" in why
    value, why = resolve(16, rollout_overlap=True, uses_vllm_on_gpu=False, engine_process="worker")
    assert value == 0 and "vLLM on CUDA" in why
    value, why = resolve(16, rollout_overlap=True, uses_vllm_on_gpu=True, engine_process="child")
    assert value == 0 and "rollout.engine_process=child" in why


def test_run_picks_device_and_worker_group_from_the_cluster_keys(recorded_run):
    local = recorded_run("trainer.ray_address=auto")
    assert local["wg"] == ("local", "cpu")
    assert "ray_init" not in local  # one in-process rank, naive rewards: nothing runs on Ray, none is started
    for key in ("trainer.n_gpus_per_node=2", "trainer.nnodes=2", "trainer.force_ray_workers=True"):
        seen = recorded_run(key)
        assert seen["wg"] == ("ray", "cpu") and seen["ray_init"]["address"] is None, key
    # the thread reward manager's actors live on Ray: started for it alone, too
    assert recorded_run("reward_model.reward_manager=thread")["ray_init"]["include_dashboard"] is False


def test_run_loads_the_reward_manager_and_custom_reward_function(recorded_run):
    seen = recorded_run(
        "reward_model.reward_manager=thread",
        f"custom_reward_function.path={FIXTURES / 'parity_reward.py'}",
        "custom_reward_function.name=compute_score",
    )
    (name, fn), _ = seen["reward"]
    assert name == "thread" and fn("x", "ab", None) == 1.0 and fn("x", "abc", None) == 0.0
    from verl.trainer.config_schema import ConfigError

    with pytest.raises(ConfigError, match="custom_reward_function.name='nope'"):  # refused at launch (preflight)
        recorded_run(f"custom_reward_function.path={FIXTURES / 'parity_reward.py'}", "custom_reward_function.name=nope")


def test_single_turn_dataset_follows_prompt_key_length_and_truncation(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    from verl.utils.dataset.rl_dataset import RLHFDataset

    path = tmp_path / "q.parquet"
    pd.DataFrame([{"question": [{"role": "user", "content": "a b c d e f g h"}], "data_source": "x"}]).to_parquet(path)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)

    def prompt_ids(*overrides):
        cfg = compose_config(["data.prompt_key=question", *overrides])
        return RLHFDataset([str(path)], tok, OmegaConf.to_container(cfg.data, resolve=True))[0]["raw_prompt_ids"]

    full = prompt_ids("data.max_prompt_length=1000")
    assert len(full) > 6
    assert prompt_ids("data.max_prompt_length=6", "data.truncation=left") == full[-6:]
    assert prompt_ids("data.max_prompt_length=6", "data.truncation=right") == full[:6]
    with pytest.raises(ValueError, match="data.truncation=error"):
        prompt_ids("data.max_prompt_length=6", "data.truncation=error")


# ------------------------------------------------------------------------------------------------ fit


class ScriptedTrainer:
    """What ``fit`` needs of a trainer: steps and validations are recorded, checkpoints are marker files."""

    def __init__(self, config):
        self.config, self.global_step, self.last_val_samples = config, 0, [{"answer": "a"}, {"answer": "b"}]
        from verl.trainer.config import from_config

        self.conf = from_config(config)  # the typed sections fit reads
        self.validated, self.logged, self.generations = [], [], []
        self.tracker = types.SimpleNamespace(
            log=lambda data, step: self.logged.append(step),
            log_generations=lambda samples, step: self.generations.append((step, len(samples))),
        )
        group = types.SimpleNamespace(
            save_checkpoint=lambda path: Path(path).mkdir(parents=True, exist_ok=True),
            load_checkpoint=lambda path: None,
        )
        self.groups = {"actor": group}
        self.wg = types.SimpleNamespace(sync_rollout_weights=lambda: None)

    def checkpoint_groups(self):
        return self.groups

    def train_step(self, batch, next_batch=None, upcoming=None):
        return {"critic/score/mean": 0.5}

    def validate(self, val_loader):
        self.validated.append(self.global_step)
        return {"val-core/x/reward/mean@1": 1.0}


def run_fit(tmp_path, *overrides, total_steps=4):
    from verl.trainer.ppo.fit import fit
    from verl.utils.checkpoint import CheckpointManager
    from verl.utils.dataset.sampler import ResumableDataLoader

    cfg = compose_config([f"trainer.default_local_dir={tmp_path}", *overrides])
    rows = [{"x": torch.tensor([i])} for i in range(4)]

    def collate(items):
        return {"x": torch.stack([it["x"] for it in items])}

    loader = ResumableDataLoader(rows, batch_size=1, shuffle=False, seed=0, collate_fn=collate)
    trainer = ScriptedTrainer(cfg)
    ckpt = CheckpointManager(str(tmp_path), max_ckpt_to_keep=cfg.trainer.max_actor_ckpt_to_keep)
    fit(trainer, loader, ["val batch"], ckpt, total_steps)
    return trainer, sorted(p.name for p in Path(tmp_path).glob("global_step_*"))


def test_fit_follows_save_test_and_validation_keys(tmp_path):
    trainer, saved = run_fit(
        tmp_path, "trainer.save_freq=3", "trainer.test_freq=2", "trainer.val_before_train=True", total_steps=4
    )
    assert saved == ["global_step_3", "global_step_4"]  # every 3 steps and the last
    assert trainer.validated == [0, 2, 4]  # before training, every 2 steps (4 is also the last)
    trainer, saved = run_fit(
        tmp_path / "b", "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=False"
    )
    assert saved == [] and trainer.validated == []


def test_fit_logs_validation_generations(tmp_path):
    trainer, _ = run_fit(tmp_path, "trainer.test_freq=4", "trainer.log_val_generations=1")
    assert trainer.generations == [(0, 1), (4, 1)]
    trainer, _ = run_fit(tmp_path / "b", "trainer.test_freq=4", "trainer.log_val_generations=0")
    assert trainer.generations == []


def test_fit_resume_keys_and_wall_time(tmp_path):
    _, saved = run_fit(tmp_path, "trainer.save_freq=2", "trainer.val_before_train=False", total_steps=2)
    assert saved == ["global_step_2"]
    resumed, _ = run_fit(tmp_path, "trainer.resume_mode=auto", total_steps=3)
    assert resumed.logged[0] == 3  # continued after step 2
    fresh, _ = run_fit(tmp_path, "trainer.resume_mode=disable", "trainer.val_before_train=False", total_steps=3)
    assert fresh.logged == [1, 2, 3]
    with pytest.raises(Exception, match="resume_from_path"):
        run_fit(tmp_path, "trainer.resume_mode=resume_path", total_steps=3)
    by_path, _ = run_fit(
        tmp_path, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'global_step_2'}"
    )
    assert by_path.logged[0] == 3
    # trainer.max_wall_time_s: already out of time after the first step -> stop there with a checkpoint
    stopped, saved = run_fit(tmp_path / "w", "trainer.max_wall_time_s=1e-9", "trainer.val_before_train=False")
    assert stopped.logged == [1] and saved == ["global_step_1"]


def test_fit_progress_bar_key(tmp_path, capsys):
    run_fit(tmp_path, "trainer.progress_bar=True", total_steps=2)
    assert "training" in capsys.readouterr().err
    run_fit(tmp_path / "b", "trainer.progress_bar=False", total_steps=2)
    assert "training" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ trainers


@pytest.mark.parametrize(
    "key,value,validate,field,expected",
    [
        ("actor_rollout_ref.rollout.temperature", 0.7, False, "temperature", 0.7),
        ("actor_rollout_ref.rollout.top_p", 0.9, False, "top_p", 0.9),
        ("actor_rollout_ref.rollout.top_k", 5, False, "top_k", 5),
        ("actor_rollout_ref.rollout.seed", 3, False, "seed", 3),
        ("actor_rollout_ref.rollout.val_kwargs.temperature", 0.6, True, "temperature", 0.6),
        ("actor_rollout_ref.rollout.val_kwargs.top_p", 0.8, True, "top_p", 0.8),
        ("actor_rollout_ref.rollout.val_kwargs.top_k", 7, True, "top_k", 7),
        ("actor_rollout_ref.rollout.val_kwargs.do_sample", True, True, "greedy", False),
        ("data.max_response_length", 33, False, "max_tokens", 33),
    ],
)
def test_sampling_parameters_follow_the_config(key, value, validate, field, expected):
    from verl.trainer.ppo.single_turn import single_turn_sampling

    params = single_turn_sampling(compose_config([f"{key}={value}"]), 0, validate)
    assert params[field] == expected, key


def single_turn_trainer(tiny_model_path, *overrides):
    from transformers import AutoTokenizer

    from verl.trainer.ppo.single_turn import SingleTurnPPOTrainer

    cfg = compose_config([f"actor_rollout_ref.model.path={tiny_model_path}", *overrides])
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    wg = types.SimpleNamespace(world_size=1)
    return SingleTurnPPOTrainer(cfg, tok, wg, None, None, None, None, critic_group=types.SimpleNamespace())


def test_gae_gamma_and_lam_shape_the_advantages(tiny_model_path):
    from verl import DataProto

    def advantages(*overrides):
        trainer = single_turn_trainer(tiny_model_path, "algorithm.adv_estimator=gae", *overrides)
        batch = DataProto.from_dict(
            tensors={
                "token_level_rewards": torch.tensor([[0.0, 0.0, 1.0]]),
                "response_mask": torch.ones(1, 3),
                "values": torch.tensor([[0.1, 0.2, 0.3]]),
            },
            non_tensors={"uid": ["a"]},
        )
        trainer._compute_advantages(batch)
        return batch.batch["returns"][0].tolist()

    # lam=1: returns are discounted rewards-to-go: gamma^2, gamma, 1
    assert advantages("algorithm.gamma=0.5", "algorithm.lam=1.0") == pytest.approx([0.25, 0.5, 1.0])
    assert advantages("algorithm.gamma=1.0", "algorithm.lam=1.0") == pytest.approx([1.0, 1.0, 1.0])
    # lam=0: one-step TD targets r_t + gamma * V_{t+1}
    assert advantages("algorithm.gamma=1.0", "algorithm.lam=0.0") == pytest.approx([0.2, 0.3, 1.0])


class _Generated(Exception):
    pass


def test_single_turn_trainer_generates_rollout_n_and_val_kwargs_n(tiny_model_path, monkeypatch):
    from verl import DataProto

    trainer = single_turn_trainer(
        tiny_model_path,
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=3",
        "actor_rollout_ref.rollout.val_kwargs.n=5",
    )

    def generate(batch, n, validate, step=None):
        raise _Generated((n, validate))

    monkeypatch.setattr(trainer, "generate", generate)
    with pytest.raises(_Generated) as train:
        trainer.train_step(DataProto.from_dict(tensors={"x": torch.zeros(1, 1)}))
    with pytest.raises(_Generated) as val:
        trainer.validate([{"x": torch.zeros(1, 1)}])
    assert train.value.args[0] == (3, False) and val.value.args[0] == (5, True)


# ------------------------------------------------------------------------------------------------ workflows

MEMORY_CONFIG = {
    "chunk_size": 64,
    "max_prompt_length": 100,
    "max_memorization_length": 32,
    "max_chunks": 3,
    "max_final_response_length": 16,
    "context_key": "context",
}


def test_memory_workflow_gets_its_config_and_register(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    from recurrent.workflow_provider import build_workflow

    path = write_rows(tmp_path / "m.parquet", 2)
    overrides = [
        f"actor_rollout_ref.model.path={tiny_model_path}",
        f"data.train_files={path}",
        f"data.val_files={path}",
        "data.truncation=center",
        "recurrent.enable=memory",
    ] + [f"recurrent.memory.config.{k}={v}" for k, v in MEMORY_CONFIG.items()]
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    workflow = build_workflow(compose_config(overrides), tok)
    got = workflow.train_dataset.recurrent_config
    assert {k: getattr(got, k) for k in MEMORY_CONFIG} == MEMORY_CONFIG
    assert workflow.final_response_length == 16
    for key in ("path", "name"):
        bad = compose_config(overrides + [f"recurrent.memory.{key}=no_such_{key}"])
        with pytest.raises(Exception, match=f"no_such_{key}"):
            build_workflow(bad, tok)
    asynchronous = overrides + ["actor_rollout_ref.rollout.mode=async"]
    for key in ("async_path", "async_name"):
        bad = compose_config(asynchronous + [f"recurrent.memory.{key}=no_such_{key}"])
        with pytest.raises(Exception, match=f"no_such_{key}"):
            build_workflow(bad, tok)
    bad = compose_config(asynchronous + ["recurrent.trival.async_name=no_such_name", "recurrent.enable=trival"])
    with pytest.raises(Exception, match="no_such_name"):
        build_workflow(bad, tok)
    bad = compose_config(asynchronous + ["recurrent.trival.async_path=no_such_path", "recurrent.enable=trival"])
    with pytest.raises(Exception, match="no_such_path"):
        build_workflow(bad, tok)
    bad = compose_config(asynchronous + ["recurrent.trival.config={no_such_field: 1}", "recurrent.enable=trival"])
    with pytest.raises(TypeError, match="no_such_field"):  # keyword arguments of the workflow's config class
        build_workflow(bad, tok)


class RecordingProxy(ChatCompletionProxy):
    """A chat scheduler named by ``actor_rollout_ref.rollout.chat_scheduler``."""


def test_async_manager_options(tiny_model_path, monkeypatch):
    from transformers import AutoTokenizer

    import recurrent.chat_server as chat_server
    from recurrent.async_generation_manager import build_async_manager
    from recurrent.impls import async_tool_gsm8k

    started = []
    monkeypatch.setattr(chat_server.ChatServer, "start", lambda self: started.append(self))
    cfg = compose_config(
        [
            f"actor_rollout_ref.model.path={tiny_model_path}",
            "actor_rollout_ref.rollout.mode=async",
            "recurrent.enable=tool_gsm8k",
            f"actor_rollout_ref.rollout.chat_scheduler={__name__}.RecordingProxy",
            "actor_rollout_ref.rollout.response_length=17",
            "actor_rollout_ref.rollout.chat_template=qwen2.5",
            "actor_rollout_ref.rollout.async_max_concurrency=3",
            "actor_rollout_ref.rollout.async_http_server=True",
            "recurrent.tool_gsm8k.config.max_generation_per_turn=9",
        ]
    )
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    manager = build_async_manager(cfg, tok, Replica(), async_tool_gsm8k.REGISTER)  # nothing is generated
    try:
        assert type(manager.proxy) is RecordingProxy and manager.proxy.default_max_tokens == 17
        assert manager.max_concurrency == 3 and len(started) == 1
        assert manager.proxy.template.name == "qwen2.5"
        assert manager.agent.config.max_generation_per_turn == 9
    finally:
        manager.shutdown()
    assert OmegaConf.select(cfg, "actor_rollout_ref.rollout.mode") == "async"


def test_multi_turn_trainer_turn_weighting(monkeypatch):
    """``actor.turn_weighting=trajectory`` gives the actor per-token ``loss_weights``; ``token`` (default) none."""
    import numpy as np

    from verl import DataProto
    from verl.trainer.ppo.core_algos import trajectory_token_weights
    from verl.trainer.ppo.ray_trainer import MultiConvTrainer

    def loss_weights(*overrides):
        cfg = compose_config(["algorithm.adv_estimator=grpo", "recurrent.enable=memory", *overrides])
        workflow = types.SimpleNamespace(
            train_dataset=None, val_dataset=None, build_rollout=lambda client: None, final_response_length=None
        )

        def compute_log_prob(conv):
            raise _Generated(conv.batch.get("loss_weights"))

        wg = types.SimpleNamespace(world_size=1, sleep_rollout=lambda: None, compute_log_prob=compute_log_prob)
        trainer = MultiConvTrainer(cfg, None, wg, workflow, None, None)
        traj = DataProto.from_dict(tensors={"x": torch.zeros(2, 1)}, non_tensors={"uid": ["u", "u"]})
        conv = DataProto.from_dict(tensors={"response_mask": torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])})
        sample_index = np.array([0, 0, 1])
        rollout = (traj, conv, np.array([False, True, True]), sample_index, torch.tensor([1.0, 0.0]))
        monkeypatch.setattr(trainer, "collect_rollouts", lambda *a: rollout)
        with pytest.raises(_Generated) as seen:
            trainer.train_step(None)
        return seen.value.args[0]

    assert loss_weights() is None
    weights = loss_weights("actor_rollout_ref.actor.turn_weighting=trajectory")
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    # the weights of core_algos.trajectory_token_weights (values checked in tests/test_core_algos.py)
    assert torch.equal(weights, trajectory_token_weights(np.array([0, 0, 1]), mask, "trajectory"))
    assert weights[0, 0] != weights[2, 0]
