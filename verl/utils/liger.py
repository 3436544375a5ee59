"""liger-kernel's fused RMSNorm/SwiGLU/RoPE kernels (``model.use_liger``): the automatic choice, the rule against
``compile_layers`` and the patch itself.

``use_liger: null`` (the default) resolves, per worker and for the device the model is loaded for (as the automatic
attention does: a CPU worker on a GPU host keeps them off), to on only when all of these hold (``unsupported`` gives
the first that does not):

* the device is CUDA (liger's Triton kernels have no CPU backend);
* ``compile_layers`` is off (inductor fuses the same elementwise work itself, and dynamo cannot trace liger's Triton
  RMSNorm autograd function, see ``compile_conflict``);
* ``liger_kernel`` imports (``liger_model_types``, the probe the tests replace);
* liger-kernel patches the model's type (its ``monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN`` table); another type is
  off without an error.

Why on (one H200, 2026-12-03, torch 2.11, transformers 5.17, liger-kernel 0.8.5, Qwen2.5-1.5B shape, the MemAgent
layout of ``benchmarks/bench_update_policy.py``: 659,686 tokens per call, 4 mini-batches, 16K-token micro-batches,
torch_varlen): compute_log_prob 112.9K tokens/s (44.1% MFU) -> 140.7K (55.0%); update_policy with gradient
checkpointing 26.5K (31.0%) -> 34.1K (39.9%), without 34.7K (40.7%) -> 40.6K (47.5%) and peak 77.1 -> 62.4 GiB,
every second layer checkpointed 30.7K (36.0%) -> 35.8K (42.0%). compile_layers alone: 50.9% and 36.4% MFU, below
liger alone. An explicit ``True``/``False`` is kept (``True`` without CUDA or without the package: a warning, and
nothing is patched); ``True`` with ``compile_layers`` is refused at validation and at load.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import torch
from torch import nn

__all__ = [
    "KEY",
    "liger_model_types",
    "unsupported",
    "resolve_use_liger",
    "compile_conflict",
    "apply_liger_kernel",
    "liger_applied",
]

logger = logging.getLogger(__name__)
KEY = "actor_rollout_ref.model.use_liger"


def liger_model_types() -> frozenset[str]:
    """The model types liger-kernel has kernels for (the keys of its ``MODEL_TYPE_TO_APPLY_LIGER_FN``); raises
    whatever importing ``liger_kernel`` raises when it does not import (not installed, no Triton, a transformers
    it refuses)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def _on_cuda(device: Union[str, torch.device, None]) -> bool:
    """The device the model is loaded for; ``None``: the host's (as ``resolve_attn_implementation``)."""
    return torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()


def _model_type(model_config: Any) -> Optional[str]:
    return getattr(model_config, "model_type", None)


def _unpatched_type(model_config: Any) -> str:
    """Why liger-kernel cannot patch this model (it does not import, or has no kernels for its type), or ``""``;
    ``model_config`` ``None``: its type is not checked."""
    try:
        types = liger_model_types()
    except Exception as error:  # noqa: BLE001 - any import problem means "not available"
        return f"liger_kernel does not import ({type(error).__name__}: {error})"
    model_type = _model_type(model_config)
    if model_config is not None and model_type not in types:
        return f"liger-kernel has no kernels for model type {model_type!r}"
    return ""


def unsupported(
    device: Union[str, torch.device, None] = None, model_config: Any = None, compile_layers: bool = False
) -> str:
    """Why ``use_liger: null`` resolves off for a model of ``model_config`` loaded on ``device``, or ``""`` when it
    resolves on (module docstring; the first reason found, in its order)."""
    if not _on_cuda(device):
        where = torch.device(device).type if device is not None else "this host (no CUDA)"
        return f"the model is loaded on {where}; liger-kernel's Triton kernels need CUDA"
    if compile_layers:
        return "compile_layers is on (it fuses the same ops; dynamo cannot trace liger's RMSNorm)"
    return _unpatched_type(model_config)


def resolve_use_liger(
    requested: Optional[bool],
    device: Union[str, torch.device, None] = None,
    *,
    model_config: Any = None,
    compile_layers: bool = False,
    key: str = KEY,
) -> bool:
    """``requested`` when it is ``True``/``False``; ``None``: on exactly when ``unsupported`` finds nothing, logged
    once here (INFO) with the reason. ``key`` names the config key in the log line (``model.use_liger`` in SFT)."""
    if requested is not None:
        return bool(requested)
    reason = unsupported(device, model_config, compile_layers)
    if reason:
        logger.info("%s=null -> False: %s", key, reason)
        return False
    logger.info(
        "%s=null -> True: CUDA, liger_kernel imports, compile_layers off, model type %r has liger kernels",
        key,
        _model_type(model_config),
    )
    return True


def compile_conflict(section: str = "actor_rollout_ref.model") -> str:
    """The message refusing ``{section}.use_liger=True`` with ``{section}.compile_layers=True`` (RL and SFT config
    checks, the loader)."""
    return (
        f"{section}.use_liger=True with {section}.compile_layers=True is not supported: dynamo cannot trace "
        "liger-kernel's Triton RMSNorm autograd function (LigerRMSNormFunction.apply: an AssertionError in "
        "torch/_dynamo in the first forward, torch 2.11, liger-kernel 0.8.5); set one of them to False "
        f"(liger alone measured faster: update_policy 39.9% MFU vs 36.4% with compile_layers alone), or leave "
        f"{section}.use_liger null (off under compile_layers)"
    )


def apply_liger_kernel(model: nn.Module, device: Union[str, torch.device, None] = None) -> bool:
    """Patch ``model`` in place with liger-kernel's fused RMSNorm, SwiGLU and RoPE; returns True when applied.

    Skipped (a warning, returns False) when ``device`` (``None``: the host) is not CUDA, when ``liger_kernel`` does
    not import and when it has no kernels for the model's type. Cross-entropy patches stay off: the actor needs
    plain logits or hidden states (``verl/workers/actor/fused_logprob.py`` has its own head)."""
    if not _on_cuda(device):
        logger.warning("use_liger=True ignored: liger-kernel needs CUDA (its Triton kernels have no CPU backend)")
        return False
    reason = _unpatched_type(getattr(model, "config", None))
    if reason:
        logger.warning("use_liger=True ignored: %s", reason)
        return False
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(
        model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
    return True


def liger_applied(model: nn.Module) -> bool:
    """True when some module of ``model`` runs liger-kernel code: a liger class, or (how liger patches a built
    model) a ``forward`` bound on the instance from a liger module."""

    def from_liger(module: nn.Module) -> bool:
        forward = getattr(module.__dict__.get("forward"), "__func__", None)
        names = (type(module).__module__, getattr(forward, "__module__", None) or "")
        return any(name.startswith("liger_kernel") for name in names)

    return any(from_liger(module) for module in model.modules())
