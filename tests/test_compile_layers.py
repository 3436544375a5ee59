"""``actor_rollout_ref.model.compile_layers``: each decoder layer ``torch.compile``-d in place gives the eager numbers.

What is checked (CPU, float32, the tiny Qwen2 model, packed rows through ``forward_response_log_probs``):

* sdpa, with and without gradient checkpointing: the log-probs and every parameter gradient of one backward equal
  the eager model's to 1e-5 over four packed lengths (100 to 300 tokens), and the compiled layers (two, sharing
  their code) make 1 graph in all (``dynamic=True``: the length is symbolic from the first call);
* LoRA (peft adapters inside the compiled layers): the same, for the adapter gradients, in 2 graphs (the first
  layer's input does not require grad: the embeddings are frozen);
* flex_attention with our BlockMask: the log-probs (no gradient: flex_attention has no backward on CPU, compiled
  or not) equal eager at static shapes; with dynamic shapes (``compile_layers``) it is refused on CPU and on CUDA
  (where inductor fails to lower it for Qwen2.5-1.5B, torch 2.11), at load time and at config validation
  (``trainer.device=cpu`` and ``cuda``), naming the keys and the way out (torch_varlen or sdpa);
* FSDP2 (one gloo rank, sharded after the compile as the worker does) with gradient checkpointing and the fused
  log-prob head: log-probs and gradients equal the eager unsharded model's to 1e-5, in 2 graphs;
* the key reaches the actor and the ref model the worker builds (``ActorRolloutRefWorker.init_model``): their
  layers are compiled; off by default.
"""

from __future__ import annotations

import pytest
import torch

from tests.packed_batches import RESPONSE_LENGTH, padded_batch
from verl.utils.compile_layers import KEY, compile_decoder_layers, decoder_layers, is_compiled, unsupported
from verl.utils.model_loading import load_causal_lm
from verl.workers.actor.forward import forward_response_log_probs

TOTALS = [100, 140, 60, 300]  # packed lengths of the micro-batches, in tokens


