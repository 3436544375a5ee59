"""The start-up memory estimate (verl/utils/memory_estimate.py): parameter counts against real models, byte totals
against hand-computed values, the refusal and its knobs at the 7B shape on a 141 GB GPU, and the printed table."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from verl.utils.memory_estimate import (
    GiB,
    MemoryCheckError,
    MemoryPlan,
    ModelShape,
    count_params_on_meta,
    estimate_memory,
    plan_from_config,
)
from verl.utils.memory_startup import BUDGET_KEY, LOG_PROB_BUDGET_KEYS, estimate_with_budgets, startup_memory_check

CONFIG_DIR = Path(__file__).resolve().parents[1] / "verl" / "trainer" / "config"
sys.path.insert(0, str(CONFIG_DIR.parents[2] / "benchmarks"))  # bench_common.shape_config
H200 = 141 * 10**9  # the simulated GPU of the issue (141 GB)
HOST = 128 * 10**9

QWEN25_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
QWEN25_15B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def _tiny(cls, **kw):
    base = dict(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
    )
    return cls(**{**base, **kw})


@pytest.mark.parametrize(
    "config",
    [
        _tiny(Qwen2Config, tie_word_embeddings=True),
        _tiny(Qwen2Config, tie_word_embeddings=False),
        _tiny(LlamaConfig, tie_word_embeddings=False),
        _tiny(LlamaConfig, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    ],
    ids=["qwen2-tied", "qwen2-untied", "llama", "llama-biases-tied"],
)
def test_parameter_count_equals_a_real_tiny_model(config) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    real = sum(p.numel() for p in model.parameters())  # tied lm_head counted once, as parameters() does
    shape = ModelShape.from_hf_config(config)
    assert shape.num_params == real
    # the shapes in module order, which the streamed optimizer's bucket plan follows
    assert shape.param_shapes() == [tuple(p.shape) for p in model.parameters()]


def test_other_architectures_are_counted_exactly_on_the_meta_device() -> None:
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=300, n_embd=48, n_layer=2, n_head=4)
    real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    shape = ModelShape.from_hf_config(config)
    assert shape.num_params == real and shape.extra_params != 0


@pytest.mark.parametrize("dims, known", [(QWEN25_15B, 1_543_714_304), (QWEN25_7B, 7_615_616_512)], ids=["1.5B", "7B"])
def test_parameter_count_of_qwen25_shapes_equals_meta_count(dims, known) -> None:
    config = Qwen2Config(**dims)
    assert count_params_on_meta(config) == known  # Qwen2.5-1.5B: 1.54B, Qwen2.5-7B: 7.62B
    assert ModelShape.from_hf_config(config).num_params == known


def test_lora_params_count_the_adapters_of_a_real_peft_model() -> None:
    from peft import LoraConfig, get_peft_model

    config = _tiny(Qwen2Config, tie_word_embeddings=True)
    model = get_peft_model(
        AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules="all-linear", lora_alpha=8)
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ModelShape.from_hf_config(config).lora_params(4, "all-linear") == trainable


# A small hand-checked shape: V=1000, h=64, i=128, 2 layers, 4 heads of 16, 2 KV heads, q/k/v biases, untied.
SMALL = ModelShape(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
    qkv_bias=True,
)


def test_byte_totals_of_a_small_config_match_hand_computed_values() -> None:
    # layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 + mlp 3*64*128 = 36864, biases 64+32+32, norms 2*64 -> 37120
    # root: embed 64000 + lm_head 64000 + final norm 64 = 128064;  N = 128064 + 2 * 37120 = 202304
    n = 202_304
    assert (SMALL.layer_params, SMALL.root_params, SMALL.num_params) == (37_120, 128_064, n)
    plan = MemoryPlan(
        world_size=2,
        shard_size=2,
        ranks_per_node=2,
        gradient_checkpointing=True,
        update_tokens=100,
        update_logit_tokens=40,
        log_prob_tokens=200,
        log_prob_logit_tokens=80,
        gpu_memory_utilization=0.5,
        max_model_len=64,
        optimizer_offload=True,
        host_baseline_bytes=1000,
    )
    est = estimate_memory(SMALL, plan, gpu_capacity=10**7, host_capacity=10**9)
    up = est.gpu["update"]
    assert up["actor params"] == 4 * n / 2 == 404_608
    assert up["grads"] == 4 * n / 2
    assert up["optimizer"] == 0  # optimizer_offload: the Adam states stay on the host through forward/backward
    # checkpointed: 2 layers x 2h per token + one layer of 24h + 6kv + 8i = 256 + 1536 + 192 + 1024 = 3008 per token
    assert up["activations"] == 100 * 3008
    assert up["logits"] == 40 * 1000 * 16
    # bf16 root + 2 layers gathered: 2 * (128064 + 2 * 37120); the root's gradient buffers (6 * 128064 = 768384)
    # come when activations and logits (940800) are freed: no excess here
    assert up["fsdp buffers"] == 2 * (128_064 + 74_240) == 404_608
    assert est.gpu_total("update") == 404_608 * 2 + 404_608 + 300_800 + 640_000 + 2 * GiB
    small = estimate_memory(SMALL, dataclasses.replace(plan, update_tokens=10, update_logit_tokens=4), 10**7, 10**9)
    assert small.gpu["update"]["fsdp buffers"] == 404_608 + 768_384 - 30_080 - 64_000
    step = est.gpu["step"]
    # streamed: the buckets on the GPU (here all of the 8 N / 2 bytes fit in one 256 MiB bucket) + foreach temporary
    assert step["optimizer"] == 809_216
    assert step["adam step temp"] == 4 * n / 2
    # 1,000-byte buckets over this rank's shards (half of dim 0, 8 bytes per element): the worst three neighbours are
    # the last down_proj (32 x 128 x 8 = 32,768), the three norms after it (3 x 32 x 8 = 768) and the lm_head shard
    # (500 x 64 x 8 = 256,000); with the sqrt temporary of the computing bucket (half of it) the worst is the embedding
    # shard computing next to layer 0's q_proj shard (32 x 64 x 8 = 16,384): 1.5 x 256,000 + 16,384
    small_buckets = estimate_memory(SMALL, dataclasses.replace(plan, offload_bucket_bytes=1000), 10**7, 10**9)
    assert small_buckets.gpu["step"]["optimizer"] == 32_768 + 768 + 256_000
    assert small_buckets.gpu["step"]["adam step temp"] == 1.5 * 256_000 + 16_384 - (32_768 + 768 + 256_000)
    resident = estimate_memory(SMALL, dataclasses.replace(plan, optimizer_offload=False), 10**7, 10**9)
    assert resident.gpu["step"]["optimizer"] == resident.gpu["update"]["optimizer"] == 809_216
    assert resident.gpu["rollout"]["optimizer"] == 809_216
    # vLLM: weights 2 bytes x N, the rest of 0.5 x 10^7 is KV cache; asleep (level 2) while training
    ro = est.gpu["rollout"]
    assert (ro["rollout weights"], ro["KV cache"]) == (2 * n, 5_000_000 - 2 * n)
    assert ro["optimizer"] == 0 and ro["actor params"] == 404_608
    assert "rollout weights" not in est.gpu["update"]
    assert SMALL.kv_bytes_per_token(2) == 2 * 2 * 32 * 2
    # log-prob (no grad): one layer's activations, 10 bytes per logit element
    assert est.gpu["log-prob"]["activations"] == 200 * (24 * 64 + 6 * 32 + 8 * 128)
    assert est.gpu["log-prob"]["logits"] == 80 * 1000 * 10
    # host: the offloaded Adam states (8 N / 2), the fp32 model while loading (4 N), per node x 2 ranks
    assert est.host["steady"]["optimizer (offloaded)"] == 809_216
    assert est.host["load"]["fp32 model while loading"] == 4 * n
    assert est.host_per_node == 2 * (1000 + 809_216)
    # the fused log-prob head: one [chunk, vocab] block of fp32 logits + one fp32 temporary (8 bytes), chunk_size
    # tokens at a time (fewer when the micro-batch has fewer logit tokens)
    fused = estimate_memory(SMALL, dataclasses.replace(plan, fused_logits=True, fused_chunk_size=16), 10**7, 10**9)
    assert fused.gpu["update"]["logits"] == 16 * 1000 * 8
    assert fused.gpu["log-prob"]["logits"] == 16 * 1000 * 8
    whole = estimate_memory(SMALL, dataclasses.replace(plan, fused_logits=True, fused_chunk_size=1024), 10**7, 10**9)
    assert whole.gpu["update"]["logits"] == 40 * 1000 * 8 and whole.gpu["log-prob"]["logits"] == 80 * 1000 * 8


def test_layers_kept_gathered_after_forward_count_every_layer() -> None:
    """``actor.fsdp_config.reshard_after_forward=False`` keeps every decoder layer gathered (bf16) through a pass,
    not two at a time: 2 bytes x (root + L x layer) in each training phase."""
    from tests.test_config import compose_config

    deep = dataclasses.replace(SMALL, num_layers=6)
    plan = MemoryPlan(update_tokens=100, update_logit_tokens=40, log_prob_tokens=200, log_prob_logit_tokens=80)
    resharding = estimate_memory(deep, plan, gpu_capacity=10**7)
    keeping = estimate_memory(deep, dataclasses.replace(plan, reshard_after_forward=False), gpu_capacity=10**7)
    for phase in ("update", "log-prob"):
        assert resharding.gpu[phase]["fsdp buffers"] == 2 * (128_064 + 2 * 37_120)
        assert keeping.gpu[phase]["fsdp buffers"] == 2 * (128_064 + 6 * 37_120)
    key = "actor_rollout_ref.actor.fsdp_config.reshard_after_forward"
    ref_key = "actor_rollout_ref.ref.fsdp_config.reshard_after_forward"
    default = plan_from_config(compose_config([]))
    assert (default.reshard_after_forward, default.ref_reshard_after_forward) == (True, True)
    actor_only = plan_from_config(compose_config([f"{key}=False"]))
    assert (actor_only.reshard_after_forward, actor_only.ref_reshard_after_forward) == (False, True)
    ref_only = plan_from_config(compose_config([f"{ref_key}=False"]))
    assert (ref_only.reshard_after_forward, ref_only.ref_reshard_after_forward) == (True, False)
    # the ref's pass counts the ref's choice: a ref kept gathered makes the log-prob phase the ref's
    with_ref = dataclasses.replace(plan, use_ref=True, ref_reshard_after_forward=False)
    assert estimate_memory(deep, with_ref, gpu_capacity=10**7).gpu["log-prob"]["fsdp buffers"] == 2 * (
        128_064 + 6 * 37_120
    )


def test_engine_in_a_child_process_adds_its_runtime_and_resident_memory() -> None:
    """``rollout.engine_process=child``: 1 GiB of CUDA runtime in every GPU phase and the engine process's 4 GiB
    baseline in every host phase, nothing else; the plan reads the key."""
    from tests.test_config import compose_config

    plan = MemoryPlan(max_model_len=64)
    alone = estimate_memory(SMALL, plan, gpu_capacity=10**7, host_capacity=10**9)
    child = estimate_memory(SMALL, dataclasses.replace(plan, engine_in_child=True), gpu_capacity=10**7)
    for phase, parts in alone.gpu.items():
        assert sum(child.gpu[phase].values()) - sum(parts.values()) == 2**30, phase
    for phase, parts in alone.host.items():
        assert sum(child.host[phase].values()) - sum(parts.values()) == 4 * 2**30, phase
    assert plan_from_config(compose_config([])).engine_in_child is False
    key = "actor_rollout_ref.rollout.engine_process"
    assert plan_from_config(compose_config([f"{key}=child"])).engine_in_child is True


def test_sleep_level_1_backs_rollout_weights_up_to_host_and_awake_engine_counts_while_training() -> None:
    plan = MemoryPlan(sleep_level=1, max_model_len=64)
    est = estimate_memory(SMALL, plan, gpu_capacity=10**7, host_capacity=10**9)
    assert est.host["steady"]["vLLM weight backup"] == 2 * SMALL.num_params
    awake = estimate_memory(SMALL, dataclasses.replace(plan, free_cache_engine=False), 10**7, 10**9)
    assert awake.gpu["update"]["KV cache"] == 5_000_000 - 2 * SMALL.num_params
    assert awake.host["steady"]["vLLM weight backup"] == 0


# ---------------------------------------------------------------------------------------------------- 7B on one H200
def _compose(tmp_path: Path, dims: dict, overrides: list[str]):
    model_dir = tmp_path / "model"
    Qwen2Config(**dims).save_pretrained(model_dir)  # config.json only: no weights
    base = [
        f"actor_rollout_ref.model.path={model_dir}",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "data.max_prompt_length=8192",
        "data.max_response_length=1024",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="ppo_trainer", overrides=base + overrides)


def test_7b_without_offload_is_refused_naming_optimizer_offload(tmp_path: Path, capsys) -> None:
    cfg = _compose(tmp_path, QWEN25_7B, [])
    with pytest.raises(MemoryCheckError) as err:
        startup_memory_check(cfg, "cuda", capacities=(H200, HOST))
    message = str(err.value)
    # 8 bytes x 7.62B = 60.9 GB = 56.7 GiB of Adam states beside vLLM's share during the rollout
    assert "phase 'rollout'" in message
    assert "actor optimizer states need 56.7 GiB per rank" in message
    assert "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True" in message
    assert "trainer.n_gpus_per_node" in message
    assert "lower actor_rollout_ref.rollout.gpu_memory_utilization" in message
    assert "memory estimate per rank" in capsys.readouterr().out  # the table comes first


def test_7b_with_optimizer_offload_keeps_adam_on_the_host_and_fits_one_gpu(tmp_path: Path) -> None:
    offload = ["actor_rollout_ref.actor.fsdp_config.optimizer_offload=True", "actor_rollout_ref.actor.use_kl_loss=True"]
    cfg = _compose(tmp_path, QWEN25_7B, offload + ["actor_rollout_ref.ref.fsdp_config.param_offload=True"])
    plan = plan_from_config(cfg)
    shape = ModelShape.from_hf_config(Qwen2Config(**QWEN25_7B))
    est = estimate_memory(shape, plan, H200, HOST)
    n = 7_615_616_512
    assert est.host["steady"]["optimizer (offloaded)"] / GiB == pytest.approx(56.7, abs=0.05)
    assert all(est.gpu[phase]["optimizer"] == 0 for phase in ("rollout", "update", "sync"))
    # the step streams the states: fp32 params + grads (8 bytes x 7.62B = 56.7 GiB) + three buckets (at most 256 MiB
    # or one tensor's state: the worst three are the embeddings' 4.06 GiB, layer 0's attention block and its gate_proj)
    # + the foreach temporary (worst: the embeddings' bucket computing, half of it) + the runtime allowance
    embed, attention, gate = 8 * 152064 * 3584, 8 * 29_364_736, 8 * 18944 * 3584
    assert est.gpu["step"]["optimizer"] == embed + attention + gate
    assert est.gpu["step"]["adam step temp"] == embed // 2 - gate
    assert est.gpu_total("step") == 8 * n + 1.5 * embed + attention + 2 * GiB
    assert est.problems() == []
    # host: the worker + the states; while the reference model loads (after the optimizer is built) its fp32 copy too
    assert est.host_per_rank == est.host_per_node == 4 * GiB + 8 * n + 4 * n < HOST
    startup_memory_check(cfg, "cuda", capacities=(H200, HOST))  # not refused
    # as the worker was before OffloadedAdamW (the states brought back to the GPU for the step, foreach temporary of
    # all parameters: 4 + 4 + 8 + 4 = 20 bytes x 7.62B = 141.9 GiB) the step would not fit: the message names the knob
    resident = estimate_memory(shape, dataclasses.replace(plan, optimizer_offload=False), H200, HOST)
    problems = resident.problems()
    assert resident.gpu_total("step") / GiB == pytest.approx(141.9 + 2.0, abs=0.05)
    assert "phase 'step'" in " ".join(problems) and "optimizer_offload=True (the Adam states stream" in " ".join(
        problems
    )
    # two GPUs shard the states further
    cfg2 = _compose(
        tmp_path, QWEN25_7B, ["actor_rollout_ref.actor.fsdp_config.optimizer_offload=True", "trainer.n_gpus_per_node=2"]
    )
    est2 = startup_memory_check(cfg2, "cuda", capacities=(H200, HOST))
    assert est2.problems() == [] and est2.plan.shard_size == 2


@pytest.mark.parametrize("gpus", [1, 2])
def test_fused_adamw_has_no_step_temporary_and_the_estimate_resolves_it_as_the_worker(tmp_path: Path, gpus) -> None:
    """actor_rollout_ref.actor.optim.fused (verl/utils/fsdp_utils.py::resolve_fused_adamw): null on a CUDA run is
    torch's fused AdamW, no full-size temporary in the step; foreach (False, a CPU run) adds 4 bytes x trainable
    params / shards. At the 7B shape on one H200 the resident step is then 16 x 7.62B = 113.5 GiB + 2 GiB of runtime
    (fits in 131.3 GiB) instead of 20 x 7.62B = 141.9 GiB + 2 (does not)."""
    n, fused_key = 7_615_616_512, "actor_rollout_ref.actor.optim.fused"
    shape = ModelShape.from_hf_config(Qwen2Config(**QWEN25_7B))
    plans = {}
    for name, overrides, device in [
        ("null-cuda", [], "cuda"),
        ("null-cpu", [], "cpu"),
        ("false-cuda", [f"{fused_key}=False"], "cuda"),
        ("true-cpu", [f"{fused_key}=True"], "cpu"),  # torch 2.13 fuses on CPU too
        ("offload-cuda", ["actor_rollout_ref.actor.fsdp_config.optimizer_offload=True"], "cuda"),
    ]:
        cfg = _compose(tmp_path, QWEN25_7B, [f"trainer.n_gpus_per_node={gpus}", *overrides])
        plans[name] = plan_from_config(cfg, device)
    temps = {name: plan.adam_step_temp_bytes for name, plan in plans.items()}
    assert temps == {"null-cuda": 0, "null-cpu": 4, "false-cuda": 4, "true-cpu": 0, "offload-cuda": 4}
    fused = estimate_memory(shape, plans["null-cuda"], H200, HOST)
    foreach = estimate_memory(shape, plans["false-cuda"], H200, HOST)
    assert fused.gpu["step"]["adam step temp"] == 0
    assert foreach.gpu_total("step") - fused.gpu_total("step") == 4 * n / gpus
    assert fused.gpu_total("step") == 16 * n / gpus + 2 * GiB
    step_refused = ["phase 'step'" in problem for problem in foreach.problems()]
    assert any(step_refused) == (gpus == 1)
    assert not any("phase 'step'" in problem for problem in fused.problems())


def test_startup_check_resolves_fused_adamw_with_the_run_device(tmp_path: Path, capsys) -> None:
    cfg = _compose(tmp_path, QWEN25_7B, ["trainer.memory_check=warn"])
    assert startup_memory_check(cfg, "cuda", capacities=(H200, HOST)).plan.adam_step_temp_bytes == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "adam step temp" in line)
    assert row.split()[3:] == ["-"] * 6  # no phase has the temporary
    assert startup_memory_check(cfg, "cpu", capacities=(None, HOST)).plan.adam_step_temp_bytes == 4
    row = next(line for line in capsys.readouterr().out.splitlines() if "adam step temp" in line)
    # init, rollout, log-prob, update, step, sync: 4 bytes x 7.62B = 28.4 GiB in the step only
    assert row.split()[3:] == ["-"] * 4 + [f"{4 * 7_615_616_512 / GiB:.1f}", "-"] == ["-"] * 4 + ["28.4", "-"]


def test_the_original_7b_recipe_fits_its_80gb_gpus(tmp_path: Path) -> None:
    """run_memory_7B.sh as released (4 nodes x 8 GPUs, HSDP groups of 8, param + optimizer + ref offload, vLLM at
    0.6 awake while training) is not refused on an 80 GB GPU (85.0e9 bytes as torch reports an H100/A100-80GB)."""
    from tests.test_config import script_overrides

    model_dir = tmp_path / "model"
    Qwen2Config(**QWEN25_7B).save_pretrained(model_dir)
    overrides = [o for o in script_overrides("run_memory_7B.sh", tmp_path) if "model.path=" not in o]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides + [f"actor_rollout_ref.model.path={model_dir}"])
    est = startup_memory_check(cfg, "cuda", capacities=(85_000_000_000, 2 * 10**12))
    assert est.plan.world_size == 32 and est.plan.shard_size == 8 and not est.plan.free_cache_engine
    assert est.problems() == []
    # tight, as the recipe is on its GPUs (67.4 GiB in the update: vLLM awake at 0.6, the Adam states streamed)
    assert 65 * GiB < est.gpu_peak[1] < 85_000_000_000


def test_vllm_share_too_small_for_the_weights_and_host_overflow_name_their_knobs(tmp_path: Path) -> None:
    cfg = _compose(
        tmp_path,
        QWEN25_7B,
        [
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.1",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
            "actor_rollout_ref.rollout.sleep_level=1",
            "trainer.n_gpus_per_node=8",
        ],
    )
    shape = ModelShape.from_hf_config(Qwen2Config(**QWEN25_7B))
    est = estimate_memory(shape, plan_from_config(cfg), H200, 64 * 10**9)
    text = "\n".join(est.problems())
    assert "gpu_memory_utilization=0.1 gives vLLM 13.1 GiB, less than the rollout weights (14.2 GiB)" in text
    assert "host memory: 8 rank(s) per node" in text and "sleep_level=2" in text


def test_an_fp8_kv_cache_holds_twice_the_tokens_of_a_bf16_one(tmp_path: Path) -> None:
    """``rollout.engine_kwargs.kv_cache_dtype=fp8`` halves vLLM's bytes per cached token: a share that cannot hold
    one ``max_model_len`` sequence in bf16 can in fp8, and the estimate says so (it read 2 bytes before)."""
    shape = ModelShape.from_hf_config(Qwen2Config(**QWEN25_7B))
    plans = {
        name: plan_from_config(_compose(tmp_path / name, QWEN25_7B, overrides))
        for name, overrides in {
            "default": [],
            "fp8": ["+actor_rollout_ref.rollout.engine_kwargs.kv_cache_dtype=fp8"],
            "fp8_e5m2": ["+actor_rollout_ref.rollout.engine_kwargs.kv_cache_dtype=fp8_e5m2"],
            "auto": ["+actor_rollout_ref.rollout.engine_kwargs.kv_cache_dtype=auto"],
            "hf": ["actor_rollout_ref.rollout.name=hf", "+actor_rollout_ref.rollout.engine_kwargs.kv_cache_dtype=fp8"],
        }.items()
    }
    assert {name: plan.kv_cache_dtype_bytes for name, plan in plans.items()} == {
        "default": 2, "fp8": 1, "fp8_e5m2": 1, "auto": 2, "hf": 2,
    }  # fmt: skip
    # a share leaving 1.5 x one fp8 sequence of KV cache beside the weights (0.75 x a bf16 one)
    plan = dataclasses.replace(plans["default"], max_model_len=32768)
    weights, fp8_sequence = 2 * shape.num_params, 32768 * shape.kv_bytes_per_token(1)
    gmu = (weights + 1.5 * fp8_sequence) / H200
    bf16 = estimate_memory(shape, dataclasses.replace(plan, gpu_memory_utilization=gmu), H200, HOST)
    fp8 = estimate_memory(
        shape, dataclasses.replace(plan, gpu_memory_utilization=gmu, kv_cache_dtype_bytes=1), H200, HOST
    )
    assert any("cannot hold one sequence of max_model_len=32768" in note for note in bf16.notes)
    assert not any("cannot hold one sequence" in note for note in fp8.notes)
    # a plan built by hand without the KV dtype counts the rollout dtype's bytes, as bf16 above
    unset = estimate_memory(
        shape, dataclasses.replace(plan, gpu_memory_utilization=gmu, kv_cache_dtype_bytes=None), H200, HOST
    )
    assert unset.notes == bf16.notes and MemoryPlan.kv_cache_dtype_bytes is None


def test_update_token_budget_is_named_when_activations_and_logits_overflow(tmp_path: Path) -> None:
    cfg = _compose(
        tmp_path,
        QWEN25_15B,
        [
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=400000",
            "actor_rollout_ref.rollout.free_cache_engine=True",
            "actor_rollout_ref.model.use_fused_kernels=False",  # full [tokens, vocab] fp32 logits in the update
        ],
    )
    with pytest.raises(MemoryCheckError, match=r"phase 'update'.*lower actor_rollout_ref\.actor\.ppo_max_token_len"):
        startup_memory_check(cfg, "cuda", capacities=(H200, HOST))


# ---------------------------------------------------------------------------------------------------- start-up
def test_startup_table_prints_on_cpu_without_checking(tmp_path: Path, capsys) -> None:
    cfg = _compose(tmp_path, QWEN25_7B, [])
    est = startup_memory_check(cfg, "cpu", capacities=(None, 10**9))  # 1 GB of host: CPU runs are not refused
    out = capsys.readouterr().out
    assert "CPU run: not checked" in out and "7.62B params" in out
    for row in ("actor params", "grads", "optimizer", "activations", "logits", "rollout weights", "KV cache", "total"):
        assert row in out
    assert "device capacity unknown (no GPU)" in out and "host per node" in out
    assert est is not None and est.gpu_capacity is None


def test_memory_check_warn_logs_and_off_skips(tmp_path: Path, capsys, caplog) -> None:
    cfg = _compose(tmp_path, QWEN25_7B, ["trainer.memory_check=warn"])
    with caplog.at_level(logging.WARNING, logger="verl.utils.memory_startup"):
        est = startup_memory_check(cfg, "cuda", capacities=(H200, HOST))
    assert est is not None and any("optimizer_offload=True" in r.getMessage() for r in caplog.records)
    capsys.readouterr()
    off = _compose(tmp_path, QWEN25_7B, ["trainer.memory_check=off"])
    assert startup_memory_check(off, "cuda", capacities=(H200, HOST)) is None
    assert capsys.readouterr().out == ""


def test_startup_check_reads_the_model_config_as_the_workers_load_it(tmp_path: Path, caplog) -> None:
    """``model.override_config`` reaches the estimated shape (14 of the 28 layers: 4.35B of 7.62B params); a path
    that is no local folder skips the estimate with a warning (the loader reports it properly)."""
    cfg = _compose(tmp_path, QWEN25_7B, ["trainer.memory_check=warn", "+actor_rollout_ref.model.override_config.num_hidden_layers=14"])  # fmt: skip
    full = ModelShape.from_hf_config(Qwen2Config(**QWEN25_7B))
    est = startup_memory_check(cfg, "cpu", capacities=(None, HOST))
    assert est.shape.num_layers == 14 and est.shape.num_params < full.num_params
    assert round(est.shape.num_params / 1e9, 2) == 4.35
    assert (
        est.shape.num_params
        == ModelShape.from_hf_config(Qwen2Config(**{**QWEN25_7B, "num_hidden_layers": 14})).num_params
    )
    missing = _compose(tmp_path, QWEN25_7B, [f"actor_rollout_ref.model.path={tmp_path / 'no_such_model'}"])
    with caplog.at_level(logging.WARNING, logger="verl.utils.memory_startup"):
        assert startup_memory_check(missing, "cuda", capacities=(H200, HOST)) is None
    [record] = caplog.records
    assert record.getMessage().startswith("memory estimate skipped: cannot read the model config (model path '")


def test_memory_check_key_is_validated() -> None:
    from verl.trainer.config_schema import ConfigError, validate_config

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=["trainer.memory_check=loud"])
    with pytest.raises(ConfigError, match=r"trainer\.memory_check must be one of \[error, warn, off\] \(got 'loud'\)"):
        validate_config(cfg)


def test_main_ppo_refuses_before_any_model_loads(tmp_path: Path, monkeypatch) -> None:
    """The key reaches run(): on a (simulated) 1 GiB GPU the tiny config is refused before the tokenizer loads."""
    import verl.trainer.main_ppo as main_ppo
    import verl.utils.memory_startup as memory_startup
    import verl.utils.model_loading as model_loading

    cfg = _compose(tmp_path, QWEN25_15B, ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024"])
    monkeypatch.setattr(main_ppo, "pick_device", lambda cfg: "cuda")
    monkeypatch.setattr(memory_startup, "device_capacities", lambda device: (GiB, HOST))

    def no_tokenizer(_):
        raise RuntimeError("tokenizer reached")

    monkeypatch.setattr(model_loading, "load_tokenizer", no_tokenizer)
    import verl.trainer.config_preflight as config_preflight

    # the composed config points at no data files: the launch checks are tested in test_config_preflight.py
    monkeypatch.setattr(config_preflight, "check_config", lambda cfg: None)
    with pytest.raises(MemoryCheckError, match="GPU memory per rank"):
        main_ppo.run(cfg)
    cfg.trainer.memory_check = "warn"
    with pytest.raises(RuntimeError, match="tokenizer reached"):
        main_ppo.run(cfg)


def test_gpu_capacity_comes_from_nvidia_smi_without_a_cuda_context(tmp_path: Path, monkeypatch) -> None:
    """The driver reads the GPU size from nvidia-smi (the smallest GPU), never through torch.cuda."""
    import verl.utils.memory_startup as memory_startup

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '143771\\n81559\\n'\n")  # MiB, as --format=csv,noheader,nounits prints
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: pytest.fail("torch.cuda was used"))
    gpu, host = memory_startup.device_capacities("cuda")
    assert gpu == 81559 * 2**20 and host > 0
    assert memory_startup.device_capacities("cpu")[0] is None


def test_startup_suggests_turning_gradient_checkpointing_off_only_when_that_fits(tmp_path: Path, capsys) -> None:
    """The 1.5B shape at MemAgent's 16K-token update budget on an H200: with checkpointing on, the estimate suggests
    turning it off (its peak without is printed, as estimate_memory computes it); not when the peak without it would
    pass 80% of a smaller device, and not when checkpointing is already off."""
    cfg = _compose(tmp_path, QWEN25_15B, ["actor_rollout_ref.rollout.gpu_memory_utilization=0.5"])
    est = startup_memory_check(cfg, "cuda", capacities=(H200, HOST))
    without = estimate_memory(est.shape, dataclasses.replace(est.plan, gradient_checkpointing=False), H200)
    phase, peak = without.gpu_peak
    # the update's tokens without checkpointing: 28 layers x (24 h + 6 kv + 8 i) bytes per token
    assert without.gpu["update"]["activations"] == est.plan.update_tokens * 28 * (24 * 1536 + 6 * 256 + 8 * 8960)
    assert phase == "update" and est.gpu_peak[0] == "rollout"
    hint = f"enable_gradient_checkpointing=False is estimated to fit (peak {peak / GiB:.1f} GiB ({phase}), "
    assert hint in capsys.readouterr().out
    # a device on which the peak without checkpointing passes 80% (but the config as given fits): no hint
    smaller = int(peak / 0.81)
    est_small = startup_memory_check(cfg, "cuda", capacities=(smaller, HOST))
    assert est_small.problems() == []
    assert (
        estimate_memory(
            est_small.shape, dataclasses.replace(est_small.plan, gradient_checkpointing=False), smaller
        ).gpu_peak[1]
        > 0.8 * smaller
    )
    # (a larger gradient_checkpointing_every may be suggested instead: test_hint_suggests_the_largest_every_...)
    assert "enable_gradient_checkpointing=False" not in capsys.readouterr().out
    # already off: nothing to suggest
    off = _compose(tmp_path, QWEN25_15B, ["actor_rollout_ref.model.enable_gradient_checkpointing=False"])
    startup_memory_check(off, "cuda", capacities=(H200, HOST))
    assert "hint:" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------- selective AC
def test_selective_checkpointing_activation_bytes_hand_computed(tmp_path: Path) -> None:
    """model.gradient_checkpointing_every=N: ceil(L / N) layers keep only their input (2 h), the others all their
    activations (one_layer = 24 h + 6 kv + 8 i), plus one recomputed layer. 1.5B: h 1536, kv 2 x 128, i 8960."""
    shape = ModelShape.from_hf_config(Qwen2Config(**QWEN25_15B))
    one_layer = 24 * 1536 + 6 * 256 + 8 * 8960
    assert one_layer == 110_080
    assert shape.activation_bytes_per_token(True) == 28 * 3072 + one_layer == 196_096  # every layer (N=1)
    assert shape.activation_bytes_per_token(True, 2) == 14 * 3072 + 14 * one_layer + one_layer == 1_694_208
    assert shape.activation_bytes_per_token(True, 3) == 10 * 3072 + 18 * one_layer + one_layer == 2_122_240
    assert shape.activation_bytes_per_token(False, 2) == 28 * one_layer  # without checkpointing N does nothing
    cfg = _compose(tmp_path, QWEN25_15B, ["actor_rollout_ref.model.gradient_checkpointing_every=2"])
    plan = plan_from_config(cfg)
    assert plan.gradient_checkpointing_every == 2 and plan.update_tokens == 16384 + 9216
    assert estimate_memory(shape, plan).gpu["update"]["activations"] == 25_600 * 1_694_208
    # an update that overflows with N > 1 names the key among the fixes
    problems = " ".join(estimate_memory(shape, plan, gpu_capacity=60 * GiB).problems())
    assert "phase 'update'" in problems
    assert "lower actor_rollout_ref.model.gradient_checkpointing_every (now 2)" in problems


@pytest.mark.parametrize(
    "capacity_gib, every, suggested",
    [
        (100.0, 1, "gradient_checkpointing_every=3 is estimated to fit"),  # N=3 peaks at 77.4 GiB, N=4 at 85.0
        (100.0, 2, "gradient_checkpointing_every=3 is estimated to fit"),
        (100.0, 3, None),  # already there
        (123.5, 1, "gradient_checkpointing_every=14 is estimated to fit"),  # N=27 fits: written as 14 (2 layers)
        (123.5, 14, None),
        (140.0, 1, "enable_gradient_checkpointing=False is estimated to fit"),  # off fits: 100.3 GiB < 112
        (60.0, 1, None),  # not even N=2 (67.2 GiB) fits under 48
    ],
)
def test_hint_suggests_the_largest_every_that_fits_when_off_does_not(
    tmp_path: Path, capsys, capacity_gib, every, suggested
) -> None:
    """The 1.5B shape at MemAgent's 16K-token update budget: update peaks (GiB) without checkpointing 100.3, with
    N = 1, 2, 3, 4, 14..27, 28: 31.4, 67.2, 77.4, 85.0, 97.8, 100.3 (the last above 'off': one recomputed layer)."""
    cfg = _compose(
        tmp_path,
        QWEN25_15B,
        [
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
            f"actor_rollout_ref.model.gradient_checkpointing_every={every}",
        ],
    )
    capacity = int(capacity_gib * GiB)
    est = startup_memory_check(cfg, "cuda", capacities=(capacity, HOST))
    assert est.problems() == []
    out = capsys.readouterr().out
    if suggested is None:
        assert "hint:" not in out
        return
    assert f"hint: actor_rollout_ref.model.{suggested}" in out
    if "every=" in suggested:  # its peak is the one printed and passes no 80% line; one more layer kept would
        n = int(suggested.split("every=")[1].split()[0])
        plan = dataclasses.replace(est.plan, gradient_checkpointing_every=n)
        phase, peak = estimate_memory(est.shape, plan, capacity).gpu_peak
        assert f"(peak {peak / GiB:.1f} GiB ({phase})" in out and peak <= 0.8 * capacity
        fewer = math.ceil(28 / (math.ceil(28 / n) - 1))  # the smallest N that checkpoints one layer fewer
        over = estimate_memory(est.shape, dataclasses.replace(est.plan, gradient_checkpointing_every=fewer), capacity)
        assert over.gpu_peak[1] > 0.8 * capacity


# ---------------------------------------------------------------------------------------------------- liger
def test_liger_activation_bytes_hand_computed() -> None:
    """With liger's RMSNorm (saves its bf16 input: 2 h, not 6 h, twice per layer) and SwiGLU (gate and up, not the
    SiLU output: 6 i, not 8 i): 16 h + 6 kv + 6 i per token and layer. 1.5B: h 1536, kv 2 x 128, i 8960."""
    shape = ModelShape.from_hf_config(Qwen2Config(**QWEN25_15B))
    liger_layer = 16 * 1536 + 6 * 256 + 6 * 8960
    assert liger_layer == 79_872
    assert shape.activation_bytes_per_token(False, liger=True) == 28 * liger_layer
    assert shape.activation_bytes_per_token(True, liger=True) == 28 * 3072 + liger_layer  # checkpointed inputs alike
    assert shape.activation_bytes_per_token(True, 2, liger=True) == 14 * 3072 + 14 * liger_layer + liger_layer
    # the drop predicted for the measured 1.5B update (16K-token micro-batches, no checkpointing): 12.9 GiB
    drop = 16384 * (shape.activation_bytes_per_token(False) - shape.activation_bytes_per_token(False, liger=True))
    assert round(drop / GiB, 1) == 12.9


@pytest.mark.parametrize(
    "overrides, device, types, expected",
    [
        ([], "cuda", {"qwen2"}, True),  # null on CUDA with liger installed: the workers run it
        (["actor_rollout_ref.model.use_liger=True"], "cuda", {"qwen2"}, True),
        (["actor_rollout_ref.model.use_liger=False"], "cuda", {"qwen2"}, False),
        ([], "cpu", {"qwen2"}, False),  # a CPU run never patches
        (["actor_rollout_ref.model.compile_layers=True"], "cuda", {"qwen2"}, False),  # null under compile_layers
        ([], "cuda", {"llama"}, False),  # liger has no kernels for this type
        ([], "cuda", None, False),  # liger_kernel does not import
        # an explicit True counts only where apply_liger_kernel patches (else it warns and skips)
        (["actor_rollout_ref.model.use_liger=True"], "cpu", {"qwen2"}, False),
        (["actor_rollout_ref.model.use_liger=True"], "cuda", None, False),
        (["actor_rollout_ref.model.use_liger=True"], "cuda", {"llama"}, False),
    ],
)
def test_startup_estimate_counts_liger_as_the_workers_resolve_it(
    tmp_path: Path, monkeypatch, overrides, device, types, expected
) -> None:
    import verl.utils.liger as liger

    def model_types():
        if types is None:
            raise ImportError("No module named 'liger_kernel'")
        return frozenset(types)

    monkeypatch.setattr(liger, "liger_model_types", model_types)
    cfg = _compose(tmp_path, QWEN25_15B, ["actor_rollout_ref.model.enable_gradient_checkpointing=False", *overrides])
    est = startup_memory_check(cfg, device, capacities=(H200, HOST))
    assert est.plan.liger is expected
    one_layer = (16 * 1536 + 6 * 256 + 6 * 8960) if expected else (24 * 1536 + 6 * 256 + 8 * 8960)
    assert est.gpu["update"]["activations"] == est.plan.update_tokens * 28 * one_layer
    assert est.gpu["log-prob"]["activations"] == est.plan.log_prob_tokens * one_layer


# ---------------------------------------------------------------------------------------------------- micro-batches


def _script_config(tmp_path: Path, script: str, config: Any, extra: list[str], **env: str):
    """The config a launch script composes (its DRY_RUN overrides), for a config.json of ``config``'s shape."""
    from tests.test_config import script_overrides

    model_dir = tmp_path / "model"
    config.save_pretrained(model_dir)
    overrides = [o for o in script_overrides(script, tmp_path, **env) if "model.path=" not in o]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="ppo_trainer", overrides=[*overrides, f"actor_rollout_ref.model.path={model_dir}", *extra])  # fmt: skip


