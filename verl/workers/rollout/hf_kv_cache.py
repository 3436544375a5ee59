"""A preallocated KV cache for batched HF decoding that only attends over the filled part.

Each layer owns two buffers of shape ``[max_batch_size, kv_heads, max_model_len, head_dim]``, allocated
once (on the first forward, when the head shapes are known) and reused by every batch. ``update``
writes the new keys/values in place and returns views ``buf[:B, :, :length]``, so attention costs what
the sequence needs (unlike transformers' ``StaticCache``, which always attends over ``max_cache_len``
and fixes the batch size). The class plugs into transformers through the ``Cache``/``DynamicLayer``
API, so the model's own attention and masking code is used unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One layer's K/V storage; behaves like a ``DynamicLayer`` whose tensors live in fixed buffers."""

    def __init__(self, max_batch_size: int, max_len: int):
        super().__init__()
        self.max_batch_size = max_batch_size
        self.max_len = max_len
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None
        self.batch_size = 0
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        if self.key_buffer is None or self.key_buffer.device != key_states.device:
            heads, k_dim, v_dim = key_states.shape[1], key_states.shape[-1], value_states.shape[-1]
            shape = (self.max_batch_size, heads, self.max_len)
            self.key_buffer = torch.zeros(*shape, k_dim, dtype=key_states.dtype, device=key_states.device)
            self.value_buffer = torch.zeros(*shape, v_dim, dtype=value_states.dtype, device=value_states.device)
        self.is_initialized = True

    def start(self, batch_size: int) -> None:
        """Begin a new batch of ``batch_size`` rows with an empty cache (buffers are kept)."""
        if batch_size > self.max_batch_size:
            raise ValueError(f"batch of {batch_size} rows exceeds max_batch_size={self.max_batch_size}")
        self.batch_size = batch_size
        self.length = 0
        self._set_views()

    def _set_views(self) -> None:
        if self.key_buffer is not None:
            self.keys = self.key_buffer[: self.batch_size, :, : self.length]
            self.values = self.value_buffer[: self.batch_size, :, : self.length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.key_buffer is None or not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, new = key_states.shape[0], key_states.shape[-2]
        if rows != self.batch_size:
            raise RuntimeError(f"KV cache was started for {self.batch_size} rows but got {rows}")
        end = self.length + new
        if end > self.max_len:
            raise RuntimeError(f"KV cache overflow: {end} positions > max_model_len={self.max_len}")
        self.key_buffer[:rows, :, self.length : end].copy_(key_states)
        self.value_buffer[:rows, :, self.length : end].copy_(value_states)
        self.length = end
        self._set_views()
        return self.keys, self.values

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_len

    def keep_rows(self, index: torch.Tensor) -> None:
        """Compact the batch to the rows in ``index`` (a 1-D long tensor, in the new order)."""
        if self.key_buffer is not None and self.length > 0:
            k = self.key_buffer[index, :, : self.length]
            v = self.value_buffer[index, :, : self.length]
            self.key_buffer[: len(index), :, : self.length].copy_(k)
            self.value_buffer[: len(index), :, : self.length].copy_(v)
        self.batch_size = int(index.numel())
        self._set_views()

    def release(self) -> None:
        """Free the buffers (they are reallocated on the next forward)."""
        self.key_buffer = self.value_buffer = None
        self.keys = self.values = None
        self.is_initialized = False
        self.batch_size = self.length = 0

    def reset(self) -> None:
        self.length = 0
        self._set_views()


class PreallocatedKVCache(DynamicCache):
    """A transformers ``Cache`` made of :class:`PreallocatedLayer` (one per decoder layer)."""

    def __init__(self, num_layers: int, max_batch_size: int, max_len: int):
        Cache.__init__(self, layers=[PreallocatedLayer(max_batch_size, max_len) for _ in range(num_layers)])
        self.max_batch_size_rows = max_batch_size
        self.max_len = max_len

    def start(self, batch_size: int) -> None:
        """Begin a new batch; previously written K/V is ignored."""
        for layer in self.layers:
            layer.start(batch_size)

    def keep_rows(self, index: torch.Tensor) -> None:
        """Drop finished rows: keep ``index`` rows, compacted to the front."""
        for layer in self.layers:
            layer.keep_rows(index)

    def release(self) -> None:
        """Free all buffers (used by ``sleep``)."""
        for layer in self.layers:
            layer.release()

    def allocated_bytes(self) -> int:
        """Bytes held by the K/V buffers right now."""
        total = 0
        for layer in self.layers:
            for buf in (layer.key_buffer, layer.value_buffer):
                if buf is not None:
                    total += buf.numel() * buf.element_size()
        return total
