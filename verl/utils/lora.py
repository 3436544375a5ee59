"""peft LoRA adapters seen from outside the actor: merged weights under the base model's names.

The actor trains a ``peft`` model (``actor_rollout_ref.model.lora_rank > 0``, ``verl.utils.model_loading``): every
adapted linear ``X`` keeps its frozen base weight as ``base_model.model.X.base_layer.weight`` and adds the trainable
``...X.lora_A.default.weight`` (``[r, in]``) and ``...X.lora_B.default.weight`` (``[out, r]``); its forward is
``base(x) + scaling * B(A(x))`` with ``scaling = lora_alpha / r``. A rollout engine (HF or vLLM) holds the plain base
model, so the weight sync and the Hugging Face export hand over the **merged** weight ``W + scaling * B @ A`` (what
peft's ``merge_and_unload`` computes) under the base model's name ``X.weight``, and no adapter tensor.

* :func:`rollout_name`: a state-dict name of the peft model -> the base model's name (``base_model.model.`` and
  ``.base_layer`` stripped); :func:`is_adapter_weight`: the tensors that are not handed over;
* :func:`lora_merges`: for each adapted base weight (by state-dict name), the adapter parameters and scaling that
  :meth:`LoraMerge.merge` adds to it. The merged tensor is new: the actor's weights are never modified.

Only LoRA on ``nn.Linear`` modules merges this way (``target_modules="all-linear"`` or names of linear
projections); adapters on embeddings or convolutions, DoRA and other variants are refused with a message naming
``actor_rollout_ref.model.target_modules``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

__all__ = ["PEFT_PREFIX", "LoraMerge", "base_model", "is_adapter_weight", "rollout_name", "lora_merges"]

PEFT_PREFIX = "base_model.model."
# Name parts of peft's adapter tensors (LoRA on linears, embeddings, DoRA magnitudes).
_ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")
TARGET_KEY = "actor_rollout_ref.model.target_modules"


def base_model(model: nn.Module) -> nn.Module:
    """The model inside a peft wrapper (``get_base_model``), or ``model`` itself when it has none."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def is_adapter_weight(name: str) -> bool:
    """True for a peft adapter tensor (``lora_A``/``lora_B``/...), which a rollout engine does not have."""
    return any(part in name for part in _ADAPTER_PARTS)


def rollout_name(name: str) -> str:
    """The base model's name of a peft state-dict entry: ``base_model.model.model.layers.0.self_attn.q_proj
    .base_layer.weight`` -> ``model.layers.0.self_attn.q_proj.weight``; names of other models are returned
    unchanged."""
    if not name.startswith(PEFT_PREFIX):
        return name
    return name[len(PEFT_PREFIX) :].replace(".base_layer.", ".")


def _full(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    tensor = tensor.detach().to(dtype)
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@dataclass
class LoraMerge:
    """The active adapters of one peft ``lora.Linear``: ``(lora_A weight, lora_B weight, scaling)`` each."""

    module_name: str
    adapters: list[tuple[nn.Parameter, nn.Parameter, float]]
    fan_in_fan_out: bool = False

    def delta(self) -> torch.Tensor:
        """``sum(scaling * B @ A)`` in float32 (A and B gathered under FSDP2: every rank must call it)."""
        total: Optional[torch.Tensor] = None
        for a, b, scaling in self.adapters:
            delta = (_full(b, torch.float32) @ _full(a, torch.float32)) * scaling
            total = delta if total is None else total + delta
        return total.T if self.fan_in_fan_out else total

    def merge(self, weight: torch.Tensor) -> torch.Tensor:
        """A new tensor ``weight + delta`` in ``weight``'s dtype and device; the sum is taken in float32 and
        rounded once (the base weight, frozen, is usually exact in the sync's dtype)."""
        delta = self.delta().to(weight.device)
        return (weight.to(torch.float32) + delta).to(weight.dtype)


def lora_merges(model: nn.Module) -> dict[str, LoraMerge]:
    """``{state-dict name of an adapted base weight: its LoraMerge}`` for every peft LoRA layer of ``model``
    (empty for a model without LoRA). ``ValueError`` naming ``actor_rollout_ref.model.target_modules`` for an
    adapter that does not merge into a linear weight (embedding, convolution, DoRA, ...) and for one on a weight tied
    to another (``lm_head`` with ``tie_word_embeddings``: the merge would change the embedding too)."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft not installed: no LoRA model can exist
        return {}
    merges: dict[str, LoraMerge] = {}
    names_of: dict[int, list[str]] = {}
    for param_name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(param_name)
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        adapters = {*module.lora_A, *getattr(module, "lora_embedding_A", {})}
        active = [a for a in module.active_adapters if a in adapters]
        if not active:
            continue
        if getattr(module, "merged", False):
            raise ValueError(f"{name}: the LoRA adapters are merged into the base weight; unmerge them first")
        variants = [
            a for a in active if getattr(module, "use_dora", {}).get(a) or a in getattr(module, "lora_variant", {})
        ]
        if type(module) is not LoraLinear or variants:
            raise ValueError(
                f"LoRA on {name} ({type(module).__name__}{', DoRA/variant' if variants else ''}) cannot be merged "
                f"into the rollout engine's weights: adapt only linear layers with plain LoRA ({TARGET_KEY})"
            )
        tied = names_of.get(id(module.base_layer.weight), [])
        if len(tied) > 1:
            raise ValueError(
                f"LoRA adapts {name}, whose weight is tied to {[n for n in tied if not n.startswith(name)]} "
                f"(tie_word_embeddings): merging would change both; leave it out of {TARGET_KEY}"
            )
        merges[f"{name}.base_layer.weight"] = LoraMerge(
            module_name=name,
            adapters=[(module.lora_A[a].weight, module.lora_B[a].weight, float(module.scaling[a])) for a in active],
            fan_in_fan_out=bool(getattr(module, "fan_in_fan_out", False)),
        )
    return merges
