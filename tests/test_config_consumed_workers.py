"""Config keys reach the objects the workers build (evidence for tests/test_config_contract.py's CONSUMED table).

One actor/rollout/ref worker and one critic worker are built for real on CPU (tiny Qwen2 model) from the composed
YAML with every key below set away from its default; each case checks that the value arrived where it acts: the
actor's or critic's settings (what ``dp_actor``/``dp_critic`` read), the optimizer, the model loader's arguments,
the rollout engine's arguments. A key that stops reaching its object fails its case.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_config import compose_config

# key (override) -> (value given, attribute of the built ActorSettings, expected value there)
ACTOR_SETTINGS = {
    "actor_rollout_ref.actor.ppo_mini_batch_size": (2, "ppo_mini_batch_size", 2),
    "actor_rollout_ref.actor.train_batch_size": (6, "train_batch_size", 6),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (3, "ppo_micro_batch_size_per_gpu", 3),
    "actor_rollout_ref.actor.use_dynamic_bsz": (True, "use_dynamic_bsz", True),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": (4096, "ppo_max_token_len_per_gpu", 4096),
    "actor_rollout_ref.actor.grad_clip": (0.5, "grad_clip", 0.5),
    "actor_rollout_ref.actor.clip_ratio": (0.25, "clip_ratio", 0.25),
    "actor_rollout_ref.actor.clip_ratio_low": (0.15, "clip_low", 0.15),
    "actor_rollout_ref.actor.clip_ratio_high": (0.28, "clip_high", 0.28),
    "actor_rollout_ref.actor.clip_ratio_c": (4.0, "clip_ratio_c", 4.0),
    "actor_rollout_ref.actor.loss_agg_mode": ("seq-mean-token-mean", "loss_agg_mode", "seq-mean-token-mean"),
    "actor_rollout_ref.actor.entropy_coeff": (0.01, "entropy_coeff", 0.01),
    "actor_rollout_ref.actor.calculate_entropy": (True, "calculate_entropy", True),
    "actor_rollout_ref.actor.use_kl_loss": (True, "use_kl_loss", True),
    "actor_rollout_ref.actor.kl_loss_coef": (0.02, "kl_loss_coef", 0.02),
    "actor_rollout_ref.actor.kl_loss_type": ("mse", "kl_loss_type", "mse"),
    "actor_rollout_ref.actor.ppo_epochs": (2, "ppo_epochs", 2),
    "actor_rollout_ref.actor.shuffle": (True, "shuffle", True),
    "actor_rollout_ref.model.use_remove_padding": (True, "use_remove_padding", True),
    "actor_rollout_ref.model.share_prompts": (False, "share_prompts", False),
}
# key -> (value given, keyword of load_causal_lm, expected value there)
MODEL_LOADER = {
    "actor_rollout_ref.model.attn_implementation": ("eager", "attn_implementation", "eager"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": (False, "gradient_checkpointing", False),
    "actor_rollout_ref.model.gradient_checkpointing_every": (2, "gradient_checkpointing_every", 2),
    "actor_rollout_ref.model.share_prompts": (False, "share_prompts", False),
    "actor_rollout_ref.model.use_liger": (True, "use_liger", True),
    "actor_rollout_ref.model.lora_rank": (4, "lora", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}),
    "actor_rollout_ref.model.lora_alpha": (8, "lora", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}),
    "actor_rollout_ref.model.target_modules": (
        ["q_proj"],
        "lora",
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
    ),
}
# key -> (value given, keyword of get_rollout_engine("vllm", ...), expected value there)
ROLLOUT_ENGINE = {
    "actor_rollout_ref.rollout.name": ("vllm", "name", "vllm"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": (0.3, "gpu_memory_utilization", 0.3),
    "actor_rollout_ref.rollout.enforce_eager": (False, "enforce_eager", False),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": (1, "tensor_parallel_size", 1),
    "actor_rollout_ref.rollout.max_num_batched_tokens": (1234, "max_num_batched_tokens", 1234),
    "actor_rollout_ref.rollout.max_num_seqs": (77, "max_num_seqs", 77),
    "actor_rollout_ref.rollout.seed": (5, "seed", 5),
    "actor_rollout_ref.rollout.engine_stream": ("high_priority", "engine_stream", "high_priority"),
    "data.max_prompt_length": (100, "max_model_len", 128),  # rollout.prompt_length follows it
    "data.max_response_length": (28, "max_model_len", 128),  # rollout.response_length follows it
}
OPTIMIZER = {
    "actor_rollout_ref.actor.optim.lr": (3e-6, "lr", 3e-6),
    "actor_rollout_ref.actor.optim.weight_decay": (0.05, "weight_decay", 0.05),
    "actor_rollout_ref.actor.optim.betas": ([0.8, 0.9], "betas", (0.8, 0.9)),
    # True: torch's fused AdamW on the CPU workers (null there = torch's default, defaults["fused"] None)
    "actor_rollout_ref.actor.optim.fused": (True, "fused", True),
}
CRITIC_SETTINGS = {
    "critic.ppo_mini_batch_size": (2, "ppo_mini_batch_size", 2),
    "critic.ppo_micro_batch_size_per_gpu": (3, "ppo_micro_batch_size_per_gpu", 3),
    "critic.forward_micro_batch_size_per_gpu": (5, "forward_micro_batch_size_per_gpu", 5),
    "critic.use_dynamic_bsz": (True, "use_dynamic_bsz", True),
    "critic.ppo_max_token_len_per_gpu": (2048, "ppo_max_token_len_per_gpu", 2048),
    "critic.forward_max_token_len_per_gpu": (1024, "forward_max_token_len_per_gpu", 1024),
    "critic.ppo_epochs": (3, "ppo_epochs", 3),
    "critic.shuffle": (True, "shuffle", True),
    "critic.grad_clip": (0.3, "grad_clip", 0.3),
    "critic.cliprange_value": (0.7, "cliprange_value", 0.7),
    "critic.model.use_remove_padding": (True, "use_remove_padding", True),
    "critic.seed": (3, "seed", 3),
}
CRITIC_OPTIMIZER = {
    "critic.optim.lr": (2e-5, "lr", 2e-5),
    "critic.optim.weight_decay": (0.07, "weight_decay", 0.07),
    "critic.optim.betas": ([0.8, 0.95], "betas", (0.8, 0.95)),
    "critic.optim.fused": (True, "fused", True),
}


def _override(key: str, value) -> str:
    if isinstance(value, bool):
        value = str(value)
    elif isinstance(value, list):
        value = "[" + ",".join(str(v) for v in value) + "]"
    return f"{key}={value}"


@pytest.fixture(scope="module")
def actor_build(tiny_model_path):
    """An ActorRolloutRefWorker from the YAML with every key above changed; the loader's and engine's arguments."""
    import verl.utils.model_loading as model_loading
    import verl.workers.rollout.base as rollout_base
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    loads, engines = [], []
    real_load = model_loading.load_causal_lm

    def load(path, **kwargs):
        loads.append(kwargs)
        return real_load(path, **kwargs)

    overrides = [
        f"actor_rollout_ref.model.path={tiny_model_path}",
        "data.train_batch_size=6",
        "actor_rollout_ref.actor.seed=9",
    ]
    for table in (ACTOR_SETTINGS, MODEL_LOADER, ROLLOUT_ENGINE, OPTIMIZER):
        overrides += [
            _override(key, value)
            for key, (value, _, _) in table.items()
            if key != "actor_rollout_ref.actor.train_batch_size" and _override(key, value) not in overrides
        ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_loading, "load_causal_lm", load)
        mp.setattr(rollout_base, "get_rollout_engine", lambda name, **kw: engines.append({"name": name, **kw}))
        cfg = compose_config(overrides)
        worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, "cpu")
        worker.init_model()
    return worker, loads, engines


@pytest.mark.parametrize("key", list(ACTOR_SETTINGS))
def test_actor_settings_follow_the_config(actor_build, key):
    worker, _, _ = actor_build
    _, attr, expected = ACTOR_SETTINGS[key]
    assert getattr(worker.actor.settings, attr) == expected, key


def test_actor_seed_reaches_the_actor_settings(actor_build):
    worker, _, _ = actor_build
    assert worker.actor.settings.seed == 9


def test_ref_model_gets_the_actor_settings_and_its_own_keys(actor_build):
    worker, loads, _ = actor_build
    assert worker.ref is not None and len(loads) == 2  # use_kl_loss builds the reference model
    assert worker.ref.settings.kl_loss_type == "mse" and worker.ref.settings.use_dynamic_bsz


@pytest.mark.parametrize("key", list(MODEL_LOADER))
def test_model_keys_reach_the_loader(actor_build, key):
    _, loads, _ = actor_build
    _, kwarg, expected = MODEL_LOADER[key]
    value = loads[0][kwarg]
    if kwarg == "lora":
        value = {k: (list(v) if not isinstance(v, (str, int)) else v) for k, v in value.items()}
    assert value == expected, key
    assert loads[1]["attn_implementation"] == "eager"  # the reference model too
    assert loads[1]["use_liger"] is True  # the reference model runs the actor's kernels (verl passes it to both)


def test_use_remove_padding_reaches_the_loader(actor_build):
    """The loader picks the attention for packed rows (flex_attention on CUDA without flash-attn), actor and ref."""
    _, loads, _ = actor_build
    assert [load["remove_padding"] for load in loads] == [True, True]


@pytest.mark.parametrize("key", list(ROLLOUT_ENGINE))
def test_rollout_keys_reach_the_engine(actor_build, key):
    _, _, engines = actor_build
    _, kwarg, expected = ROLLOUT_ENGINE[key]
    assert engines[-1][kwarg] == pytest.approx(expected), key


@pytest.mark.parametrize("key", list(OPTIMIZER))
def test_optimizer_follows_the_config(actor_build, key):
    worker, _, _ = actor_build
    _, name, expected = OPTIMIZER[key]
    group = worker.optimizer.param_groups[0]
    if isinstance(expected, bool):  # optim.fused: exactly True (approx would take 1)
        assert group[name] is expected and worker.optimizer.defaults[name] is expected, key
        return
    assert (tuple(group[name]) if name == "betas" else group[name]) == pytest.approx(expected), key


def test_max_model_len_dtype_and_sleep_mode_reach_the_engine(actor_build, monkeypatch):
    """``max_model_len`` wins over prompt + response; ``dtype`` and ``free_cache_engine`` act on GPU engines."""
    import verl.workers.rollout.base as rollout_base

    worker, _, _ = actor_build
    engines = []
    monkeypatch.setattr(rollout_base, "get_rollout_engine", lambda name, **kw: engines.append(kw))
    rc = worker.config.rollout
    monkeypatch.setitem(rc, "max_model_len", 999)
    monkeypatch.setitem(rc, "dtype", "float16")
    monkeypatch.setitem(rc, "free_cache_engine", False)
    monkeypatch.delitem(worker.__dict__, "_conf", raising=False)  # re-read the typed config (restored after)
    monkeypatch.setattr(worker, "device_name", "cuda")
    worker._init_rollout()
    assert engines[-1]["max_model_len"] == 999
    assert engines[-1]["dtype"] == "float16" and engines[-1]["enable_sleep_mode"] is False


def test_engine_process_child_builds_the_engine_in_a_child_process(actor_build, monkeypatch):
    """``engine_process=child``: the worker builds a ChildProcessEngine with the engine's name and the arguments the
    engine would get in process (``worker``, the default: get_rollout_engine itself)."""
    import verl.workers.rollout.base as rollout_base
    import verl.workers.rollout.child_process as child_process

    worker, _, _ = actor_build
    in_process, children = [], []
    monkeypatch.setattr(rollout_base, "get_rollout_engine", lambda name, **kw: in_process.append((name, kw)))
    monkeypatch.setattr(child_process, "ChildProcessEngine", lambda name, kw: children.append((name, kw)))
    worker._init_rollout()
    monkeypatch.setitem(worker.config.rollout, "engine_process", "child")
    monkeypatch.delitem(worker.__dict__, "_conf", raising=False)  # re-read the typed config (restored after)
    worker._init_rollout()
    assert len(in_process) == 1 and len(children) == 1
    assert children[0] == in_process[0] and children[0][1]["max_model_len"] > 0


def test_phase_peaks_read_what_the_rollout_engine_released(actor_build, monkeypatch):
    """perf/max_memory_in_use_gb/<phase> subtracts what the sleeping vLLM engine released: the worker's PhasePeaks
    read ``released_bytes`` of its engine (0 for an engine without it, e.g. the HF engine)."""
    from types import SimpleNamespace

    worker, _, _ = actor_build
    monkeypatch.setattr(worker, "rollout", SimpleNamespace(released_bytes=7 * 2**30))
    assert worker.phase_peaks.released() == 7 * 2**30
    monkeypatch.setattr(worker, "rollout", SimpleNamespace())
    assert worker.phase_peaks.released() == 0


def test_gil_switch_interval_is_set_for_the_worker_process(actor_build, monkeypatch):
    """``gil_switch_interval_ms``: Python's switch interval of the worker process (null keeps it)."""
    import sys

    import verl.workers.rollout.base as rollout_base

    worker, _, _ = actor_build
    monkeypatch.setattr(rollout_base, "get_rollout_engine", lambda name, **kw: None)
    before = sys.getswitchinterval()
    try:
        worker._init_rollout()  # the default (null) leaves it
        assert sys.getswitchinterval() == before
        monkeypatch.setitem(worker.config.rollout, "gil_switch_interval_ms", 0.5)
        monkeypatch.delitem(worker.__dict__, "_conf", raising=False)  # re-read the typed config (restored after)
        worker._init_rollout()
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)


