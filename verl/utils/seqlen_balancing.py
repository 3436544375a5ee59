"""Group rows into micro-batches by a token budget ("dynamic batch size").

A micro-batch is a list of row indices. With ``use_dynamic_bsz`` the actor does not use a fixed number of rows
per micro-batch; instead it packs rows so that the sum of their valid lengths (``attention_mask.sum(-1)``)
stays within ``max_token_len`` (``ppo_max_token_len_per_gpu`` / ``log_prob_max_token_len_per_gpu``), and
balances the token load across micro-batches.

Rules (all tested in ``tests/test_dp_actor.py``):

* every row lands in exactly one micro-batch; rows inside a micro-batch keep their original order;
* a micro-batch never holds more than ``max_token_len`` tokens, except a single row longer than the budget,
  which gets a micro-batch of its own (a warning is logged; it cannot be split);
* the number of micro-batches is the smallest ``k >= ceil(total / max_token_len)`` for which the greedy
  balancer fits, then raised to the maximum over the data-parallel group (``dp_group``) so that every rank runs
  the same number of forward/backward passes (FSDP collectives must line up). Extra micro-batches may be
  empty; callers run a zero-weight dummy pass for them.
* ``get_reverse_idx`` turns the concatenated micro-batch order back into the original row order.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

__all__ = [
    "get_seqlen_balanced_partitions",
    "rearrange_micro_batches",
    "split_rows_evenly",
    "get_reverse_idx",
    "sync_max_count",
]

logger = logging.getLogger(__name__)


def _as_int_list(seqlens: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(seqlens, torch.Tensor):
        return [int(x) for x in seqlens.reshape(-1).tolist()]
    return [int(x) for x in seqlens]


def get_seqlen_balanced_partitions(
    seqlen_list: Sequence[int] | torch.Tensor, k_partitions: int, equal_size: bool = False
) -> list[list[int]]:
    """Split row indices into ``k_partitions`` groups with balanced total length (greedy LPT).

    Rows are taken longest first and each goes to the partition with the smallest current sum (ties: lower
    partition index). With ``equal_size`` a partition stops accepting rows once it holds
    ``ceil(n / k)`` rows. Indices inside each partition are sorted; partitions may be empty when
    ``k_partitions`` exceeds the number of rows.

    Example: lengths ``[5, 1, 4, 2]`` into 2 partitions -> ``[[0, 1], [2, 3]]`` (sums 6 and 6).
    """
    lengths = _as_int_list(seqlen_list)
    if k_partitions < 1:
        raise ValueError(f"k_partitions must be >= 1, got {k_partitions}")
    capacity = math.ceil(len(lengths) / k_partitions) if equal_size else len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap = [(0, p) for p in range(k_partitions)]  # (current sum, partition id)
    partitions: list[list[int]] = [[] for _ in range(k_partitions)]
    for index in order:
        total, part = heapq.heappop(heap)
        partitions[part].append(index)
        if len(partitions[part]) < capacity:  # a full partition leaves the heap for good
            heapq.heappush(heap, (total + lengths[index], part))
    return [sorted(p) for p in partitions]


def sync_max_count(count: int, dp_group: Optional[dist.ProcessGroup] = None, device: str | torch.device = "cpu") -> int:
    """Maximum of ``count`` over the data-parallel group (``count`` itself when torch.distributed is not used)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(dp_group) == 1:
        return int(count)
    tensor = torch.tensor([int(count)], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=dp_group)
    return int(tensor.item())


def rearrange_micro_batches(
    seqlens: Sequence[int] | torch.Tensor,
    max_token_len: int,
    dp_group: Optional[dist.ProcessGroup] = None,
    min_num_micro_batch: Optional[int] = None,
    same_micro_num_in_dp: bool = True,
    device: str | torch.device = "cpu",
) -> list[list[int]]:
    """Partition rows (given their valid lengths) into micro-batches of at most ``max_token_len`` tokens.

    Returns a list of index lists; concatenating them and applying ``get_reverse_idx`` restores the row
    order. See the module docstring for the rules.
    """
    lengths = _as_int_list(seqlens)
    if max_token_len <= 0:
        raise ValueError(f"max_token_len must be > 0, got {max_token_len}")
    if any(length < 0 for length in lengths):
        raise ValueError(f"sequence lengths must be >= 0, got {lengths}")
    oversized = [i for i, length in enumerate(lengths) if length > max_token_len]
    if oversized:
        logger.warning(
            "dynamic bsz: %d row(s) are longer than max_token_len=%d (longest %d tokens); each gets its own "
            "micro-batch. Raise ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu to avoid this.",
            len(oversized),
            max_token_len,
            max(lengths[i] for i in oversized),
        )

    def fits(parts: list[list[int]]) -> bool:
        for part in parts:
            total = sum(lengths[i] for i in part)
            if total > max_token_len and len(part) > 1:
                return False
        return True

    num_rows = len(lengths)
    k = max(1, math.ceil(sum(lengths) / max_token_len), min_num_micro_batch or 1)
    k = min(k, max(num_rows, 1)) if num_rows else k
    partitions = get_seqlen_balanced_partitions(lengths, k)
    while not fits(partitions):
        k += 1  # terminates: with k == num_rows every row is alone
        partitions = get_seqlen_balanced_partitions(lengths, k)
    if same_micro_num_in_dp:
        synced = sync_max_count(k, dp_group, device)
        if synced != k:
            k = synced
            partitions = get_seqlen_balanced_partitions(lengths, k)
    # Non-empty micro-batches first, in order of their first row; empty ones (only from DP syncing) last.
    partitions.sort(key=lambda part: (len(part) == 0, part[0] if part else 0))
    return partitions


def split_rows_evenly(num_rows: int, num_chunks: int) -> list[list[int]]:
    """Contiguous index chunks whose sizes differ by at most one (first chunks larger), like ``np.array_split``.

    Chunks may be empty when ``num_chunks > num_rows``. Example: ``split_rows_evenly(5, 2) == [[0, 1, 2], [3, 4]]``.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    base, extra = divmod(num_rows, num_chunks)
    chunks, start = [], 0
    for c in range(num_chunks):
        size = base + (1 if c < extra else 0)
        chunks.append(list(range(start, start + size)))
        start += size
    return chunks


def get_reverse_idx(idx_map: Sequence[int]) -> list[int]:
    """Inverse permutation: ``reverse[idx_map[i]] = i``.

    Example: the micro-batches ``[[0, 2], [1]]`` concatenate to ``[0, 2, 1]``; outputs stacked in that order
    are restored to row order by indexing with ``get_reverse_idx([0, 2, 1]) == [0, 2, 1]``.
    """
    idx = list(idx_map)
    reverse = [0] * len(idx)
    seen = [False] * len(idx)
    for position, original in enumerate(idx):
        if not 0 <= original < len(idx) or seen[original]:
            raise ValueError(f"idx_map must be a permutation of 0..{len(idx) - 1}, got {idx}")
        seen[original] = True
        reverse[original] = position
    return reverse
