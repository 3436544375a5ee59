"""``attn_implementation="torch_varlen"``: attention through PyTorch's variable-length flash attention
(``torch.nn.attention.varlen.varlen_attn``, FA2 kernels shipped with torch >= 2.10, CUDA only), for packed rows
on a GPU without the flash-attn package.

The attention function (``torch_varlen_attention``) is registered with transformers (``AttentionInterface``)
under ``NAME``; it takes transformers' ``[B, H, T, D]`` query/key/value and returns ``[B, T, H, D]``. Where the
sequence boundaries come from, in order:

* ``cu_seq_lens_q`` / ``max_length_q`` keyword arguments (transformers' ``FlashAttentionKwargs``: Qwen2/Llama pass
  them from the model's ``forward`` to every attention layer): the packed layout passes them
  (``forward.packed_model_inputs``), computed once per micro-batch from the row lengths on the host
  (``forward.pack_rows``), so no layer synchronises the device;
* a 2-D padding ``attention_mask`` (padded rows: the mask interface registered under ``NAME`` is transformers'
  ``flash_attention_mask``, which hands the ``[B, T]`` mask through, or None when nothing is padded): the valid
  tokens of each row are gathered into one sequence per row, and the output scattered back (zeros at padding);
  the boundaries are computed again in every layer (a device synchronisation each), correct but meant only for
  micro-batches that cannot be packed;
* otherwise every row, and within a row every position that does not follow the previous one by 1, starts a
  sequence (``_boundaries_from_positions``: the documents transformers' ``find_packed_sequence_indices`` gives
  sdpa and flex_attention; again per layer).

Masking is causal within each sequence. torch's signature changed between releases: 2.10 has ``is_causal`` and no
``scale``; 2.11 has ``window_size=(-1, 0)`` for causal and ``scale``; 2.12+ adds ``enable_gqa``. The signature is
read once per function (``_kernel_options``): grouped-query key/value heads are repeated here when ``enable_gqa``
is missing, and a non-default ``scaling`` is folded into the query when ``scale`` is. Verified for torch 2.11 on
one H200 (2026-12-03): its signature, printed there, is ``varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q,
max_k, *, return_aux=None, scale=None, window_size=(-1, -1))`` (causal through ``window_size``, ``scale`` passed,
GQA heads repeated here, ``return_aux`` left unset so one tensor comes back); Qwen2.5-1.5B's update_policy (12
query / 2 key-value heads) ran through this module there to flex_attention's grad norm (3.1939 vs 3.1933). The FA2
kernels take fp16/bf16 only: float32 inputs on CUDA are computed in bf16 (or the autocast dtype) and cast back.

What it does not do (``model_unsupported`` names it, so the automatic choice falls back to flex_attention and an
explicit ``torch_varlen`` is refused at load): sliding-window layers (a config with ``sliding_window`` set or a
``"sliding_attention"`` entry in ``layer_types``) and attention dropout (``attention_dropout > 0``). GPUs older than
Ampere (compute capability < 8.0, ``gpu_supported``) have no FA2 kernels: the automatic choice takes flex_attention
there too. ``unsupported`` gathers the rules of the automatic choice (torch, model, GPU) with their reasons.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch
from torch import nn

from verl.workers.actor.packed_block_mask import document_starts

__all__ = [
    "NAME",
    "varlen_available",
    "gpu_supported",
    "model_unsupported",
    "unsupported",
    "register",
    "varlen_kwargs",
    "cu_seq_lens_from_lengths",
    "torch_varlen_attention",
]

NAME = "torch_varlen"


def varlen_available() -> bool:
    """True when this torch has ``torch.nn.attention.varlen`` (torch >= 2.10)."""
    try:
        return importlib.util.find_spec("torch.nn.attention.varlen") is not None
    except ModuleNotFoundError:
        return False


def gpu_supported(device=None) -> bool:
    """True when the CUDA ``device`` (default: the current one) can run PyTorch's FA2 kernels: compute capability
    8.0 (Ampere) or newer."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def model_unsupported(config) -> str:
    """What ``torch_varlen_attention`` cannot run of the transformers ``config`` (``None``: nothing known), or ``""``:
    sliding-window layers and attention dropout (both raise in the attention function)."""
    if config is None:
        return ""
    reasons = []
    window, layer_types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None) or []
    if window is not None or "sliding_attention" in layer_types:
        reasons.append(f"sliding-window layers (sliding_window={window})")
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        reasons.append(f"attention dropout (attention_dropout={dropout})")
    return " and ".join(reasons)


def unsupported(config=None, device=None) -> str:
    """Why the automatic choice cannot take ``NAME`` for packed rows on the CUDA ``device`` (default: the current
    one) with the transformers ``config``, or ``""``: this torch has no ``torch.nn.attention.varlen``, the model has
    what ``model_unsupported`` names, or the GPU is older than Ampere (``gpu_supported``, asked only when nothing
    else rules varlen out). An explicit ``torch_varlen`` is checked by the loader without the GPU rule."""
    if not varlen_available():
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10)"
    return model_unsupported(config) or (
        "" if gpu_supported(device) else "the GPU is older than Ampere (compute capability < 8.0: no FA2 kernels)"
    )