def test_engine_reserved_sms_reaches_the_actor_and_ref_micro_batch_scope(actor_build, monkeypatch):
    """``engine_reserved_sms``: the worker's TrainingSMs keeps the configured count and the actor and reference
    model enter its scope around each micro-batch; it partitions only while a generation is in flight (on this CPU
    worker, with no device, never)."""
    from verl.workers.training_sms import TrainingSMs

    worker, _, _ = actor_build
    for model in (worker.actor, worker.ref):  # init_model handed both the worker's scope
        assert model.micro_batch_scope.__func__ is TrainingSMs.scope
        assert model.micro_batch_scope.__self__ is worker.training_sms
    monkeypatch.setitem(worker.config.rollout, "engine_reserved_sms", 24)
    monkeypatch.delitem(worker.__dict__, "_conf", raising=False)  # re-read the typed config (restored after)
    monkeypatch.delitem(worker.__dict__, "training_sms", raising=False)
    sms = worker.training_sms
    assert sms.reserved == 24 and sms.device is None and not sms.enabled
    assert not sms.busy()
    with worker.rollout_guard.generating():
        assert sms.busy()
    # balance_reserved_sms: the trainer moves the worker's split (the one its models' scopes are) between steps
    assert worker.shift_engine_reserved_sms(8) == 32 and sms.reserved == 32
    assert worker.shift_engine_reserved_sms(-40) == 0 and sms.reserved == 0  # clamped at 0