def _batch(call: int, total: int):
    lengths = [total // 3, total // 3, total - 2 * (total // 3)]
    return padded_batch(lengths, seed=call)


def _step(model, batch, backward: bool, **kwargs):
    """Packed log-probs of one micro-batch and, when ``backward``, the gradients of their sum (full tensors)."""
    from torch.distributed.tensor import DTensor

    input_ids, attention_mask, position_ids = batch
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(backward):
        log_probs, _ = forward_response_log_probs(
            model, input_ids, attention_mask, position_ids, RESPONSE_LENGTH, use_remove_padding=True, **kwargs
        )
    grads = {}
    if backward:
        (log_probs * attention_mask[:, -RESPONSE_LENGTH:]).sum().backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
    return log_probs.detach(), grads


def _pair(path, compile_dynamic, **kwargs):
    """An eager model and a copy with compiled layers (same weights)."""
    eager = load_causal_lm(path, dtype="float32", **kwargs)
    compiled = load_causal_lm(path, dtype="float32", **kwargs)
    compiled.load_state_dict(eager.state_dict())
    assert compile_decoder_layers(compiled, dynamic=compile_dynamic) == len(decoder_layers(compiled)) == 2
    assert list(compiled.state_dict()) == list(eager.state_dict())  # in place: checkpoints and weight sync unchanged
    return eager.train(), compiled.train()


def _compare(eager, compiled, totals, backward: bool) -> dict:
    """Run both models over ``totals``; returns the largest differences and the number of compiled graphs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    worst = {"log_probs": 0.0, "grads": 0.0}
    for call, total in enumerate(totals):
        batch = _batch(call, total)
        (lp_e, g_e), (lp_c, g_c) = _step(eager, batch, backward), _step(compiled, batch, backward)
        assert int(batch[1].sum()) == total and lp_e.abs().sum() > 0
        torch.testing.assert_close(lp_c, lp_e, rtol=0, atol=1e-5)
        worst["log_probs"] = max(worst["log_probs"], (lp_c - lp_e).abs().max().item())
        assert g_c.keys() == g_e.keys() and (len(g_e) > 0) == backward
        for name in g_e:
            torch.testing.assert_close(g_c[name], g_e[name], rtol=0, atol=1e-5, msg=name)
            worst["grads"] = max(worst["grads"], (g_c[name] - g_e[name]).abs().max().item())
    worst["graphs"] = counters["stats"]["unique_graphs"]
    worst["graph_breaks"] = sum(counters["graph_break"].values())
    return worst


@pytest.mark.parametrize("grad_ckpt", [False, True], ids=["plain", "grad_ckpt"])
def test_sdpa_log_probs_and_gradients_match_eager(tiny_model_path, grad_ckpt):
    eager, compiled = _pair(tiny_model_path, True, attn_implementation="sdpa", gradient_checkpointing=grad_ckpt)
    worst = _compare(eager, compiled, TOTALS, backward=True)
    # measured: log-probs within 1e-6, gradients within 2e-6; one graph for both layers and all four lengths
    assert worst["graphs"] == 1 and worst["graph_breaks"] == 0, worst


def test_lora_adapters_inside_compiled_layers(tiny_model_path):
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    eager, compiled = _pair(tiny_model_path, True, attn_implementation="sdpa", lora=lora)
    assert any("lora_A" in name for name, p in compiled.named_parameters() if p.requires_grad)
    worst = _compare(eager, compiled, TOTALS, backward=True)
    # 2 graphs, whatever the number of layers: the first layer's input does not require grad (frozen embeddings),
    # the later layers' inputs do (requires_grad is part of the guard)
    assert worst["graphs"] == 2 and worst["graph_breaks"] == 0, worst


def test_flex_attention_block_mask_static_shapes(tiny_model_path):
    eager, compiled = _pair(tiny_model_path, False, attn_implementation="flex_attention")
    # 100, 140 and 60 tokens all pad to 256 (two flex blocks): one shape, no recompilation
    worst = _compare(eager.eval(), compiled.eval(), TOTALS[:3], backward=False)
    assert worst["graphs"] <= 2, worst  # measured 2: the layer graph split around the attention call


@pytest.mark.parametrize("on_cuda", [False, True], ids=["cpu", "cuda"])
def test_unsupported_refuses_flex_attention_on_every_device(on_cuda):
    failure = "on CUDA inductor fails to lower flex_attention" if on_cuda else "on CPU inductor cannot compile"
    for section in ("actor_rollout_ref.model", "model"):
        reason = unsupported("flex_attention", on_cuda, section=section)
        assert reason.startswith(
            f"{section}.compile_layers=True with {section}.attn_implementation=flex_attention is not supported: "
            f"{failure}"
        ), reason
        assert reason.endswith(
            f"use {section}.attn_implementation=torch_varlen (CUDA, torch >= 2.10) or sdpa, "
            f"or {section}.compile_layers=False"
        ), reason
    for attn in ("sdpa", "eager", "torch_varlen", "flash_attention_2", None):
        assert unsupported(attn, on_cuda) == ""


@pytest.mark.parametrize("on_cuda", [False, True], ids=["cpu", "cuda"])
def test_flex_attention_with_dynamic_shapes_is_refused_at_load(tiny_model_path, monkeypatch, on_cuda):
    """CUDA faked (the weights stay on CPU): the loader's refusal names the device's failure."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: on_cuda)
    with pytest.raises(ValueError, match=f"{KEY}=True with actor_rollout_ref.model.attn_implementation=flex") as err:
        load_causal_lm(tiny_model_path, attn_implementation="flex_attention", compile_layers=True)
    assert ("on CUDA" if on_cuda else "on CPU") in str(err.value)


def test_flex_attention_refused_at_validation(tmp_path):
    from tests.test_config import compose_config, script_overrides
    from verl.trainer.config_schema import ConfigError, validate_config

    base = script_overrides("run_memory_7B.sh", tmp_path)
    flex = ["actor_rollout_ref.model.attn_implementation=flex_attention", "actor_rollout_ref.model.compile_layers=True"]
    for device in ("cpu", "cuda"):
        with pytest.raises(ConfigError, match=f"{KEY}=True with actor_rollout_ref.model.attn_implementation=flex"):
            validate_config(compose_config(base + flex + [f"trainer.device={device}"]))
    validate_config(compose_config(base + flex[1:] + ["trainer.device=cpu"]))  # sdpa/auto on CPU is fine
    validate_config(compose_config(base + flex[1:] + ["trainer.device=cuda"]))  # auto: never flex (the loader)
    varlen = ["actor_rollout_ref.model.attn_implementation=torch_varlen"]
    validate_config(compose_config(base + varlen + flex[1:] + ["trainer.device=cuda"]))


def test_decoder_layers_are_found_through_peft(tiny_model_path):
    model = load_causal_lm(tiny_model_path, lora={"r": 2})
    layers = decoder_layers(model)
    assert [type(layer).__name__ for layer in layers] == ["Qwen2DecoderLayer"] * 2
    assert layers[0] is model.get_base_model().model.layers[0]
    assert not any(is_compiled(layer) for layer in layers)


def test_decoder_layers_are_found_after_fully_shard_swapped_their_class(tiny_model_path):
    """FSDP2's ``fully_shard`` replaces a layer's class by a subclass named ``FSDP<name>`` (mimicked here on CPU,
    with the FSDPModule mixin the real one adds): the layers are still found, in order, the root model too."""
    from torch.distributed.fsdp import FSDPModule

    model = load_causal_lm(tiny_model_path)
    layers = list(model.model.layers)
    for module in [*layers, model]:
        cls = type(module)
        module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    assert type(layers[0]).__name__ == "FSDPQwen2DecoderLayer"
    assert decoder_layers(model) == layers


@pytest.mark.parametrize("flag", [True, False])
def test_worker_compiles_the_actor_and_ref_layers(tiny_model_path, flag):
    """Built as the trainer builds it; nothing runs a forward, so nothing compiles yet (compilation is lazy)."""
    from tests.test_config import compose_config
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    overrides = [
        f"actor_rollout_ref.model.path={tiny_model_path}",
        "actor_rollout_ref.model.attn_implementation=sdpa",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    ] + ([f"{KEY}=True"] if flag else [])  # off is the default
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ActorRolloutRefWorker, "_init_rollout", lambda self: None)  # no rollout engine needed here
        worker = ActorRolloutRefWorker(compose_config(overrides).actor_rollout_ref, "cpu")
        worker.init_model()
    for module in (worker.actor_module, worker.ref.actor_module):
        layers = decoder_layers(module)
        assert len(layers) == 2 and [is_compiled(layer) for layer in layers] == [flag, flag]