def _miniature(tmp_path: Path, monkeypatch, extra: list[str], liger: bool = True):
    """run_memory_smollm2.sh's config at the 135M shape; liger resolved as on a GPU with liger-kernel (or without)."""
    from bench_common import shape_config  # benchmarks/: the project's named model shapes

    import verl.utils.liger as liger_module

    def model_types():
        if not liger:
            raise ImportError("No module named 'liger_kernel'")
        return frozenset({"llama"})

    monkeypatch.setattr(liger_module, "liger_model_types", model_types)
    script = "recipe/miniature/run_memory_smollm2.sh"
    return _script_config(
        tmp_path, script, shape_config("smollm2-135m"), extra, DATA_DIR="/data", OUT_DIR=str(tmp_path)
    )


@pytest.mark.parametrize("liger", [True, False])
@pytest.mark.parametrize("now", [32768, 16384])
def test_micro_batch_hint_suggests_64k_for_the_135m_miniature(tmp_path, monkeypatch, capsys, liger, now):
    """The miniature (135M, no checkpointing, vLLM at 0.35 awake while training) on a 140 GiB device: from its 32K
    budget, or from 16K, the largest budget that peaks under 80% is 64K (the measured 2.8x), log-probs at 128K."""
    cfg = _miniature(tmp_path, monkeypatch, [f"{BUDGET_KEY}={now}"], liger)
    est = startup_memory_check(cfg, "cuda", capacities=(140 * GiB, HOST))
    assert est.problems() == [] and est.plan.liger is liger and not est.plan.gradient_checkpointing
    assert est.shape.num_params * now < 10**13  # small for its budget (MICRO_BATCH_HINT_WORK)
    out = capsys.readouterr().out
    phase, peak = estimate_with_budgets(cfg, est, 65536, 131072).gpu_peak
    assert peak <= 0.8 * est.gpu_capacity
    assert (
        estimate_with_budgets(cfg, est, 2 * 65536, 2 * 131072).gpu_peak[1] > 0.8 * est.gpu_capacity
    )  # the next does not
    [hint] = [line for line in out.splitlines() if "hint:" in line]  # no checkpointing hint: it is off
    assert hint.startswith(
        f"  hint: {BUDGET_KEY}=65536 {LOG_PROB_BUDGET_KEYS[0]}=131072 {LOG_PROB_BUDGET_KEYS[1]}=131072 is estimated to fit "
        f"(peak {peak / GiB:.1f} GiB ({phase}), {peak / est.gpu_capacity:.0%} of the device; now {now}): "
        "small models run faster with larger micro-batches"
    )