@functools.cache
def register() -> None:
    """Register ``NAME`` with transformers: the attention function, and ``flash_attention_mask`` as its mask
    builder (a custom name without one gets no mask at all, padded rows included)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, torch_varlen_attention)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


def varlen_kwargs(cu_seq_lens: torch.Tensor, max_length: int) -> dict:
    """Model keyword arguments that carry the sequence boundaries of packed rows to every attention layer:
    ``cu_seq_lens`` ``[N + 1]`` int32 offsets of the ``N`` sequences, ``max_length`` the longest (a host int)."""
    return dict(cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=max_length, max_length_k=max_length)


def cu_seq_lens_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``[N + 1]`` int32 offsets (0 first) of ``N`` consecutive sequences of ``lengths`` ``[N]``."""
    return nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))


class _Options(NamedTuple):
    window: bool  # causal as window_size=(-1, 0) (torch >= 2.11), else is_causal=True (2.10)
    scale: bool
    gqa: bool


@functools.lru_cache(maxsize=8)
def _kernel_options(kernel: Callable) -> _Options:
    params = inspect.signature(kernel).parameters
    if "window_size" not in params and "is_causal" not in params:
        raise TypeError(f"varlen_attn{inspect.signature(kernel)}: neither window_size nor is_causal, unsupported")
    return _Options(window="window_size" in params, scale="scale" in params, gqa="enable_gqa" in params)


def _kernel() -> Callable:
    from torch.nn.attention import varlen

    return varlen.varlen_attn  # looked up per call: tests replace it with a reference on CPU


def _varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    max_length: int,
    scaling: Optional[float],
) -> torch.Tensor:
    """Causal attention per sequence of ``[T, H, D]`` query and ``[T, H_kv, D]`` key/value, with any
    ``varlen_attn`` signature (module docstring)."""
    kernel = _kernel()
    options = _kernel_options(kernel)
    kwargs = {"window_size": (-1, 0)} if options.window else {"is_causal": True}
    head_dim = query.shape[-1]
    if scaling is not None:
        if options.scale:
            kwargs["scale"] = scaling
        elif not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-6):
            query = query * (scaling * head_dim**0.5)  # the kernel's default scale is 1 / sqrt(head_dim)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        if options.gqa:
            kwargs["enable_gqa"] = True
        else:  # transformers' repeat_kv: kv head i serves query heads i * groups ... (i + 1) * groups - 1
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
    dtype = query.dtype
    if query.is_cuda and dtype not in (torch.float16, torch.bfloat16):
        target = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.bfloat16
        query, key, value = query.to(target), key.to(target), value.to(target)
    out = kernel(query, key, value, cu_seq_lens, cu_seq_lens, max_length, max_length, **kwargs)
    return out.to(dtype)


def _boundaries_from_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Flat indices of the valid tokens of a ``[B, T]`` mask, their per-row offsets and the longest row."""
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.reshape(-1)).reshape(-1)
    return indices, cu_seq_lens_from_lengths(lengths), int(lengths.max())


def _boundaries_from_positions(position_ids: torch.Tensor, batch: int) -> tuple[torch.Tensor, int]:
    """Offsets and longest length of the sequences of ``[B or 1, T]`` position_ids (module docstring)."""
    starts = document_starts(position_ids.expand(batch, -1)).reshape(-1)  # every row starts a sequence
    offsets = torch.nonzero(starts).reshape(-1).to(torch.int32)
    cu_seq_lens = torch.cat([offsets, offsets.new_tensor([starts.numel()])])
    return cu_seq_lens, int(cu_seq_lens.diff().max())


def torch_varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    cu_seq_lens_q: Optional[torch.Tensor] = None,
    cu_seq_lens_k: Optional[torch.Tensor] = None,
    max_length_q: Optional[int] = None,
    max_length_k: Optional[int] = None,
    position_ids: Optional[torch.Tensor] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``[B, H, T, D]`` in, ``([B, T, H, D], None)`` out (module docstring)."""
    if dropout:
        raise ValueError(f"attn_implementation='{NAME}' has no attention dropout (got {dropout}); set it to 0")
    if sliding_window is not None:
        raise ValueError(f"attn_implementation='{NAME}' does not implement sliding-window layers")
    if cu_seq_lens_k is not None and cu_seq_lens_q is not None and cu_seq_lens_k is not cu_seq_lens_q:
        raise ValueError(f"attn_implementation='{NAME}' runs self-attention: cu_seq_lens_k must be cu_seq_lens_q")
    batch, heads, length, head_dim = query.shape
    q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))  # [B, T, H, D]; a no-op after rope
    if attention_mask is not None:  # padded rows: one sequence per row of its valid tokens
        if attention_mask.dim() != 2:
            raise ValueError(f"attn_implementation='{NAME}' takes a 2-D padding mask, got {attention_mask.dim()}-D")
        indices, cu_seq_lens, max_length = _boundaries_from_mask(attention_mask.bool())
        out = _varlen(
            *(t.reshape(batch * length, t.shape[2], head_dim).index_select(0, indices) for t in (q, k, v)),
            cu_seq_lens,
            max_length,
            scaling,
        )
        padded = out.new_zeros(batch * length, heads, out.shape[-1]).index_copy(0, indices, out)
        return padded.view(batch, length, heads, -1), None
    if cu_seq_lens_q is None:
        if position_ids is None:  # one sequence per row
            cu_seq_lens_q = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=query.device)
            max_length_q = length
        else:
            cu_seq_lens_q, max_length_q = _boundaries_from_positions(position_ids, batch)
    elif batch != 1:
        raise ValueError(
            f"attn_implementation='{NAME}' with cu_seq_lens_q takes packed rows ([1, T]), got {batch} rows"
        )
    out = _varlen(
        *(t.reshape(batch * length, t.shape[2], head_dim) for t in (q, k, v)), cu_seq_lens_q, int(max_length_q), scaling
    )
    return out.view(batch, length, heads, -1), None