def test_engine_stream_off_cuda_warns_that_it_does_nothing(actor_build, monkeypatch, caplog):
    """``engine_stream`` acts on vLLM on CUDA only: on this CPU worker the fixture's high_priority is reported."""
    import verl.workers.rollout.base as rollout_base

    worker, _, _ = actor_build
    monkeypatch.setattr(rollout_base, "get_rollout_engine", lambda name, **kw: None)
    with caplog.at_level("WARNING"):
        worker._init_rollout()
    assert "actor_rollout_ref.rollout.engine_stream=high_priority has no effect here" in caplog.text
    assert "(rollout.name=vllm, device cpu)" in caplog.text
    caplog.clear()
    monkeypatch.setattr(worker, "device_name", "cuda")
    with caplog.at_level("WARNING"):
        worker._init_rollout()
    assert "engine_stream" not in caplog.text


def test_hf_engine_batch_rows(actor_build, monkeypatch):
    """``actor_rollout_ref.rollout.hf_max_batch_size``: rows of the HF engine's KV cache."""
    import verl.workers.rollout.base as rollout_base

    worker, _, _ = actor_build
    engines = []
    monkeypatch.setattr(rollout_base, "get_rollout_engine", lambda name, **kw: engines.append(kw))
    rc = worker.config.rollout
    monkeypatch.setitem(rc, "name", "hf")
    monkeypatch.setitem(rc, "hf_max_batch_size", 5)
    monkeypatch.delitem(worker.__dict__, "_conf", raising=False)  # re-read the typed config (restored after)
    worker._init_rollout()
    assert engines[-1]["max_batch_size"] == 5