def test_micro_batch_hint_stops_at_8x_and_keeps_checkpointing_as_configured(tmp_path, monkeypatch, capsys):
    """The miniature with checkpointing on at 16K: both hints. Checkpointing off fits at 16K; 8x the budget (131072)
    fits with checkpointing on (16x would too: the cap) but not with it off, and the line says so."""
    cfg = _miniature(tmp_path, monkeypatch, [f"{BUDGET_KEY}=16384", "actor_rollout_ref.model.enable_gradient_checkpointing=True"])  # fmt: skip
    est = startup_memory_check(cfg, "cuda", capacities=(140 * GiB, HOST))
    out = capsys.readouterr().out
    cap = 0.8 * est.gpu_capacity
    assert "hint: actor_rollout_ref.model.enable_gradient_checkpointing=False is estimated to fit" in out
    assert estimate_with_budgets(cfg, est, 16 * 16384, 32 * 16384).gpu_peak[1] < cap  # 16x fits: 8x is the cap
    assert estimate_with_budgets(cfg, est, 8 * 16384, 16 * 16384, gradient_checkpointing=False).gpu_peak[1] > cap
    phase, peak = estimate_with_budgets(cfg, est, 131072, 262144).gpu_peak
    assert (
        f"hint: {BUDGET_KEY}=131072 {LOG_PROB_BUDGET_KEYS[0]}=262144 {LOG_PROB_BUDGET_KEYS[1]}=262144 is estimated to fit (peak "
        f"{peak / GiB:.1f} GiB ({phase}), {peak / est.gpu_capacity:.0%} of the device; now 16384, with gradient "
        "checkpointing on as configured)"
    ) in out


