"""flex_attention's ``BlockMask`` for packed rows, built with plain tensor ops (no ``torch.compile``).

Packed rows (``forward.pack_rows``) are one ``[1, T]`` sequence of documents whose ``position_ids`` restart at 0.
Given no attention mask, transformers derives the document ids from the position_ids and, under
``flex_attention``, builds the block-diagonal causal mask with ``create_block_mask(..., _compile=True)``
(``masking_utils.flex_attention_mask``): an inductor compile per new shape and grad mode, minutes of a training
step on GPU with ``T ~ 30K``. The mask's block structure needs no compiler: document ids are non-decreasing along
the sequence, so for query block ``i`` and key/value block ``j`` (``block_size`` tokens each)

* ``j > i``: empty (causal);
* ``j == i``: partial (the diagonal; full only for one-token blocks);
* ``j < i``: non-empty iff the last document of block ``j`` is the first document of block ``i``; full iff the
  first document of block ``j`` is the last document of block ``i`` (both blocks inside one document) and both
  blocks are whole (a last block shorter than ``block_size`` is padded with masked positions, as torch does).

``packed_block_mask`` evaluates that on ``[n, n]`` block grids (``n = ceil(T / block_size)``, <= ~512 for MemAgent's
micro-batches), orders the block indices as ``create_block_mask`` does (``argsort`` of the dense block grid,
descending, stable) and calls ``BlockMask.from_kv_blocks`` with the element mask ``mask_mod`` (causal and same
document, the document ids a tensor in the closure, as transformers' ``packed_sequence_mask_function``). All
fields equal ``create_block_mask``'s (``tests/test_packed_block_mask.py``). Everything runs on the device of the
``position_ids`` without a host synchronisation (``T`` comes from the shape).

transformers returns a 4-D mask (a tensor or a ``BlockMask``) passed as ``attention_mask`` unchanged
(``masking_utils._preprocess_mask_arguments``, the early exit for prepared masks), and its flex_attention
forward uses a ``BlockMask`` as the block mask; ``packed_attention_mask`` returns the mask only for models where
that is the whole story: ``flex_attention`` and no sliding-window layers (those get a different mask per layer
type, which transformers still builds).

Rows sharing a prompt (``shared_prompts.py``) have a different mask: a response attends to its own segment and to
its group's prompt segment, which is not contiguous with it. Each segment is a contiguous run of the sequence, so
the keys a query ``q`` may see are two intervals: its own segment's start to ``q``, and its prefix segment.
``shared_prompt_block_mask`` tests those two intervals against every key/value block (``T x n`` values, a few query
blocks at a time) and reduces them to partial/full blocks per query block: equal to ``create_block_mask``, no
compile, and ``block_size`` times less work than evaluating the ``T x T`` element mask (the earlier builder: at
131,072 tokens, 17.2G values per micro-batch); ``shared_prompt_dense_mask`` is the element mask for sdpa (boolean)
and eager (additive).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE, BlockMask

from verl.utils.lora import base_model

__all__ = [
    "attn_implementation",
    "document_starts",
    "document_ids",
    "packed_block_mask",
    "shared_prompt_block_mask",
    "shared_prompt_dense_mask",
    "supports_shared_prompts",
    "config_has_full_attention_only",
    "packed_attention_mask",
]


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool, True where a document starts: at the first token of every row and wherever a position does
    not follow the previous one by 1 (transformers' ``find_packed_sequence_indices``)."""
    return torch.diff(position_ids, prepend=position_ids[:, :1], dim=-1) != 1


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` document index of every token (``document_starts``), e.g. positions ``[0, 1, 0, 1, 2, 0]`` ->
    ``[0, 0, 1, 1, 1, 2]``."""
    return document_starts(position_ids).cumsum(dim=-1) - 1


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Count and indices of the True blocks per row, True ones first in ascending order (``create_block_mask``'s
    layout: ``argsort(descending=True, stable=True)`` of the int32 grid)."""
    dense = blocks.to(torch.int32)
    counts = dense.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return counts.contiguous(), indices.contiguous()


def packed_block_mask(position_ids: torch.Tensor, block_size: int = _DEFAULT_SPARSE_BLOCK_SIZE) -> BlockMask:
    """The ``BlockMask`` of "same document and ``q >= kv``" over packed ``position_ids`` ``[B, T]`` (module
    docstring), equal to ``create_block_mask(mask_mod, B, None, T, T, BLOCK_SIZE=block_size)``."""
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be [B, T], got shape {tuple(position_ids.shape)}")
    length = position_ids.shape[1]
    device = position_ids.device
    docs = document_ids(position_ids)
    num_blocks = -(-length // block_size)
    starts = torch.arange(num_blocks, device=device) * block_size
    first = docs[:, starts]  # [B, n]: document of each block's first token
    last = docs[:, (starts + block_size).clamp(max=length) - 1]  # ... and of its last token
    whole = starts + block_size <= length  # [n]
    block = torch.arange(num_blocks, device=device)
    below = block[None, :] < block[:, None]  # [n (q), n (kv)]: kv block strictly before q block
    diagonal = block[None, :] == block[:, None]
    touches = below & (last[:, None, :] == first[:, :, None])  # [B, n, n]
    full = below & (first[:, None, :] == last[:, :, None]) & whole[None, :] & whole[:, None]
    if block_size == 1:
        full = full | diagonal
    partial = (touches | diagonal) & ~full

    def mask_mod(batch_idx, head_idx, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[batch_idx, q_idx] == docs[batch_idx, kv_idx])

    return _from_block_grids(partial, full, block_size, mask_mod, length)


def _from_block_grids(partial: torch.Tensor, full: torch.Tensor, block_size: int, mask_mod, length: int) -> BlockMask:
    """The ``BlockMask`` of ``[B, n (q), n (kv)]`` grids of partial and full blocks (disjoint), the element mask
    ``mask_mod`` and ``length`` tokens, laid out as ``create_block_mask`` does (``_ordered``)."""
    kv_num_blocks, kv_indices = _ordered(partial[:, None])
    full_kv_num_blocks, full_kv_indices = _ordered(full[:, None])
    return BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        full_kv_num_blocks,
        full_kv_indices,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(length, length),
    )


def _shared_prompt_allowed(q_idx, kv_idx, segment_ids: torch.Tensor, prefix_ids: torch.Tensor) -> torch.Tensor:
    """Causal, and the key is in the query's own segment or in its prefix segment (``shared_prompts``)."""
    kv_segment = segment_ids[kv_idx]
    return (q_idx >= kv_idx) & ((kv_segment == segment_ids[q_idx]) | (kv_segment == prefix_ids[q_idx]))


def _covers(lo_a, hi_a, lo_b, hi_b, first, last) -> torch.Tensor:
    """Whether the union of the inclusive intervals ``[lo_a, hi_a]`` and ``[lo_b, hi_b]`` (empty where lo > hi)
    holds every position of ``[first, last]``: one of them does, or one holds ``first``, the other ``last``, and
    they overlap or touch."""

    a_first, a_last = (lo_a <= first) & (first <= hi_a), (lo_a <= last) & (last <= hi_a)
    b_first, b_last = (lo_b <= first) & (first <= hi_b), (lo_b <= last) & (last <= hi_b)
    touch = (lo_a <= hi_b + 1) & (lo_b <= hi_a + 1)
    return (a_first & a_last) | (b_first & b_last) | (touch & ((a_first & b_last) | (b_first & a_last)))


def shared_prompt_block_mask(
    segment_ids: torch.Tensor,
    prefix_ids: torch.Tensor,
    block_size: int = _DEFAULT_SPARSE_BLOCK_SIZE,
    max_chunk_elements: int = 1 << 26,
) -> BlockMask:
    """The ``BlockMask`` of packed rows with shared prompts (``verl/workers/actor/shared_prompts.py``): query ``q``
    attends to key ``kv <= q`` in its own segment or in its prefix segment (``segment_ids``/``prefix_ids``: ``[T]``,
    segment ids non-decreasing, so every segment is one contiguous run, and a prefix segment never after its query).

    Equal to ``create_block_mask`` of that mask (``tests/test_shared_prompts.py``), built without a compile and
    without a host synchronisation (module docstring): per query, the keys it sees are ``[start(own segment), q]``
    and ``[start(prefix), min(end(prefix), q)]``; a key/value block is partial for the query block if some query
    of it sees a key of the block, full if every query sees every key. Evaluated for a few query blocks at a time
    (at most ``max_chunk_elements`` query x block values); positions past ``T`` in a last, shorter block count as
    masked, as torch does."""
    length = segment_ids.shape[-1]
    device = segment_ids.device
    num_blocks = -(-length // block_size)
    padded = num_blocks * block_size
    position = torch.arange(length, device=device)
    # each segment's first and last token (segment ids are < T: at most one segment per token)
    seg_start = torch.full((length,), length, device=device).scatter_reduce(0, segment_ids, position, "amin")
    seg_end = torch.full((length,), -1, device=device).scatter_reduce(0, segment_ids, position, "amax")
    own_lo, own_hi = seg_start[segment_ids], position
    prefix_lo, prefix_hi = seg_start[prefix_ids], torch.minimum(seg_end[prefix_ids], position)
    # queries past T (the last block's padding) see nothing: empty intervals
    pad = padded - length
    own_lo, prefix_lo = (torch.nn.functional.pad(t, (0, pad), value=length) for t in (own_lo, prefix_lo))
    own_hi, prefix_hi = (torch.nn.functional.pad(t, (0, pad), value=-1) for t in (own_hi, prefix_hi))
    block_first = torch.arange(num_blocks, device=device) * block_size
    block_last = block_first + block_size - 1  # past T in a last, shorter block: never covered
    rows_per_chunk = max(block_size, (max_chunk_elements // max(num_blocks, 1)) // block_size * block_size)
    partial_rows, full_rows = [], []
    for start in range(0, padded, rows_per_chunk):
        rows = slice(start, min(start + rows_per_chunk, padded))
        a_lo, a_hi, b_lo, b_hi = (t[rows, None] for t in (own_lo, own_hi, prefix_lo, prefix_hi))
        sees_some = ((a_lo <= block_last) & (a_hi >= block_first)) | ((b_lo <= block_last) & (b_hi >= block_first))
        sees_all = _covers(a_lo, a_hi, b_lo, b_hi, block_first, block_last)
        partial_rows.append(sees_some.reshape(-1, block_size, num_blocks).any(dim=1))
        full_rows.append(sees_all.reshape(-1, block_size, num_blocks).all(dim=1))
    full = torch.cat(full_rows)
    partial = torch.cat(partial_rows) & ~full

    def mask_mod(batch_idx, head_idx, q_idx, kv_idx):
        return _shared_prompt_allowed(q_idx, kv_idx, segment_ids, prefix_ids)

    return _from_block_grids(partial[None], full[None], block_size, mask_mod, length)


def shared_prompt_dense_mask(segment_ids: torch.Tensor, prefix_ids: torch.Tensor, additive: bool) -> torch.Tensor:
    """The same mask as ``shared_prompt_block_mask``, dense ``[1, 1, T, T]``: boolean (True = attend; sdpa) or
    additive float32 (0 / the float32 minimum; eager attention adds it to its scores)."""
    index = torch.arange(segment_ids.shape[-1], device=segment_ids.device)
    allowed = _shared_prompt_allowed(index[:, None], index[None, :], segment_ids, prefix_ids)[None, None]
    if not additive:
        return allowed
    return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(torch.float32).min
    )


def config_has_full_attention_only(config) -> bool:
    """No sliding-window or other non-full attention layers in a transformers ``config``."""
    if getattr(config, "sliding_window", None) is not None:
        return False
    return all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ())


def _full_attention_only(model: nn.Module) -> bool:
    return config_has_full_attention_only(base_model(model).config)


def _on_cpu(model: nn.Module) -> bool:
    for param in getattr(model, "parameters", tuple)():
        return param.device.type == "cpu"
    return True


def supports_shared_prompts(model: nn.Module) -> bool:
    """Whether packed rows may share prompts for ``model``: its attention takes a mask we build (flex_attention on
    CUDA, sdpa, eager) and it has no sliding-window layers. Variable-length kernels (flash_attention_2, torch_varlen)
    take sequence boundaries only; flex_attention on CPU is left out because inductor's C++ code for this mask
    fails to compile once the shapes are dynamic (torch 2.13; on CPU sdpa is the default anyway)."""
    implementation = attn_implementation(model)
    if implementation == "flex_attention" and _on_cpu(model):
        return False
    return implementation in ("flex_attention", "sdpa", "eager") and _full_attention_only(model)


def attn_implementation(model: nn.Module) -> Optional[str]:
    """The attention implementation transformers runs for ``model`` (inside a peft wrapper), or None."""
    return getattr(getattr(base_model(model), "config", None), "_attn_implementation", None)


def packed_attention_mask(
    model: nn.Module,
    position_ids: torch.Tensor,
    segment_ids: Optional[torch.Tensor] = None,
    prefix_ids: Optional[torch.Tensor] = None,
) -> Optional[BlockMask | torch.Tensor]:
    """The ``attention_mask`` to pass with packed ``position_ids``: our ``BlockMask`` for a ``flex_attention``
    model without sliding-window layers, else None (transformers derives the mask from the position_ids).

    With ``segment_ids``/``prefix_ids`` (``[T]``, rows sharing prompts; only where ``supports_shared_prompts``)
    the shared-prompt mask: a ``BlockMask`` under flex_attention, a dense ``[1, 1, T, T]`` mask under sdpa/eager."""
    implementation = attn_implementation(model)
    if segment_ids is not None:
        if not supports_shared_prompts(model):
            raise ValueError(
                f"rows with shared prompts need flex_attention, sdpa or eager attention, not {implementation}"
            )
        if implementation == "flex_attention":
            return shared_prompt_block_mask(segment_ids, prefix_ids)
        return shared_prompt_dense_mask(segment_ids, prefix_ids, additive=implementation == "eager")
    if implementation != "flex_attention" or not _full_attention_only(model):
        return None
    return packed_block_mask(position_ids)
