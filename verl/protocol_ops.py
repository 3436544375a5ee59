"""Functions over whole DataProtos: padding to a divisor, collate, folding the batch dimension, numpy-dict union.

Re-exported by ``verl.protocol`` (upstream verl's import path for all of them); import them from there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tensordict import TensorDict

from verl.protocol import PAD_ZEROED_MASK_KEYS, PADDING_FLAG_KEY, DataProto, DataProtoItem
from verl.protocol_values import arrays_equal, list_of_dict_to_dict_of_list, to_object_array

__all__ = [
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
    "collate_fn",
    "fold_batch_dim",
    "unfold_batch_dim",
    "union_numpy_dict",
]


# --------------------------------------------------------------------------------------------------
# padding to a divisor (e.g. the data-parallel world size)
# --------------------------------------------------------------------------------------------------


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` so its row count is a multiple of ``size_divisor``; return ``(padded, pad_size)``.

    Padding rows are copies of existing rows, cycled from the start (rows 0, 1, ... as in verl), with
    **zero weight**:

    * every tensor named in ``PAD_ZEROED_MASK_KEYS`` (``response_mask``, ``loss_mask``) is zeroed on
      padding rows, so they add nothing to token-weighted losses or token counts;
    * ``attention_mask`` is deliberately kept: a fully zero attention mask can give NaN in attention
      for some models, and padding rows still run through the forward pass;
    * a bool tensor ``batch["is_padding"]`` (``PADDING_FLAG_KEY``) is True on padding rows and False on
      real rows (an existing ``is_padding`` column is kept for the real rows).

    ``pad_size == 0`` returns ``data`` itself unchanged (no ``is_padding`` key is added).
    """
    if size_divisor < 1:
        raise ValueError(f"size_divisor must be a positive int, got {size_divisor}")
    num_rows = len(data)
    pad_size = -num_rows % size_divisor
    if pad_size == 0:
        return data, 0
    pad_rows = data._take(np.arange(pad_size) % num_rows)
    pad_batch = pad_rows.batch if pad_rows.batch is not None else TensorDict({}, batch_size=[pad_size])
    for key in PAD_ZEROED_MASK_KEYS:
        if key in pad_batch.keys():
            pad_batch[key] = torch.zeros_like(pad_batch[key])
    real_batch = data.batch if data.batch is not None else TensorDict({}, batch_size=[num_rows])
    if PADDING_FLAG_KEY not in real_batch.keys():
        real_batch = real_batch.copy()
        real_batch[PADDING_FLAG_KEY] = torch.zeros(num_rows, dtype=torch.bool, device=real_batch.device)
    pad_batch[PADDING_FLAG_KEY] = torch.ones(pad_size, dtype=torch.bool, device=pad_batch.device)
    real = DataProto(batch=real_batch, non_tensor_batch=data.non_tensor_batch, meta_info=data.meta_info)
    pad_rows.batch = pad_batch
    padded = DataProto.concat([real, pad_rows])
    padded.meta_info = dict(data.meta_info)
    return padded, pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows added by ``pad_dataproto_to_divisor``.

    The ``is_padding`` key is dropped too when no remaining row is padding, so pad-then-unpad gives
    back the original keys. ``pad_size == 0`` returns ``data`` unchanged.
    """
    if pad_size < 0 or pad_size > len(data):
        raise ValueError(f"pad_size must be in [0, {len(data)}] for a DataProto with {len(data)} rows, got {pad_size}")
    if pad_size == 0:
        return data
    unpadded = data[: len(data) - pad_size]
    if unpadded.batch is not None and PADDING_FLAG_KEY in unpadded.batch.keys():
        if not bool(unpadded.batch[PADDING_FLAG_KEY].any()):
            unpadded.batch = unpadded.batch.exclude(PADDING_FLAG_KEY)
            if not list(unpadded.batch.keys()) and unpadded.non_tensor_batch:
                unpadded.batch = None
    return unpadded


def collate_fn(items: Sequence[DataProtoItem]) -> DataProto:
    """Stack ``DataProtoItem`` rows back into a DataProto (verl's DataLoader collate function)."""
    if not items:
        raise ValueError("collate_fn needs at least one DataProtoItem")
    batch = torch.stack([item.batch for item in items]).contiguous() if items[0].batch is not None else None
    columns = list_of_dict_to_dict_of_list([item.non_tensor_batch for item in items])
    return DataProto(batch=batch, non_tensor_batch={k: to_object_array(v) for k, v in columns.items()})


# --------------------------------------------------------------------------------------------------
# folding the batch dimension, numpy-dict union (upstream's helpers)
# --------------------------------------------------------------------------------------------------


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """Rows ``[B, ...] -> [new_batch_size, B // new_batch_size, ...]`` for every tensor and non-tensor column
    (``B`` must be divisible); ``meta_info`` is shared. Example: 6 rows folded to 2 -> tensors ``[2, 3, ...]``."""
    num_rows = len(data)
    if new_batch_size < 1 or num_rows % new_batch_size != 0:
        raise ValueError(f"fold_batch_dim: {num_rows} rows cannot be folded into {new_batch_size} rows")
    per_row = num_rows // new_batch_size
    batch = None
    if data.batch is not None:
        tensors = {k: v.reshape(new_batch_size, per_row, *v.shape[1:]) for k, v in data.batch.items()}
        batch = TensorDict(tensors, batch_size=[new_batch_size])
    non_tensor = {k: np.reshape(v, (new_batch_size, per_row, *v.shape[1:])) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Inverse of :func:`fold_batch_dim`: the first ``batch_dims`` dimensions of every column become the rows."""
    if batch_dims < 1:
        raise ValueError(f"unfold_batch_dim: batch_dims must be >= 1, got {batch_dims}")
    batch, num_rows = None, None
    if data.batch is not None:
        tensors = {k: v.reshape(-1, *v.shape[batch_dims:]) for k, v in data.batch.items()}
        num_rows = next(iter(tensors.values())).shape[0] if tensors else 0
        batch = TensorDict(tensors, batch_size=[num_rows])
    non_tensor = {k: np.reshape(v, (-1, *v.shape[batch_dims:])) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def union_numpy_dict(dict1: dict[str, np.ndarray], dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add the arrays of ``dict2`` to ``dict1`` (in place) and return it; a key in both must hold equal arrays
    (element-wise, NaN equal to NaN, object arrays compared element by element), else ``ValueError`` naming it."""
    for key, value in dict2.items():
        if key in dict1:
            if not (isinstance(dict1[key], np.ndarray) and isinstance(value, np.ndarray)):
                raise TypeError(f"union_numpy_dict: '{key}' must be a numpy array in both dicts")
            if not arrays_equal(dict1[key], value):
                raise ValueError(f"union_numpy_dict: '{key}' differs between the two dicts")
        dict1[key] = value
    return dict1
