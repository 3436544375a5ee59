"""LoRA end to end (``actor_rollout_ref.model.lora_rank > 0``, ``verl/utils/lora.py``).

* the weight sync's producer (``iter_rollout_weights``) hands over peft's own merge (``merge_and_unload``) bit for
  bit in float32, under the base model's names, no adapter tensor, and leaves the actor's weights untouched; in
  bf16 each merged weight is within one rounding of peft's merge cast to bf16;
* adapters that do not merge into an untied linear weight (an embedding, the tied ``lm_head``) and a malformed
  ``target_modules`` are refused with messages naming ``actor_rollout_ref.model.target_modules``;
* the real worker on 2 gloo ranks (FSDP2 over a peft model whose base is frozen) with the HF rollout engine, one
  PPO update: the trainable parameters are the adapters, as many as peft reports and as the optimizer holds; the
  base weights are bitwise unchanged and every ``lora_B`` moved; the engine's weights after the sync are the merged
  actor weights and its log-probs are the actor's; a checkpoint resumes the adapters, the frozen base and the Adam
  moments exactly, and the Hugging Face export is the merged model.

The vLLM engine's load of the merged weights is checked in ``tests/test_rollout_vllm.py`` (its module engine).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from omegaconf import OmegaConf

from tests.rank_processes import spawn
from tests.test_config import compose_config
from tests.test_dp_actor import make_update_data
from verl.utils.lora import is_adapter_weight, lora_merges, rollout_name
from verl.utils.model_loading import load_causal_lm
from verl.utils.rollout_weights import iter_rollout_weights, rollout_weight_bytes

pytest.importorskip("peft")

LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
WORLD = 2
RANK_ROWS = ([0, 1], [2, 3])
PROMPT = [5, 17, 42, 7, 300]


def _lora_model(path, **lora):
    return load_causal_lm(path, dtype="float32", attn_implementation="sdpa", lora={**LORA, **lora})


def _peft_merge(model) -> dict[str, torch.Tensor]:
    """The oracle: peft's merge_and_unload of a copy (the model itself stays as it is)."""
    return copy.deepcopy(model).merge_and_unload().state_dict()


@pytest.fixture(scope="module")
def trained_lora(tiny_model_path):
    """A LoRA model whose adapters are not at their initial values (B != 0)."""
    model = _lora_model(tiny_model_path)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def test_sync_hands_over_peft_merge_under_base_names(trained_lora, tiny_model_path):
    base = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa").state_dict()
    before = {k: v.clone() for k, v in trained_lora.state_dict().items()}
    pairs = [pair for bucket in iter_rollout_weights(trained_lora, bucket_bytes=1 << 16) for pair in bucket]
    merged = _peft_merge(trained_lora)
    assert [name for name, _ in pairs] == list(base) == list(merged)
    assert not any(is_adapter_weight(name) for name, _ in pairs)
    assert rollout_name("base_model.model.lm_head.base_layer.weight") == "lm_head.weight"
    assert rollout_name("encoder.base_layer.weight") == "encoder.base_layer.weight"  # not a peft name: unchanged
    adapted = {rollout_name(n) for n in lora_merges(trained_lora)}
    assert len(adapted) == 7 * 2  # q, k, v, o, gate, up, down of both layers
    for name, tensor in pairs:
        assert torch.equal(tensor, merged[name]), name
        if name in adapted:  # the merge really changed it (B != 0): the comparison is not vacuous
            assert not torch.equal(tensor, base[name]), name
    after = trained_lora.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the actor's weights are untouched
    assert rollout_weight_bytes(trained_lora) == sum(t.numel() * 4 for n, t in pairs if n != "lm_head.weight")

    bf16 = dict(pair for bucket in iter_rollout_weights(trained_lora, dtype=torch.bfloat16) for pair in bucket)
    for name, tensor in bf16.items():
        assert tensor.dtype == torch.bfloat16
        # W rounded to bf16 before the gather, the delta added in float32, the sum rounded: two roundings of
        # at most half a bf16 ulp (2^-8 relative) each, one of W and one of the merged value
        bound = (base[name].abs() + merged[name].abs()) * 2**-8
        assert torch.all((tensor.float() - merged[name]).abs() <= bound), name