def _fsdp2_run(init_file: str, model_path: str) -> dict:
    """One gloo rank (this process): compiled layers + gradient checkpointing, sharded with FSDP2 as the worker does
    (compile is applied at load, before ``apply_fsdp2``), fused log-prob head; log-probs, gradients, graph count."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from verl.utils.fsdp_utils import apply_fsdp2, init_dp_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        model = load_causal_lm(
            model_path, attn_implementation="sdpa", gradient_checkpointing=True, compile_layers=True
        ).train()
        apply_fsdp2(model, mesh=init_dp_mesh("cpu"), param_dtype=torch.float32)
        counters.clear()
        results = [_step(model, _batch(call, total), True, use_fused_kernels=True) for call, total in enumerate(TOTALS)]
        return {"results": results, "graphs": counters["stats"]["unique_graphs"]}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_gradient_checkpointing_and_fused_head(tiny_model_path, tmp_path):
    """In this process (a world of one gloo rank, destroyed after): the layers' compilation reuses the inductor
    set-up the tests above paid for; a spawned rank compiled from scratch (27-32 s here, 20 s in process)."""
    out = _fsdp2_run(str(tmp_path / "init"), str(tiny_model_path))
    eager = load_causal_lm(tiny_model_path, attn_implementation="sdpa").train()
    for call, (total, (log_probs, grads)) in enumerate(zip(TOTALS, out["results"])):
        ref_log_probs, ref_grads = _step(eager, _batch(call, total), True)
        torch.testing.assert_close(log_probs, ref_log_probs, rtol=0, atol=1e-5)
        assert grads.keys() == ref_grads.keys() and len(grads) == len(list(eager.parameters()))
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-5, msg=name)
    # FSDP2's hooks run eagerly outside the layer graph; one recompilation when the checkpointed layers are
    # recomputed in the first backward (guard failure "'NoneType' object has no attribute 'size'"), 1 graph
    # without checkpointing (measured); none at the later lengths
    assert out["graphs"] == 2, out["graphs"]


# ------------------------------------------------------------------------------------------- GPU (the lead's)
@pytest.mark.gpu
def test_cuda_flex_attention_in_compiled_layers_is_refused(tiny_model_path):
    """flex_attention inside compiled layers is refused on CUDA too: inductor failed to lower it for Qwen2.5-1.5B
    (torch 2.11, ``verl/utils/compile_layers.py``), though this tiny model compiled then."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with pytest.raises(ValueError, match=f"{KEY}=True with actor_rollout_ref.model.attn_implementation=flex") as err:
        load_causal_lm(tiny_model_path, attn_implementation="flex_attention", compile_layers=True)
    assert "on CUDA" in str(err.value) and "attn_implementation=torch_varlen" in str(err.value)


