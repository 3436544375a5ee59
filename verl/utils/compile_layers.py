"""Regional compilation: ``torch.compile`` each decoder layer of a causal LM in place (``model.compile_layers``).

At hidden sizes of 1-2k the memory-bound elementwise ops of a decoder layer (RMSNorm, SiLU * mul, rotary
embedding, residual adds, dtype casts) take a large share of an eager step; compiling each transformer block
separately fuses them, and since every layer runs the same code, the one graph compiled for the first layer is
reused by the others (torchtitan's "regional compilation"; compiling whole models instead costs minutes and
breaks on the data-dependent packing code around the layers).

How it composes:

* ``nn.Module.compile`` (not ``torch.compile(module)``): the layer object stays in place, so its name in the
  state dict, FSDP2's ``fully_shard`` on the layer and transformers' ``GradientCheckpointingLayer.__call__``
  (which checkpoints ``nn.Module.__call__``, now the compiled call) all still apply. It is applied in
  ``model_loading.prepare_for_training``, after gradient checkpointing is enabled and before the worker
  shards the model with FSDP2 (torchtitan's order: activation checkpointing, compile, FSDP). The order with
  FSDP2 does not change the compiled code: FSDP2's pre/post-forward hooks are ``torch._dynamo.disable``-d,
  so they run eagerly around the layer's graph whichever came first, and dynamo does not guard on the
  FSDP-managed parameters (``torch._dynamo.config.skip_fsdp_guards``);
* packed rows change length every micro-batch: ``dynamic=True`` compiles one graph with a symbolic length for
  all of them; the default ``dynamic=None`` (automatic dynamic shapes) compiles the first length static and a
  second, dynamic graph at the first new length (tiny Qwen2 on CPU, lengths 100..300: 1 graph vs 2,
  ``tests/test_compile_layers.py``);
* LoRA: peft replaces the linears inside the layers; the compiled layer traces through the adapter forward. The
  layers are found in the model peft wraps (``verl.utils.lora.base_model``).

flex_attention is refused on every device (``unsupported``: one rule for the RL config check, the SFT config check
and the loader; with ``attn_implementation: null`` the automatic choice is never flex_attention under compile_layers,
``model_loading.resolve_attn_implementation``):

* CUDA (torch 2.11, one H200, 2026-12-03, Qwen2.5-1.5B): the first compiled layer fails in inductor's lowering,
  ``LoweringException: TypeError: unsupported operand type(s) for &: 'floor' and 'Add'`` in
  ``torch/_inductor/kernel/flex/flex_decoding.py::_use_flex_decoding`` (``sympy.Eq(ratio & (ratio - 1), 0)``, the
  query/key-value head ratio, symbolic there with ``dynamic=True``). The GPU test's tiny model (2 query / 1
  key-value head, not FSDP-sharded) compiled with flex on the same machine; what made the ratio symbolic in the
  benchmark (its 12 / 2 heads, or its FSDP2-managed weights) was not isolated, so flex is refused everywhere;
* CPU: inductor's flex template fails to compile the packed-rows mask inside a layer graph with a symbolic length
  (a C++ compile error, torch 2.13).

Static shapes (``dynamic=False``, tests only) are not refused: they work on CPU but recompile at every new length.
Use ``torch_varlen`` on CUDA (torch >= 2.10; PyTorch's FA2 varlen kernels, no flex compile; compiled layers tested on
the GPU) or ``sdpa``.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

KEY = "actor_rollout_ref.model.compile_layers"

__all__ = ["decoder_layers", "compile_decoder_layers", "is_compiled", "unsupported"]

logger = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a (maybe peft-wrapped) transformers model: the modules whose class the model lists in
    ``_no_split_modules`` (``Qwen2DecoderLayer``, ``LlamaDecoderLayer``, ...), in order; also after FSDP2's
    ``fully_shard``, which swaps each layer's class for a subclass (``FSDPQwen2DecoderLayer``)."""
    from verl.utils.fsdp_utils import get_decoder_layer_classes
    from verl.utils.lora import base_model

    inner = base_model(model)
    classes = get_decoder_layer_classes(inner)
    return [module for module in inner.modules() if any(c.__name__ in classes for c in type(module).__mro__)]


def is_compiled(module: nn.Module) -> bool:
    """True when ``module.compile()`` was applied (its ``__call__`` runs a ``torch.compile``-d ``_call_impl``)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def unsupported(attn_implementation: Optional[str], on_cuda: bool, section: str = "actor_rollout_ref.model") -> str:
    """Why ``{section}.compile_layers=True`` cannot run with this attention, or ``""`` when it can: flex_attention
    fails to compile inside a layer with a dynamic length on CUDA and on CPU (module docstring); ``on_cuda`` picks the
    failure named. One rule for the RL config check, the SFT config check and the loader; ``section`` names the
    config section in the message (``model`` in the SFT trainer)."""
    if attn_implementation != "flex_attention":
        return ""
    failure = (
        "on CUDA inductor fails to lower flex_attention in a layer with a dynamic length (a TypeError in "
        "_use_flex_decoding on Qwen2.5-1.5B, torch 2.11)"
        if on_cuda
        else "on CPU inductor cannot compile flex_attention inside a layer with a dynamic sequence length"
    )
    return (
        f"{section}.compile_layers=True with {section}.attn_implementation=flex_attention is not supported: {failure}; "
        f"use {section}.attn_implementation=torch_varlen (CUDA, torch >= 2.10) or sdpa, "
        f"or {section}.compile_layers=False"
    )


def compile_decoder_layers(model: nn.Module, dynamic: Optional[bool] = True, **compile_kwargs) -> int:
    """``layer.compile(dynamic=dynamic, **compile_kwargs)`` on every decoder layer of ``model``, in place; returns
    the number of layers compiled. Raises ``ValueError``, naming ``actor_rollout_ref.model.compile_layers``, for a
    model without declared decoder layers (a custom architecture whose ``_no_split_modules`` is empty) and for
    flex_attention with dynamic shapes (``unsupported``, see the module docstring)."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"{KEY}=True: the model declares no decoder layer classes "
            f"(_no_split_modules of {type(model).__name__} is empty); set {KEY}=False for this model"
        )
    if dynamic is not False:
        from verl.workers.actor.packed_block_mask import attn_implementation

        reason = unsupported(attn_implementation(model), torch.cuda.is_available())
        if reason:
            raise ValueError(reason)
    for layer in layers:
        layer.compile(dynamic=dynamic, **compile_kwargs)
    logger.info("compile_layers: %d %s layers compiled (torch.compile)", len(layers), type(layers[0]).__name__)
    return len(layers)