def test_offload_keys_move_the_models_on_gpu(actor_build, monkeypatch):
    """``{actor,ref}.fsdp_config.param_offload`` (GPU only): which modules ``_resident`` brings in and parks again;
    ``actor.fsdp_config.optimizer_offload``: the actor's optimizer is the host-resident ``OffloadedAdamW`` (nothing
    for ``_resident`` to move)."""
    import verl.utils.fsdp_utils as fsdp_utils
    from verl.utils.offload_optim import OffloadedAdamW

    worker, _, _ = actor_build
    moved = []
    for name in (
        "load_fsdp_model_to_gpu",
        "offload_fsdp_model_to_cpu",
        "load_fsdp_optimizer",
        "offload_fsdp_optimizer",
    ):
        monkeypatch.setattr(fsdp_utils, name, lambda obj, device=None, _n=name: moved.append((_n, obj)))
    monkeypatch.setattr(worker, "device_name", "cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # a CPU machine: only the device's name is used
    monkeypatch.delitem(worker.__dict__, "_conf", raising=False)  # restored after the test
    cfg = worker.config
    monkeypatch.setitem(cfg.actor.optim, "fused", None)  # the fixture's True is refused with optimizer_offload
    for flags in ((True, False, False), (False, True, False), (False, False, True)):
        monkeypatch.setitem(cfg.actor.fsdp_config, "param_offload", flags[0])
        monkeypatch.setitem(cfg.actor.fsdp_config, "optimizer_offload", flags[1])
        monkeypatch.setitem(cfg.ref.fsdp_config, "param_offload", flags[2])
        worker.__dict__.pop("_conf", None)  # re-read the typed config
        moved.clear()
        with worker._resident("actor"):
            pass
        with worker._resident("ref"):
            pass
        names = [(n, obj is worker.actor_module, obj is worker.ref.actor_module) for n, obj in moved]
        expected = {
            (True, False, False): [("load_fsdp_model_to_gpu", True, False), ("offload_fsdp_model_to_cpu", True, False)],
            (False, True, False): [],
            (False, False, True): [("load_fsdp_model_to_gpu", False, True), ("offload_fsdp_model_to_cpu", False, True)],
        }[flags]
        assert names == expected, flags
        optimizer, _ = worker._build_optimizer(worker.actor_module)
        assert isinstance(optimizer, OffloadedAdamW) == flags[1], flags
        assert type(optimizer) is (OffloadedAdamW if flags[1] else torch.optim.AdamW)


@pytest.fixture(scope="module")
def critic_build(tiny_model_path):
    import verl.workers.critic.critic_worker as critic_worker

    loads = []
    real_load = critic_worker.load_value_model

    def load(path, **kwargs):
        loads.append(kwargs)
        return real_load(path, **kwargs)

    overrides = [f"actor_rollout_ref.model.path={tiny_model_path}", f"critic.model.path={tiny_model_path}"]
    overrides += ["critic.model.enable_gradient_checkpointing=False", "data.train_batch_size=6"]
    for table in (CRITIC_SETTINGS, CRITIC_OPTIMIZER):
        overrides += [_override(key, value) for key, (value, _, _) in table.items()]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(critic_worker, "load_value_model", load)
        cfg = compose_config(overrides)
        worker = critic_worker.CriticWorker(cfg.critic, "cpu")
        worker.init_model()
    return worker, loads


@pytest.mark.parametrize("key", list(CRITIC_SETTINGS))
def test_critic_settings_follow_the_config(critic_build, key):
    worker, _ = critic_build
    _, attr, expected = CRITIC_SETTINGS[key]
    assert getattr(worker.critic.settings, attr) == expected, key


@pytest.mark.parametrize("key", list(CRITIC_OPTIMIZER))
def test_critic_optimizer_follows_the_config(critic_build, key):
    worker, _ = critic_build
    _, name, expected = CRITIC_OPTIMIZER[key]
    if isinstance(expected, bool):  # critic.optim.fused
        assert worker.optimizer.param_groups[0][name] is expected and worker.optimizer.defaults[name] is expected
        return
    assert worker.optimizer.param_groups[0][name] == pytest.approx(expected), key


def test_critic_model_keys_reach_the_loader(critic_build, tiny_model_path):
    worker, loads = critic_build
    assert loads[0]["gradient_checkpointing"] is False and worker.model_path == str(tiny_model_path)
    assert loads[0]["remove_padding"] is True  # critic.model.use_remove_padding: the attention for packed rows


def test_critic_seed_sets_the_value_head(tiny_model_path):
    """``critic.seed``: the new value head's initialisation (the same on every rank)."""
    from verl.workers.critic.critic_worker import CriticWorker

    heads = []
    for seed in (3, 3, 4):
        cfg = compose_config(
            [
                f"actor_rollout_ref.model.path={tiny_model_path}",
                f"critic.model.path={tiny_model_path}",
                "critic.ppo_micro_batch_size_per_gpu=1",
                f"critic.seed={seed}",
            ]
        )
        worker = CriticWorker(cfg.critic, "cpu")
        worker.init_model()
        heads.append(torch.cat([p.detach().flatten() for p in worker.critic_module.parameters()]))
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])


def test_critic_warmup_steps_reach_the_critic_schedule():
    """``critic.optim.lr_warmup_steps``: the critic's own section builds its schedule (3 warm-up steps vs none)."""
    from verl.trainer.config import from_config
    from verl.utils.fsdp_utils import build_optim_and_scheduler

    def lrs(*overrides):
        cfg = compose_config(["critic.optim.lr=1.0", "critic.optim.total_training_steps=10", *overrides])
        optimizer, scheduler = build_optim_and_scheduler(torch.nn.Linear(2, 2), from_config(cfg).critic.optim)
        out = []
        for _ in range(4):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    assert lrs("critic.optim.lr_warmup_steps=-1") == [1.0, 1.0, 1.0, 1.0]
    warm = lrs("critic.optim.lr_warmup_steps=3")
    assert warm[0] < warm[1] < warm[2] <= warm[3] == pytest.approx(1.0)
