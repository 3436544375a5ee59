"""Values, keys and ``meta_info`` of a :class:`~verl.protocol.DataProto`'s parts (``verl/protocol.py``).

Building a ``TensorDict`` of N rows and per-row object arrays with errors that name the column, equality of
``meta_info`` values and arrays (tensors, object arrays, NaN-aware floats), key checks that name the missing key and
the available ones, and verl's ``concat`` rule for ``meta_info`` (``metrics`` gathered into a dict of lists, other
shared keys must agree: :class:`MetaInfoConflictError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

__all__ = [
    "MetaInfoConflictError",
    "arrays_equal",
    "as_key_list",
    "as_non_tensor_array",
    "build_tensordict",
    "check_keys_present",
    "list_of_dict_to_dict_of_list",
    "merge_meta_infos",
    "missing_key_error",
    "to_object_array",
    "union_tensor_dict",
    "values_equal",
]


class MetaInfoConflictError(ValueError, AssertionError):
    """Two DataProtos to be concatenated hold different values under the same ``meta_info`` key."""


def to_object_array(values: Sequence[Any]) -> np.ndarray:
    """Return a 1-D object array with one element per item of ``values``.

    Filled element by element so that a list of equal-length lists stays a 1-D array of lists
    (``np.array`` would build a 2-D array instead).
    """
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array


def as_non_tensor_array(key: str, value: Any) -> np.ndarray:
    """Convert a non-tensor column to a numpy array (lists/tuples become 1-D object arrays)."""
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"non_tensor_batch['{key}'] is a 0-dim array; it needs one entry per row")
        return value
    if isinstance(value, (list, tuple)):
        return to_object_array(value)
    raise TypeError(f"non_tensor_batch['{key}'] must be a numpy array or a list, got {type(value).__name__}")


def build_tensordict(tensors: dict[str, torch.Tensor]) -> TensorDict:
    """Build a TensorDict with batch_size [N] from tensors that all have N rows (named errors otherwise)."""
    first_key, num_rows = None, None
    for key, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"batch['{key}'] must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.ndim == 0:
            raise ValueError(f"batch['{key}'] is a 0-dim tensor; every tensor needs a leading row dimension")
        if num_rows is None:
            first_key, num_rows = key, tensor.shape[0]
        elif tensor.shape[0] != num_rows:
            raise ValueError(f"batch['{key}'] has {tensor.shape[0]} rows but batch['{first_key}'] has {num_rows} rows")
    return TensorDict(dict(tensors), batch_size=[num_rows or 0])


def values_equal(a: Any, b: Any) -> bool:
    """Equality for meta_info values and object-array elements (tensors, arrays, NaN-aware floats)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return arrays_equal(np.asarray(a), np.asarray(b))
    if isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Shape- and element-wise equality of two numpy arrays, including object arrays."""
    if a.shape != b.shape:
        return False
    if a.dtype != object and b.dtype != object:
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc"))
    return all(values_equal(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1)))


def missing_key_error(kind: str, missing: str, available: Sequence[str]) -> KeyError:
    return KeyError(f"{kind} key '{missing}' not found; available {kind} keys: {sorted(available)}")


def check_keys_present(kind: str, wanted: Sequence[str] | None, available: Sequence[str]) -> None:
    for key in wanted or ():
        if key not in available:
            raise missing_key_error(kind, key, available)


def as_key_list(keys: str | Sequence[str] | None) -> list[str]:
    if keys is None:
        return []
    if isinstance(keys, str):
        return [keys]
    return list(keys)


def list_of_dict_to_dict_of_list(list_of_dict: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """``[{"a": 1}, {"a": 2}] -> {"a": [1, 2]}``; every dict needs the keys of the first (KeyError otherwise)."""
    if not list_of_dict:
        return {}
    keys = list(list_of_dict[0])
    output: dict[str, list[Any]] = {key: [] for key in keys}
    for i, item in enumerate(list_of_dict):
        if set(item) != set(keys):
            raise KeyError(f"dict {i} has keys {sorted(item)} but dict 0 has {sorted(keys)}")
        for key in keys:
            output[key].append(item[key])
    return output


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add the keys of ``tensor_dict2`` to ``tensor_dict1`` (in place); shared keys must hold equal tensors."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise ValueError(
            f"union_tensor_dict: batch sizes differ ({list(tensor_dict1.batch_size)} vs {list(tensor_dict2.batch_size)})"
        )
    for key, value in tensor_dict2.items():
        if key in tensor_dict1.keys():
            if not torch.equal(tensor_dict1[key], value):
                raise ValueError(f"union_tensor_dict: '{key}' differs between the two TensorDicts")
        else:
            tensor_dict1[key] = value
    return tensor_dict1


def merge_meta_infos(meta_infos: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """verl's concat rule: ``metrics`` gathered into a dict of lists; other shared keys must agree."""
    merged: dict[str, Any] = {}
    metrics: list[dict[str, Any]] = []
    for i, meta in enumerate(meta_infos):
        for key, value in meta.items():
            if key == "metrics":
                if value is not None:
                    metrics.extend(value if isinstance(value, list) else [value])
            elif key in merged and not values_equal(merged[key], value):
                raise MetaInfoConflictError(
                    f"Conflicting values for meta_info key '{key}': {merged[key]!r} (earlier part) vs {value!r} (part {i})"
                )
            else:
                merged.setdefault(key, value)
    if metrics:
        merged["metrics"] = list_of_dict_to_dict_of_list(metrics)
    return merged