@pytest.mark.parametrize(
    "dims, gpus", [(QWEN25_15B, 1), (QWEN25_15B, 8), (QWEN25_7B, 8)], ids=["1.5B-1gpu", "1.5B-8gpu", "7B-8gpu"]
)
def test_no_micro_batch_hint_at_the_launch_scripts_sizes(tmp_path, capsys, dims, gpus):
    """run_memory_7B.sh's sizes (16K update, 32K log-probs) on one node of H200s (the 7B does not fit one): the 1.5B
    and 7B are not small for a 16K budget. At 1.5B memory alone would allow 2x (under 80%): the work rule is what keeps it quiet."""
    cfg = _script_config(tmp_path, "run_memory_7B.sh", Qwen2Config(**dims), ["trainer.nnodes=1", f"trainer.n_gpus_per_node={gpus}"])  # fmt: skip
    est = startup_memory_check(cfg, "cuda", capacities=(H200, 2 * 10**12))  # host RAM of an 8-GPU node
    assert est.problems() == [] and est.plan.update_tokens == 16384 + 9216 and est.plan.log_prob_tokens == 32768 + 9216
    assert BUDGET_KEY not in capsys.readouterr().out
    if dims is QWEN25_15B:
        assert estimate_with_budgets(cfg, est, 32768, 65536).gpu_peak[1] < 0.8 * H200


