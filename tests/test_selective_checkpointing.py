"""Selective activation checkpointing by layer (``actor_rollout_ref.model.gradient_checkpointing_every``,
``verl/utils/model_loading.py::select_checkpointed_layers``): which decoder layers recompute their forward in the
backward, counted with forward pre-hooks on a 4-layer tiny Qwen2 (a checkpointed layer runs its forward twice per
training step), gradients against the model without checkpointing, peft and compile_layers, the key's validation."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from verl.utils.compile_layers import decoder_layers, is_compiled
from verl.utils.model_loading import build_causal_lm_from_config

KEY = "actor_rollout_ref.model.gradient_checkpointing_every"


def _config(tiny_model_path):
    """The tiny model's config with 4 decoder layers (all full attention)."""
    config = AutoConfig.from_pretrained(tiny_model_path)
    config.num_hidden_layers, config.layer_types = 4, ["full_attention"] * 4
    return config


def _model(tiny_model_path, checkpointing: bool, every: int = 1, **kwargs):
    return build_causal_lm_from_config(
        _config(tiny_model_path),
        attn_implementation="sdpa",
        gradient_checkpointing=checkpointing,
        gradient_checkpointing_every=every,
        seed=0,  # the same weights for every variant
        **kwargs,
    )


def _step(model, layers=None) -> tuple[list[int], dict[str, torch.Tensor]]:
    """One training forward/backward; the forward calls of each decoder layer and the gradients."""
    layers = decoder_layers(model) if layers is None else layers
    calls = [0] * len(layers)
    hooks = [
        layer.register_forward_pre_hook(lambda module, args, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(layers)
    ]
    model.train()
    ids = torch.tensor([[3, 17, 42, 8, 99, 5, 23, 61], [7, 7, 12, 30, 2, 88, 14, 9]])
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    for hook in hooks:
        hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return calls, grads


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    """The same step without gradient checkpointing: every layer runs its forward once."""
    return _step(_model(tiny_model_path, checkpointing=False))


@pytest.mark.parametrize(
    "every, calls",
    [(1, [2, 2, 2, 2]), (2, [2, 1, 2, 1]), (3, [2, 1, 1, 2]), (4, [2, 1, 1, 1]), (9, [2, 1, 1, 1])],
)
def test_only_every_nth_layer_recomputes_and_gradients_are_unchanged(tiny_model_path, reference, every, calls):
    """N=1 is the old behaviour (every layer recomputed); N=2 recomputes layers 0 and 2 only. Gradients equal those
    of the model without checkpointing."""
    ref_calls, ref_grads = reference
    assert ref_calls == [1, 1, 1, 1]
    model = _model(tiny_model_path, checkpointing=True, every=every)
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [c == 2 for c in calls]
    got_calls, grads = _step(model)
    assert got_calls == calls
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-6, msg=name)


def test_every_is_inert_without_checkpointing(tiny_model_path):
    calls, _ = _step(_model(tiny_model_path, checkpointing=False, every=2))
    assert calls == [1, 1, 1, 1]


def test_peft_wrapped_model_checkpoints_every_second_layer(tiny_model_path):
    """LoRA: the layers are selected before peft wraps the model, and the wrapped layers keep their flags."""
    from verl.utils.model_loading import prepare_for_training

    base = build_causal_lm_from_config(_config(tiny_model_path), attn_implementation="sdpa", seed=0)
    model = prepare_for_training(
        base, gradient_checkpointing=True, lora={"r": 4}, gradient_checkpointing_every=2
    )  # peft wraps it
    assert type(model).__name__.startswith("Peft")
    calls, grads = _step(model)
    assert calls == [2, 1, 2, 1]
    assert grads and all("lora_" in name for name in grads)  # only the adapters train


def test_composes_with_compile_layers(tiny_model_path):
    """compile_layers comes after the selection (prepare_for_training's order): the compiled layers keep their
    per-layer flags (compilation is lazy: nothing runs here)."""
    model = _model(tiny_model_path, checkpointing=True, every=2, compile_layers=True)
    layers = decoder_layers(model)
    assert [is_compiled(layer) for layer in layers] == [True] * 4
    assert [layer.gradient_checkpointing for layer in layers] == [True, False, True, False]


def _fsdp2_worker(rank: int, init_file: str, model_path: str, out_file: str) -> None:
    """One gloo rank: the 4-layer model with N=2, sharded with FSDP2 as the worker does (after loading); one step."""
    import torch.distributed as dist

    from verl.utils.fsdp_utils import apply_fsdp2, init_dp_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        model = _model(model_path, checkpointing=True, every=2)
        layers = decoder_layers(model)  # by class name: FSDP2 renames the classes (FSDPQwen2DecoderLayer)
        apply_fsdp2(model, mesh=init_dp_mesh("cpu"), param_dtype=torch.float32)
        assert all(type(layer).__name__.startswith("FSDP") for layer in layers)
        flags = [layer.gradient_checkpointing for layer in layers]
        calls, grads = _step(model, layers)
        grads = {name: grad.full_tensor() if hasattr(grad, "full_tensor") else grad for name, grad in grads.items()}
        torch.save({"flags": flags, "calls": calls, "grads": grads}, out_file)
    finally:
        dist.destroy_process_group()


def test_fsdp2_sharded_model_keeps_the_selection(tiny_model_path, reference, tmp_path):
    """fully_shard swaps the layers' class but keeps their attributes: layers 0 and 2 still recompute, the
    gradients still equal the unsharded model's without checkpointing."""
    from tests.rank_processes import spawn

    args = (str(tmp_path / "init"), str(tiny_model_path), str(tmp_path / "out.pt"))
    spawn(_fsdp2_worker, args=args, nprocs=1, join=True)
    out = torch.load(tmp_path / "out.pt")
    assert out["flags"] == [True, False, True, False] and out["calls"] == [2, 1, 2, 1]
    _, ref_grads = reference
    assert out["grads"].keys() == ref_grads.keys()
    for name, grad in out["grads"].items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("value", [0, -2, 1.5, "two", True])
def test_key_must_be_an_integer_from_1(value):
    from verl.trainer.config_schema import ConfigError
    from verl.workers.config.model import ModelConfig

    with pytest.raises(ConfigError, match=rf"{KEY} must be an integer >= 1 \(got {value!r}\)"):
        ModelConfig.from_config({"path": "/m", "gradient_checkpointing_every": value})
    assert ModelConfig.from_config({"path": "/m", "gradient_checkpointing_every": 3}).gradient_checkpointing_every == 3


def test_key_is_validated_from_the_yaml():
    from tests.test_config import compose_config
    from verl.trainer.config_schema import ConfigError, validate_config

    assert compose_config([]).actor_rollout_ref.model.gradient_checkpointing_every == 1  # every layer by default
    with pytest.raises(ConfigError, match=rf"{KEY} must be an integer >= 1 \(got 0\)"):
        validate_config(compose_config([f"{KEY}=0"]))


@pytest.mark.parametrize("value", [0, -1, 2.0])
def test_loader_refuses_a_bad_value_naming_the_key(tiny_model_path, value):
    with pytest.raises(ValueError, match=rf"{KEY} must be an integer >= 1 \(got {value!r}\)"):
        _model(tiny_model_path, checkpointing=True, every=value)