@pytest.mark.parametrize(
    "targets, needle",
    [(["embed_tokens"], "(Embedding) cannot be merged"), (["lm_head"], "tied to ['base_model.model.model.embed")],
)
def test_adapters_that_do_not_merge_are_refused(tiny_model_path, targets, needle):
    model = _lora_model(tiny_model_path, target_modules=targets)
    with pytest.raises(ValueError, match="actor_rollout_ref.model.target_modules") as error:
        next(iter_rollout_weights(model))
    assert needle in str(error.value)


@pytest.mark.parametrize("value", [5, [], ["q_proj", 3]])
def test_target_modules_must_be_names(value):
    from verl.trainer.config_schema import ConfigError
    from verl.workers.config.model import ModelConfig

    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.target_modules must be 'all-linear' or"):
        ModelConfig.from_config({"path": "/m", "lora_rank": 4, "target_modules": value})
    assert ModelConfig.from_config({"path": "/m", "lora_rank": 4, "target_modules": ["q_proj"]}).lora == {
        "r": 4,
        "lora_alpha": 16,
        "target_modules": ["q_proj"],
    }


# ---------------------------------------------------------------------------------------------------- the worker
def _worker_config(model_path: str) -> dict:
    cfg = compose_config(
        [
            f"actor_rollout_ref.model.path={model_path}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.train_batch_size=1",
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.hf_max_batch_size=2",
            "data.max_prompt_length=32",
            "data.max_response_length=32",
        ]
    )
    return OmegaConf.to_container(cfg.actor_rollout_ref, resolve=True)


