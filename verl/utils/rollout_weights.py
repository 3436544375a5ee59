"""The actor's weights as the rollout engine needs them: full tensors, in the engine's dtype, on the engine's
device, each stored tensor once.

:func:`iter_rollout_weights` is the weight sync's producer (``ActorRolloutRefWorker.sync_rollout_weights``):

* a sharded (FSDP2 ``DTensor``) parameter is cast to ``dtype`` **before** its all-gather, so a bf16 engine
  moves half the bytes of the fp32 master weights over the interconnect, and the gathered tensor stays on the
  GPU (no host round trip: the engine copies device to device);
* tied weights (``lm_head.weight`` sharing ``model.embed_tokens.weight``) are cast and gathered once; the same
  gathered tensor is then handed over under every name it has, because an engine may hold the tie as two
  parameters (vLLM's layer-wise reload replaces the embedding's parameter, so its ``lm_head`` needs its own copy);
* tensors are grouped into buckets of about ``bucket_bytes`` and produced lazily: at most one bucket of full
  tensors is alive at a time;
* a peft LoRA actor (``actor_rollout_ref.model.lora_rank > 0``) hands over the **merged** weights
  ``W + scaling * B @ A`` under the base model's names and no adapter tensor (``verl/utils/lora.py``): each adapted
  weight is gathered in ``dtype`` like any other, its (small) adapters in float32, and the merged tensor is a new
  one computed per layer, so the actor's own weights are untouched.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Optional, Union

import torch
from torch import nn

from verl.utils.fsdp_utils import clean_param_name
from verl.utils.lora import is_adapter_weight, lora_merges, rollout_name

__all__ = ["iter_rollout_weights", "rollout_weight_bytes"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _storage_key(tensor: torch.Tensor) -> tuple:
    """Identity of the stored values (shared by tied parameters, also after ``state_dict()``'s detach)."""
    local = _local(tensor)
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), tuple(local.stride()))


def _full(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)  # a DTensor casts its local shard: the gather below moves dtype-sized bytes
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _engine_name(name: str) -> str:
    """The rollout engine's (HF) name: wrapper prefixes and peft's ``base_model.model.`` / ``.base_layer`` dropped."""
    return rollout_name(clean_param_name(name))


def iter_rollout_weights(
    model: nn.Module,
    dtype: Optional[torch.dtype] = None,
    device: Union[str, torch.device, None] = None,
    bucket_bytes: int = 512 << 20,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets of ``(HF name, full tensor)`` covering the model's state once (see the module docstring).

    Every rank must run the loop (the all-gathers are collectives). ``device=None`` keeps each gathered tensor
    where it is (the GPU under FSDP2 on CUDA; the CPU on CPU runs). ``ValueError`` for LoRA adapters that do not
    merge into an untied linear weight (``verl.utils.lora.lora_merges``).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    gathered: dict[tuple, torch.Tensor] = {}  # storage -> its full tensor, kept only for tied names
    first_name: dict[tuple, str] = {}
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    merges = lora_merges(model)
    state = {name: tensor for name, tensor in model.state_dict().items() if not is_adapter_weight(name)}
    keys = {name: _storage_key(tensor) for name, tensor in state.items()}
    tied = {key for key, count in Counter(keys.values()).items() if count > 1}
    for name, tensor in state.items():
        key = keys[name]
        if key in first_name:  # a tied weight: the tensor gathered under the first name, handed over again
            bucket.append((_engine_name(name), gathered[key]))
            continue
        first_name[key] = name
        full = _full(tensor.detach(), dtype)
        if name in merges:  # W + scaling * B @ A, a new tensor (collective under FSDP2: A and B are gathered)
            full = merges[name].merge(full)
        if device is not None:
            full = full.to(device)
        if key in tied:
            gathered[key] = full
        bucket.append((_engine_name(name), full))
        size += full.numel() * full.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def rollout_weight_bytes(model: nn.Module, dtype: Optional[torch.dtype] = None) -> int:
    """Bytes :func:`iter_rollout_weights` casts and gathers (tied weights once), without gathering anything; a LoRA
    model's adapter tensors (gathered in float32 to be merged, a few MB) are not counted."""
    total, seen = 0, set()
    for name, tensor in model.state_dict().items():
        if is_adapter_weight(name):
            continue
        key = _storage_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        itemsize = dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size()
        total += tensor.numel() * itemsize
    return total