def test_no_micro_batch_hint_on_cpu_without_dynamic_batches_or_past_80_percent(tmp_path, monkeypatch, capsys):
    """No hint on a CPU run, with row-count micro-batches, or where 2x the budget passes 80% of the GPU (the
    miniature on an 80 GB GPU, 85.0e9 bytes: vLLM's 0.35 share shrinks with it and 64K peaks at 88%)."""
    cfg = _miniature(tmp_path, monkeypatch, [])
    est = startup_memory_check(cfg, "cuda", capacities=(85_000_000_000, HOST))
    assert est.problems() == []
    assert 0.8 < estimate_with_budgets(cfg, est, 65536, 131072).gpu_peak[1] / est.gpu_capacity < 0.9
    assert "hint:" not in capsys.readouterr().out
    startup_memory_check(cfg, "cpu", capacities=(140 * GiB, HOST))
    assert "hint:" not in capsys.readouterr().out
    rows = _miniature(tmp_path, monkeypatch, ["actor_rollout_ref.actor.use_dynamic_bsz=False", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])  # fmt: skip
    est = startup_memory_check(rows, "cuda", capacities=(140 * GiB, HOST))
    assert est.problems() == [] and est.gpu_peak[1] < 0.5 * 140 * GiB  # room to spare, but no token budget to raise
    assert "hint:" not in capsys.readouterr().out
