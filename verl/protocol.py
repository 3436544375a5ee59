"""DataProto: the batch object passed between the driver, workers and algorithms.

A ``DataProto`` holds N rows in three parts:

* ``batch``: a ``tensordict.TensorDict`` with ``batch_size == [N]`` (every tensor has N rows), or
  ``None`` when the data has no tensors;
* ``non_tensor_batch``: ``dict[str, np.ndarray]``, each array of length N (per-row Python objects
  such as ``uid``, ``data_source``, ``reward_model`` live in arrays of dtype ``object``);
* ``meta_info``: a plain ``dict`` of batch-level settings (temperature, metrics, ...).

Names and signatures follow verl's ``verl.protocol`` so recipes written for verl port over. Differences
from verl, all deliberate:

* ``chunk`` never asserts equal chunk sizes (sizes follow ``np.array_split``) and ``split`` accepts a
  list of sizes: the number of conversations per step varies in multi-conversation RL.
* ``select``/``pop``/``rename`` raise ``KeyError`` for a missing key (naming it and the available keys)
  instead of silently ignoring it.
* ``pad_dataproto_to_divisor`` gives padding rows zero weight (see its docstring).
* ``make_iterator`` does not require ``len % mini_batch_size == 0`` (the last mini-batch may be shorter).

``concat`` merges ``meta_info`` as verl does: ``meta_info["metrics"]`` of all parts are gathered into one
dict of lists, and any other key present in several parts must hold equal values (``MetaInfoConflictError``,
which is both a ``ValueError`` and an ``AssertionError`` so code written against either keeps working).

The parts' values, keys and ``meta_info`` rules live in ``verl/protocol_values.py``, functions over whole DataProtos
(padding, collate, folding) in ``verl/protocol_ops.py``; both are re-exported here under upstream's names.
"""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from verl.protocol_values import (
    MetaInfoConflictError,
    arrays_equal,
    as_key_list,
    as_non_tensor_array,
    build_tensordict,
    check_keys_present,
    list_of_dict_to_dict_of_list,
    merge_meta_infos,
    missing_key_error,
    union_tensor_dict,
    values_equal,
)

__all__ = [
    "DataProto",
    "DataProtoItem",
    "MetaInfoConflictError",
    "AUTO_PADDING_KEY",
    "collate_fn",
    "list_of_dict_to_dict_of_list",
    "union_tensor_dict",
    "union_numpy_dict",
    "fold_batch_dim",
    "unfold_batch_dim",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
    "PADDING_FLAG_KEY",
    "PAD_ZEROED_MASK_KEYS",
]

# Bool tensor key added by ``pad_dataproto_to_divisor``: True on padding rows.
PADDING_FLAG_KEY = "is_padding"
# Tensor keys zeroed on padding rows so they add nothing to token-weighted losses or token counts.
PAD_ZEROED_MASK_KEYS = ("response_mask", "loss_mask")
# meta_info key set by ``from_dict(auto_padding=True)`` (verl's name); also enabled by env VERL_AUTO_PADDING=1.
AUTO_PADDING_KEY = "_verl_auto_padding"


def _describe(value: Any) -> str:
    """Short 'dtype[shape]' description used by __repr__."""
    dtype = str(value.dtype).replace("torch.", "")
    text = f"{dtype}{list(value.shape)}"
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        text += f"@{value.device}"
    return text