@pytest.mark.gpu
@pytest.mark.parametrize("grad_ckpt", [False, True], ids=["plain", "grad_ckpt"])
@pytest.mark.parametrize("heads", [(2, 1), (12, 2)], ids=["tiny-2q-1kv", "gqa-12q-2kv"])
def test_cuda_torch_varlen_compiled_log_probs_and_gradients_match_eager(tiny_model_path, tmp_path, grad_ckpt, heads):
    """torch_varlen (cu_seq_lens kwargs) inside compiled layers, dynamic shapes, with backward (CUDA only; not run
    here: no GPU on the test machine). Two head layouts: the tiny model's 2 query / 1 key-value head and
    Qwen2.5-1.5B's 12 / 2 (the layout flex_attention failed to compile with), at hidden size 192 (head dim 16)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from verl.workers.actor.varlen_attention import varlen_available

    if not varlen_available():
        pytest.skip("needs torch.nn.attention.varlen (torch >= 2.10)")
    path = tiny_model_path
    if heads != (2, 1):
        from verl.utils.tiny_model import tiny_model_cached

        path = tiny_model_cached(tmp_path, hidden_size=192, num_heads=heads[0], num_kv_heads=heads[1])
    kwargs = dict(attn_implementation="torch_varlen", gradient_checkpointing=grad_ckpt)
    eager, compiled = (m.cuda() for m in _pair(path, True, **kwargs))
    config = compiled.config
    assert (config.num_attention_heads, config.num_key_value_heads) == heads

    def cuda_batch(call, total):
        return [t.cuda() for t in _batch(call, total)]

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    for call, total in enumerate([100, 140, 60, 300, 700, 1000]):
        batch = cuda_batch(call, total)
        (lp_e, g_e), (lp_c, g_c) = _step(eager, batch, True), _step(compiled, batch, True)
        # torch_varlen computes attention in bf16 (FA2 kernels) in both models; the bounds are not measured
        atol = 1e-2
        torch.testing.assert_close(lp_c, lp_e, rtol=0, atol=atol)
        assert g_c.keys() == g_e.keys() and len(g_e) == len(list(eager.parameters()))  # every parameter compared
        for name in g_e:
            torch.testing.assert_close(g_c[name], g_e[name], rtol=0, atol=100 * atol, msg=name)
    # a bound, not a measurement (the layer graph, split around the varlen call, plus recompilations)
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