def _optimizer_state(worker) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(
        worker.actor_module, worker.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    return {(name, k): v.clone() for name, s in state["state"].items() for k, v in s.items()}


def _rank_main(rank: int, init_file: str, model_path: str, data_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    import verl.workers.rollout.base as rollout_base
    from verl.utils.fsdp_utils import get_full_state_dict
    from verl.workers.fsdp_workers import ActorRolloutRefWorker
    from verl.workers.rollout.base import SamplingParams

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", VERL_SC_DEVICE="cpu")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        config = _worker_config(model_path)
        worker = ActorRolloutRefWorker(config, "cpu")
        worker.init_model()
        out = {
            "sharded": worker.sharded,
            "peft_trainable": worker.actor_module.get_nb_trainable_parameters()[0],
            "optimizer_numel": sum(p.numel() for g in worker.optimizer.param_groups for p in g["params"]),
            "trainable_names": [n for n, p in worker.actor_module.named_parameters() if p.requires_grad],
            "initial": get_full_state_dict(worker.actor_module),
        }
        worker.sync_rollout_weights()
        out["engine_initial"] = {k: v.clone() for k, v in worker.rollout.model.state_dict().items()}
        data = torch.load(data_file, weights_only=False)[list(RANK_ROWS[rank])]
        out["metrics"] = worker.update_actor(data)
        out["trained"] = get_full_state_dict(worker.actor_module)
        worker.sync_rollout_weights()
        out["engine_trained"] = {k: v.clone() for k, v in worker.rollout.model.state_dict().items()}
        # the rollout's log-probs of its own greedy continuation vs the actor's (FSDP2 forward, both ranks)
        sample = worker.rollout.generate_batch([PROMPT], SamplingParams(greedy=True, max_tokens=8, logprobs=True))
        response = sample[0][0].token_ids
        with torch.no_grad():
            logits = worker.actor_module(input_ids=torch.tensor([PROMPT + response])).logits[0].float()
        actor_lp = torch.log_softmax(logits[len(PROMPT) - 1 : -1], -1).gather(1, torch.tensor(response)[:, None])[:, 0]
        out["log_probs"] = (torch.tensor(sample[0][0].log_probs), actor_lp)
        out["optimizer"] = _optimizer_state(worker)
        ckpt = os.path.join(out_dir, "ckpt")
        worker.save_checkpoint(ckpt)
        worker.shutdown_engines()

        rollout_base.get_rollout_engine = lambda name, **kwargs: None  # the resumed worker needs no engine
        resumed = ActorRolloutRefWorker(config, "cpu")
        resumed.init_model()
        out["fresh_differs"] = not all(
            torch.equal(v, out["trained"][k]) for k, v in get_full_state_dict(resumed.actor_module).items()
        )
        resumed.load_checkpoint(ckpt)
        out["resumed"] = get_full_state_dict(resumed.actor_module)
        out["resumed_optimizer"] = _optimizer_state(resumed)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def worker_run(tiny_model_path, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("lora_worker")
    base = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa")
    data_file = out_dir / "data.pt"
    torch.save(make_update_data(base, num_conv=4, seed=5), data_file)
    spawn(
        _rank_main, nprocs=WORLD, join=True, args=(str(out_dir / "init"), str(tiny_model_path), str(data_file), out_dir)
    )
    return out_dir, [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _merged_oracle(model_path, peft_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model = _lora_model(model_path)
    model.load_state_dict(peft_state)
    return _peft_merge(model)


def test_worker_trains_only_the_adapters_under_fsdp2(worker_run, tiny_model_path):
    _, results = worker_run
    reference = _lora_model(tiny_model_path)
    peft_count = reference.get_nb_trainable_parameters()[0]
    adapter_numel = sum(t.numel() for n, t in results[0]["initial"].items() if is_adapter_weight(n))
    for out in results:
        assert out["sharded"]  # 2 ranks: FSDP2 over a model with frozen base weights
        assert out["peft_trainable"] == out["optimizer_numel"] == peft_count == adapter_numel == 8192
        assert out["trainable_names"] and all(is_adapter_weight(n) for n in out["trainable_names"])
        assert out["metrics"]["actor/grad_norm"] > 0
    initial, trained = results[0]["initial"], results[0]["trained"]
    assert all(torch.equal(results[1]["trained"][k], v) for k, v in trained.items())  # one model on both ranks
    base_names = [n for n in initial if not is_adapter_weight(n)]
    assert len(base_names) == len(reference.state_dict()) - 2 * 14  # every tensor but the A and B of 14 linears
    for name in base_names:
        assert torch.equal(trained[name], initial[name]), name
    moved = [n for n in initial if "lora_B" in n and not torch.equal(trained[n], initial[n])]
    assert len(moved) == 14  # every B (zero at the start) got a gradient and moved


def test_engine_holds_the_merged_actor_weights(worker_run, tiny_model_path):
    _, results = worker_run
    base = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa").state_dict()
    merged = _merged_oracle(tiny_model_path, results[0]["trained"])
    for out in results:
        # at the start B = 0: the merged weights are the base model's, exactly
        assert list(out["engine_initial"]) == list(base)
        assert all(torch.equal(out["engine_initial"][k], v) for k, v in base.items())
        changed = 0
        for name, value in merged.items():
            torch.testing.assert_close(out["engine_trained"][name], value, atol=1e-6, rtol=0)
            changed += not torch.equal(value, base[name])
        assert changed == 14  # the adapted linears differ from the base: the comparison is not vacuous
        rollout_lp, actor_lp = out["log_probs"]
        assert len(rollout_lp) == 8
        torch.testing.assert_close(rollout_lp, actor_lp, atol=1e-4, rtol=0)


def test_checkpoint_resumes_and_exports_merged(worker_run, tiny_model_path, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl.utils.checkpoint import merge_checkpoint_to_hf

    out_dir, results = worker_run
    for out in results:
        assert out["fresh_differs"]  # the resumed worker started from other weights than it loaded
        assert set(out["resumed"]) == set(out["trained"])
        assert all(torch.equal(out["resumed"][k], v) for k, v in out["trained"].items())
        assert set(out["resumed_optimizer"]) == set(out["optimizer"]) and len(out["optimizer"]) == 3 * 28
        assert all(torch.equal(out["resumed_optimizer"][k], v) for k, v in out["optimizer"].items())
    assert (out_dir / "ckpt" / "huggingface" / "adapter_config.json").is_file()
    target = merge_checkpoint_to_hf(out_dir / "ckpt", tmp_path / "hf")
    assert not (target / "adapter_config.json").exists() and not (target / "adapter_model.safetensors").exists()
    assert AutoConfig.from_pretrained(target).tie_word_embeddings  # a plain model of the base architecture
    exported = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).state_dict()
    merged = _merged_oracle(tiny_model_path, results[0]["trained"])
    assert list(exported) == list(merged)
    for name, value in merged.items():
        torch.testing.assert_close(exported[name], value, atol=1e-6, rtol=0)