# --------------------------------------------------------------------------------------------------
# DataProtoItem / DataProto
# --------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class DataProtoItem:
    """One row of a DataProto: ``batch`` is a TensorDict with batch_size [] (or None)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class DataProto:
    """A batch of N rows: tensors (``batch``), per-row Python objects (``non_tensor_batch``), ``meta_info``.

    ``batch`` may also be given as a plain ``dict`` of tensors and non-tensor columns as lists; both are
    converted. Consistency (every column has N rows) is checked on construction.
    """

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.batch, dict):
            self.batch = build_tensordict(self.batch) if self.batch else None
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
        self.non_tensor_batch = {k: as_non_tensor_array(k, v) for k, v in self.non_tensor_batch.items()}
        if self.meta_info is None:
            self.meta_info = {}
        self.check_consistency()

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from a dict of tensors (all with the same first dimension) and a dict of non-tensors.

        ``num_batch_dims`` must be 1 (verl accepts the argument but its consistency check also rejects other
        values). ``auto_padding=True`` sets ``meta_info["_verl_auto_padding"]`` (see ``is_padding_enabled``).
        """
        if num_batch_dims != 1:
            raise ValueError(f"DataProto.from_dict: only num_batch_dims=1 is supported, got {num_batch_dims}")
        batch = build_tensordict(tensors) if tensors else None
        meta = dict(meta_info or {})
        if auto_padding:
            meta[AUTO_PADDING_KEY] = True
        return cls(batch=batch, non_tensor_batch=dict(non_tensors or {}), meta_info=meta)

    @classmethod
    def from_single_dict(
        cls, data: dict[str, Any], meta_info: dict[str, Any] | None = None, auto_padding: bool = False
    ) -> DataProto:
        """Build from one dict: tensors go to ``batch``; numpy arrays and lists go to ``non_tensor_batch``."""
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, (np.ndarray, list, tuple)):
                non_tensors[key] = value
            else:
                raise TypeError(
                    f"data['{key}'] must be a torch.Tensor, numpy array or list, got {type(value).__name__}"
                )
        return cls.from_dict(tensors, non_tensors, meta_info, auto_padding=auto_padding)

    # ---------------------------------------------------------------- basics
    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for value in self.non_tensor_batch.values():
            return int(value.shape[0])
        return 0

    def check_consistency(self) -> None:
        """Raise ValueError unless every tensor and non-tensor column has the same number of rows."""
        if self.batch is not None:
            if not isinstance(self.batch, TensorDict):
                raise TypeError(f"batch must be a TensorDict, got {type(self.batch).__name__}")
            if len(self.batch.batch_size) != 1:
                raise ValueError(
                    f"batch must have exactly one batch dimension, got batch_size={list(self.batch.batch_size)}"
                )
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")
        reference = "batch" if self.batch is not None else None
        num_rows = len(self)
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(f"non_tensor_batch['{key}'] must be a numpy array, got {type(value).__name__}")
            if reference is None:
                reference = f"non_tensor_batch['{key}']"
            if value.shape[0] != num_rows:
                raise ValueError(
                    f"non_tensor_batch['{key}'] has {value.shape[0]} rows but {reference} has {num_rows} rows"
                )

    def __repr__(self) -> str:
        def columns(items: Any) -> str:
            return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in items) + "}"

        batch = columns(self.batch.items()) if self.batch is not None else "None"
        non_tensor = columns(self.non_tensor_batch.items())
        return f"DataProto(len={len(self)}, batch={batch}, non_tensor_batch={non_tensor}, meta_info_keys={list(self.meta_info)})"

    def __iter__(self) -> Iterator[DataProtoItem]:
        for i in range(len(self)):
            yield self[i]

    # ---------------------------------------------------------------- indexing
    def __getitem__(self, item: Any) -> DataProto | DataProtoItem:
        """int -> DataProtoItem; slice, index list/array/tensor or bool mask -> DataProto."""
        if isinstance(item, torch.Tensor) and item.ndim == 0 and not item.dtype.is_floating_point:
            item = item.item()
        if isinstance(item, (bool, np.bool_)):
            raise TypeError("cannot index a DataProto with a single bool; use a boolean mask with one entry per row")
        if isinstance(item, (int, np.integer)):
            return self._row(int(item))
        if isinstance(item, slice):
            return self._with_rows(
                self.batch[item] if self.batch is not None else None,
                {k: v[item] for k, v in self.non_tensor_batch.items()},
            )
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            return self._take(self._as_row_indices(item))
        raise TypeError(f"cannot index a DataProto with {type(item).__name__}")

    def _row(self, index: int) -> DataProtoItem:
        num_rows = len(self)
        if not -num_rows <= index < num_rows:
            raise IndexError(f"row {index} out of range for DataProto with {num_rows} rows")
        index %= num_rows
        return DataProtoItem(
            batch=self.batch[index] if self.batch is not None else None,
            non_tensor_batch={k: v[index] for k, v in self.non_tensor_batch.items()},
            meta_info=self.meta_info,
        )

    def _as_row_indices(self, item: Any) -> np.ndarray:
        """Convert an index list/array/tensor or a bool mask into non-negative int64 row indices."""
        array = item.detach().cpu().numpy() if isinstance(item, torch.Tensor) else np.asarray(item)
        num_rows = len(self)
        if array.ndim != 1:
            raise IndexError(f"row indices must be 1-D, got shape {array.shape}")
        if array.dtype == np.bool_:
            if array.shape[0] != num_rows:
                raise IndexError(f"boolean mask has {array.shape[0]} entries but DataProto has {num_rows} rows")
            return np.flatnonzero(array)
        if array.size == 0:
            return np.zeros(0, dtype=np.int64)
        if not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"row indices must be integers or booleans, got dtype {array.dtype}")
        bad = array[(array < -num_rows) | (array >= num_rows)]
        if bad.size:
            raise IndexError(f"row index {int(bad[0])} out of range for DataProto with {num_rows} rows")
        return np.where(array < 0, array + num_rows, array).astype(np.int64)

    def _take(self, indices: np.ndarray) -> DataProto:
        batch = self.batch[torch.from_numpy(indices)] if self.batch is not None else None
        return self._with_rows(batch, {k: v[indices] for k, v in self.non_tensor_batch.items()})

    def _with_rows(self, batch: TensorDict | None, non_tensor_batch: dict[str, np.ndarray]) -> DataProto:
        return type(self)(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=dict(self.meta_info))

    # ---------------------------------------------------------------- key selection
    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """Return a new DataProto with the given keys (``None`` = all keys of that part).

        Without ``deepcopy`` the tensors and arrays are shared with ``self`` (the dicts are new);
        with ``deepcopy`` tensors are cloned and non-tensors/meta_info deep-copied.
        """
        batch_available = list(self.batch.keys()) if self.batch is not None else []
        check_keys_present("batch", batch_keys, batch_available)
        check_keys_present("non_tensor_batch", non_tensor_batch_keys, list(self.non_tensor_batch))
        check_keys_present("meta_info", meta_info_keys, list(self.meta_info))
        batch = None
        if self.batch is not None:
            batch = self.batch.select(*(batch_available if batch_keys is None else batch_keys))
        keys = self.non_tensor_batch.keys() if non_tensor_batch_keys is None else non_tensor_batch_keys
        non_tensor = {k: self.non_tensor_batch[k] for k in keys}
        meta = {k: self.meta_info[k] for k in (self.meta_info.keys() if meta_info_keys is None else meta_info_keys)}
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            non_tensor, meta = copy.deepcopy(non_tensor), copy.deepcopy(meta)
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove the given keys from ``self`` and return them as a new DataProto (``None`` = none).

        All keys are checked before anything is removed, so a KeyError leaves ``self`` unchanged.
        The returned DataProto keeps the row count even when it gets no tensors.
        """
        batch_keys, non_tensor_batch_keys = as_key_list(batch_keys), as_key_list(non_tensor_batch_keys)
        meta_info_keys = as_key_list(meta_info_keys)
        check_keys_present("batch", batch_keys, list(self.batch.keys()) if self.batch is not None else [])
        check_keys_present("non_tensor_batch", non_tensor_batch_keys, list(self.non_tensor_batch))
        check_keys_present("meta_info", meta_info_keys, list(self.meta_info))
        batch = None
        if self.batch is not None:
            batch = TensorDict({k: self.batch.pop(k) for k in batch_keys}, batch_size=self.batch.batch_size)
        non_tensor = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def rename(
        self, old_keys: str | Sequence[str] | None = None, new_keys: str | Sequence[str] | None = None
    ) -> DataProto:
        """Rename tensor keys (or non-tensor keys) in place and return ``self``."""
        old_keys, new_keys = as_key_list(old_keys), as_key_list(new_keys)
        if len(old_keys) != len(new_keys):
            raise ValueError(f"rename got {len(old_keys)} old keys {old_keys} but {len(new_keys)} new keys {new_keys}")
        batch_available = list(self.batch.keys()) if self.batch is not None else []
        for old, new in zip(old_keys, new_keys):
            if old in batch_available:
                if new in batch_available and new != old:
                    raise ValueError(f"cannot rename batch['{old}'] to '{new}': batch key '{new}' already exists")
                self.batch.rename_key_(old, new)
            elif old in self.non_tensor_batch:
                if new in self.non_tensor_batch and new != old:
                    raise ValueError(f"cannot rename non_tensor_batch['{old}'] to '{new}': key '{new}' already exists")
                self.non_tensor_batch[new] = self.non_tensor_batch.pop(old)
            else:
                raise missing_key_error("batch or non_tensor_batch", old, batch_available + list(self.non_tensor_batch))
            batch_available = list(self.batch.keys()) if self.batch is not None else []
        return self

    # ---------------------------------------------------------------- combining
    def union(self, other: DataProto) -> DataProto:
        """Merge ``other`` into ``self`` (in place, like verl) and return ``self``.

        Keys present in both must hold equal values (``torch.equal`` / element-wise array equality /
        ``==`` for meta_info), otherwise ValueError naming the key. Row counts must match unless one side
        has no rows of data at all (no tensors and no non-tensors).
        """
        self_empty = self.batch is None and not self.non_tensor_batch
        other_empty = other.batch is None and not other.non_tensor_batch
        if not self_empty and not other_empty and len(self) != len(other):
            raise ValueError(f"cannot union DataProto with {len(self)} rows and DataProto with {len(other)} rows")
        if other.batch is not None and self.batch is not None:
            for key, value in other.batch.items():
                if key in self.batch.keys() and not torch.equal(self.batch[key], value):
                    raise ValueError(f"cannot union: batch['{key}'] differs between the two DataProtos")
        for key, value in other.non_tensor_batch.items():
            if key in self.non_tensor_batch and not arrays_equal(self.non_tensor_batch[key], value):
                raise ValueError(f"cannot union: non_tensor_batch['{key}'] differs between the two DataProtos")
        for key, value in other.meta_info.items():
            if key in self.meta_info and not values_equal(self.meta_info[key], value):
                raise ValueError(f"cannot union: meta_info['{key}'] differs ({self.meta_info[key]!r} vs {value!r})")
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch.copy()
            else:
                for key, value in other.batch.items():
                    if key not in self.batch.keys():
                        self.batch[key] = value
        for key, value in other.non_tensor_batch.items():
            self.non_tensor_batch.setdefault(key, value)
        for key, value in other.meta_info.items():
            self.meta_info.setdefault(key, value)
        self.check_consistency()
        return self

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Concatenate DataProtos row-wise, preserving order.

        All parts need the same tensor keys, each with the same trailing shape (padding to a common
        width is the caller's job), and the same non-tensor keys. ``meta_info`` is the merge of all
        parts' meta_info by verl's rule: ``metrics`` of all parts become one dict of lists, any other key held
        by several parts must have equal values (``MetaInfoConflictError`` naming the key otherwise).
        """
        if len(data) == 0:
            raise ValueError("DataProto.concat needs at least one DataProto")
        first = data[0]
        batch = None
        if first.batch is not None:
            first_keys = sorted(first.batch.keys())
            for i, part in enumerate(data[1:], start=1):
                part_keys = sorted(part.batch.keys()) if part.batch is not None else []
                if part_keys != first_keys:
                    raise ValueError(f"cannot concat: part {i} has batch keys {part_keys} but part 0 has {first_keys}")
                for key in first_keys:
                    shape0, shape_i = tuple(first.batch[key].shape), tuple(part.batch[key].shape)
                    if shape0[1:] != shape_i[1:]:
                        raise ValueError(
                            f"cannot concat batch['{key}']: part 0 has shape {shape0} but part {i} has shape {shape_i}; "
                            "pad to a common width first"
                        )
            batch = torch.cat([part.batch for part in data], dim=0)
        elif any(part.batch is not None for part in data):
            raise ValueError("cannot concat: part 0 has no tensor batch but another part has one")
        first_nt_keys = list(first.non_tensor_batch)
        for i, part in enumerate(data[1:], start=1):
            if set(part.non_tensor_batch) != set(first_nt_keys):
                raise ValueError(
                    f"cannot concat: part {i} has non_tensor_batch keys {sorted(part.non_tensor_batch)} "
                    f"but part 0 has {sorted(first_nt_keys)}"
                )
        non_tensor = {k: np.concatenate([part.non_tensor_batch[k] for part in data], axis=0) for k in first_nt_keys}
        meta = merge_meta_infos([part.meta_info for part in data])
        return type(first)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    # ---------------------------------------------------------------- splitting / repeating
    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` parts like ``np.array_split``: sizes differ by at most one, earlier parts
        are larger, and when ``chunks > len(self)`` the trailing parts have 0 rows. Never asserts divisibility."""
        if not isinstance(chunks, (int, np.integer)) or chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        base, extra = divmod(len(self), int(chunks))
        return self.split([base + 1] * extra + [base] * (int(chunks) - extra))

    def split(self, split_size: int | Sequence[int]) -> list[DataProto]:
        """Split into pieces of ``split_size`` rows (the last may be shorter; 0 rows -> []), or into pieces
        of exactly the listed sizes, which must sum to ``len(self)``."""
        num_rows = len(self)
        if isinstance(split_size, (int, np.integer)):
            if split_size < 1:
                raise ValueError(f"split_size must be a positive int, got {split_size}")
            sizes = [min(int(split_size), num_rows - start) for start in range(0, num_rows, int(split_size))]
        else:
            sizes = [int(s) for s in split_size]
            if any(s < 0 for s in sizes):
                raise ValueError(f"split sizes must be non-negative, got {sizes}")
            if sum(sizes) != num_rows:
                raise ValueError(f"split sizes {sizes} sum to {sum(sizes)} but DataProto has {num_rows} rows")
        parts, start = [], 0
        for size in sizes:
            parts.append(self[start : start + size])
            start += size
        return parts

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat every row ``repeat_times`` times: interleave=True gives [a, a, b, b], False gives [a, b, a, b]."""
        if repeat_times < 1:
            raise ValueError(f"repeat_times must be >= 1, got {repeat_times}")
        rows = np.arange(len(self))
        indices = np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times)
        return self._take(indices)

    def reorder(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """Permute the rows in place: row i becomes old row ``indices[i]``. ``indices`` must be a permutation."""
        order = self._as_row_indices(indices)
        if not np.array_equal(np.sort(order), np.arange(len(self))):
            raise ValueError(f"reorder indices must be a permutation of range({len(self)}), got {order.tolist()}")
        if self.batch is not None:
            self.batch = self.batch[torch.from_numpy(order)]
        self.non_tensor_batch = {k: v[order] for k, v in self.non_tensor_batch.items()}

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Repeat row i ``repeat_times[i]`` times (0 drops it), keeping row order: counts [2, 0, 1] on rows
        [a, b, c] give [a, a, c]. ``repeat_times`` is a list, tuple, 1-D array or 1-D tensor of ints."""
        counts = repeat_times.detach().cpu().numpy() if isinstance(repeat_times, torch.Tensor) else repeat_times
        counts = np.asarray(counts)
        if counts.ndim != 1 or counts.shape[0] != len(self):
            raise ValueError(f"repeat_times must be 1-D with one count per row ({len(self)}), got shape {counts.shape}")
        if counts.size and (not np.issubdtype(counts.dtype, np.integer) or counts.min() < 0):
            raise ValueError(f"repeat_times must be non-negative integers, got {counts.tolist()}")
        return self._take(np.repeat(np.arange(len(self)), counts.astype(np.int64)))

    def select_idxs(self, idxs: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Rows at ``idxs`` (int indices or a bool mask), as a new DataProto (verl's name for ``self[idxs]``)."""
        return self._take(self._as_row_indices(idxs))

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """``self[start:end:step]`` as a DataProto."""
        return self[slice(start, end, step)]

    def make_iterator(
        self,
        mini_batch_size: int,
        epochs: int,
        seed: int | None = None,
        dataloader_kwargs: dict[str, Any] | None = None,
    ) -> Iterator[DataProto]:
        """Yield mini-batches of ``mini_batch_size`` rows, ``epochs`` times over the data (verl's signature).

        ``dataloader_kwargs`` follows ``torch.utils.data.DataLoader``: ``shuffle=True`` draws a new row order
        each epoch from a generator seeded with ``seed``, with the same draws a seeded ``DataLoader`` makes (so
        verl and this give the same mini-batches; tests/test_verl_compat.py checks it against a DataLoader); ``drop_last=True`` drops a short last mini-batch,
        which is otherwise kept (verl asserts divisibility instead). Every mini-batch carries ``meta_info``.
        """
        kwargs = dict(dataloader_kwargs or {})
        shuffle, drop_last = bool(kwargs.pop("shuffle", False)), bool(kwargs.pop("drop_last", False))
        for ignored in ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor"):
            kwargs.pop(ignored, None)
        if kwargs:
            raise ValueError(f"make_iterator: unsupported dataloader_kwargs {sorted(kwargs)}")
        if not isinstance(mini_batch_size, (int, np.integer)) or mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be a positive int, got {mini_batch_size!r}")
        generator = None
        if seed is not None:
            generator = torch.Generator()
            generator.manual_seed(int(seed))
        num_rows = len(self)

        def batches() -> Iterator[DataProto]:
            for _ in range(int(epochs)):
                order = torch.arange(num_rows)
                if shuffle:
                    # the draws a DataLoader(shuffle=True, generator=g) makes per epoch: a base seed for its
                    # workers, the permutation, and a second (unused, num_samples % n == 0) permutation
                    torch.empty((), dtype=torch.int64).random_(generator=generator)
                    order = torch.randperm(num_rows, generator=generator)
                    torch.randperm(num_rows, generator=generator)
                for start in range(0, num_rows, int(mini_batch_size)):
                    rows = order[start : start + int(mini_batch_size)]
                    if drop_last and len(rows) < mini_batch_size:
                        break
                    part = self._take(rows.numpy().astype(np.int64))
                    part.meta_info = self.meta_info
                    yield part

        return batches()

    def is_padding_enabled(self) -> bool:
        """verl's auto-padding flag (``from_dict(auto_padding=True)`` or env ``VERL_AUTO_PADDING=1``).

        Informational here: ``chunk`` accepts any row count either way."""
        enabled_by_env = os.getenv("VERL_AUTO_PADDING", "FALSE").upper() in ("TRUE", "1")
        return enabled_by_env or bool(self.meta_info.get(AUTO_PADDING_KEY, False))

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the first (``"first"``) or otherwise the last row, in place."""
        if padding_size <= 0:
            return
        row = 0 if padding_candidate == "first" else len(self) - 1
        padded = DataProto.concat([self, self._take(np.full(int(padding_size), row, dtype=np.int64))])
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def to_tensordict(self) -> TensorDict:
        """One ``TensorDict`` holding everything (verl's ``to_tensordict``): the tensors, each non-tensor
        column as a ``NonTensorStack`` of its row values (``td["uid"]`` reads back a list), and each
        ``meta_info`` entry as non-tensor data (``td["temperature"]``). Keys must not collide."""
        from tensordict import NonTensorData, NonTensorStack

        num_rows = len(self)
        td = self.batch.copy() if self.batch is not None else TensorDict({}, batch_size=[num_rows])
        for kind, keys in (("non_tensor_batch", self.non_tensor_batch), ("meta_info", self.meta_info)):
            shared = sorted(set(keys) & set(td.keys()))
            if shared:
                raise ValueError(f"to_tensordict: {kind} keys {shared} collide with keys already in the TensorDict")
            if kind == "non_tensor_batch":
                for key, values in self.non_tensor_batch.items():
                    td[key] = NonTensorStack(*[NonTensorData(v) for v in values.tolist()], batch_size=[num_rows])
            else:
                for key, value in self.meta_info.items():
                    td.set_non_tensor(key, value)
        return td

    # ---------------------------------------------------------------- devices, copies, persistence
    def to(self, device: str | torch.device) -> DataProto:
        """Move the tensors to ``device`` (in place) and return ``self``."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def clone(self) -> DataProto:
        """Deep copy: tensors cloned, non-tensors and meta_info deep-copied."""
        return type(self)(
            batch=self.batch.clone() if self.batch is not None else None,
            non_tensor_batch=copy.deepcopy(self.non_tensor_batch),
            meta_info=copy.deepcopy(self.meta_info),
        )

    def save_to_disk(self, filepath: str) -> None:
        """Pickle this DataProto to ``filepath``."""
        with open(filepath, "wb") as f:
            pickle.dump(self, f)

    @staticmethod
    def load_from_disk(filepath: str) -> DataProto:
        """Load a DataProto written by ``save_to_disk``."""
        with open(filepath, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise TypeError(f"{filepath} holds a {type(data).__name__}, not a DataProto")
        return data


# Functions over whole DataProtos (padding, collate, folding, numpy-dict union) live in verl/protocol_ops.py and are
# re-exported here under upstream's import path; the import sits at the end because they need the classes above.
from verl.protocol_ops import (  # noqa: E402
    collate_fn,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    union_numpy_dict,
    unpad_dataproto,
)
