"""Group rows into micro-batches by a token budget ("dynamic batch size").

A micro-batch is a list of row indices. With ``use_dynamic_bsz`` the actor does not use a fixed number of rows
per micro-batch; instead it packs rows so that the sum of their valid lengths (``attention_mask.sum(-1)``)
stays within ``max_token_len`` (``ppo_max_token_len_per_gpu`` / ``log_prob_max_token_len_per_gpu``) where
the rules below allow, and balances the token load across micro-batches.

Rules (all tested in ``tests/test_dp_actor.py``):

* every row lands in exactly one micro-batch; rows inside a micro-batch keep their original order;
* the number of micro-batches is upstream verl's: ``k = min(rows, ceil(total / max_token_len))``, the fewest
  that can hold the tokens, then raised to the maximum over the data-parallel group (``dp_group``) so that
  every rank runs the same number of forward/backward passes (FSDP collectives must line up). Extra
  micro-batches may be empty; callers run a zero-weight dummy pass for them. Fewer micro-batches means fewer
  forward/backward passes and FSDP parameter gathers for the same tokens;
* rows are balanced over the ``k`` micro-batches with the Karmarkar-Karp largest differencing method (as
  upstream's ``get_seqlen_balanced_partitions``; ``greedy_partition`` keeps the simpler longest-first rule);
  when that partition puts more than ``max_token_len`` tokens in a micro-batch, a depth-first search
  (``pack_within_budget``) looks for ``k`` micro-batches within the budget; when none is found (bin packing
  can need more than ``ceil(total / max_token_len)`` bins), the count stays ``k``, as upstream, and of the
  Karmarkar-Karp and longest-first partitions the one with the smaller largest micro-batch is used: it
  exceeds the budget by less than the longest row (longest-first guarantees ``< total / k + longest row``).
  Example: ``[6, 6, 6, 6, 3, 3]`` with a budget of 10 gives 3 micro-batches of 12, 9 and 9 tokens, not 4
  within the budget. Memory estimates must therefore allow ``max_token_len + longest row`` tokens;
* ``get_reverse_idx`` turns the concatenated micro-batch order back into the original row order.

``rearrange_micro_batches`` takes either per-row lengths (returns the index lists) or, as upstream verl, a
``TensorDict`` with ``attention_mask`` (returns ``(micro_batches, indices)``); ``prepare_dynamic_batch`` /
``restore_dynamic_batch`` are upstream's DataProto-level pair.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict

__all__ = [
    "ceildiv",
    "roundup_divisible",
    "karmarkar_karp",
    "greedy_partition",
    "pack_within_budget",
    "log_seqlen_unbalance",
    "prepare_dynamic_batch",
    "restore_dynamic_batch",
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


def ceildiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints."""
    return -(a // -b)


def roundup_divisible(a: int, b: int) -> int:
    """The smallest multiple of ``b`` that is ``>= a``."""
    return ceildiv(a, b) * b


def _set_key(subset: list) -> tuple:
    # order of one subset: total length, then item count, then the (index, length) items in insertion order
    return (subset[0], len(subset[1]), subset[1])


class _KKState:
    """k subsets ``[total, [(index, length), ...]]`` kept in decreasing order (largest differencing method)."""

    def __init__(self, items: Sequence[tuple[int, int]], k: int) -> None:
        self.sets = [[0, []] for _ in range(k)]
        for position, (index, length) in enumerate(items):
            self.sets[position] = [length, [(index, length)]]
        self.sets.sort(key=_set_key, reverse=True)

    @property
    def spread(self) -> int:
        return self.sets[0][0] - self.sets[-1][0]

    def merge(self, other: _KKState) -> None:
        """Largest subset of ``self`` joins the smallest of ``other``, and so on."""
        k = len(self.sets)
        for i in range(k):
            partner = other.sets[k - 1 - i]
            self.sets[i][0] += partner[0]
            self.sets[i][1].extend(partner[1])
        self.sets.sort(key=_set_key, reverse=True)

    def __lt__(self, other: _KKState) -> bool:  # heap order: largest spread first, then the largest subset
        if self.spread != other.spread:
            return self.spread > other.spread
        return _set_key(self.sets[0]) > _set_key(other.sets[0])


def karmarkar_karp(seqlen_list: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Karmarkar-Karp partition of row indices into ``k_partitions`` groups with balanced length sums.

    Each row starts as its own k-subset state; the two states with the largest spread are merged (largest subset
    with smallest) until one is left. With ``equal_size`` the rows, sorted by length, enter in groups of ``k``
    (one per subset), so the partitions have equal row counts; when ``k`` does not divide the row count,
    zero-length placeholder rows fill the last group and are dropped again (sizes then differ by at most one;
    upstream asserts divisibility instead). Partitions come largest sum first; indices in insertion order.
    """
    lengths = _as_int_list(seqlen_list)
    if k_partitions < 1:
        raise ValueError(f"k_partitions must be >= 1, got {k_partitions}")
    ordered = sorted((length, index) for index, length in enumerate(lengths))
    if equal_size:
        pad = -len(ordered) % k_partitions
        ordered = [(0, -1 - j) for j in range(pad)] + ordered  # placeholders: negative indices, length 0
        groups = [ordered[i : i + k_partitions] for i in range(0, len(ordered), k_partitions)]
        states = [_KKState([(index, length) for length, index in group], k_partitions) for group in groups]
    else:
        states = [_KKState([(index, length)], k_partitions) for length, index in ordered]
    if not states:
        return [[] for _ in range(k_partitions)]
    heap: list[_KKState] = []
    for state in states:
        heapq.heappush(heap, state)
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.merge(second)
        heapq.heappush(heap, first)
    return [[index for index, _ in subset[1] if index >= 0] for subset in heap[0].sets]


def greedy_partition(seqlen_list: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Longest-first greedy partition: each row goes to the partition with the smallest sum (ties: lower id);
    with ``equal_size`` a partition takes at most ``ceil(n / k)`` rows. Partitions in id order."""
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
    return partitions


def get_seqlen_balanced_partitions(
    seqlen_list: Sequence[int] | torch.Tensor, k_partitions: int, equal_size: bool = False
) -> list[list[int]]:
    """Split row indices into ``k_partitions`` groups with balanced total length (Karmarkar-Karp, as upstream).

    Indices inside each partition are sorted; partitions come largest sum first. Unlike upstream, ``k_partitions``
    may exceed the number of rows (the extra partitions are empty) and ``equal_size`` does not need ``k`` to
    divide the row count (see ``karmarkar_karp``).

    Example: lengths ``[5, 1, 4, 2]`` into 2 partitions -> ``[[2, 3], [0, 1]]`` (sums 6 and 6).
    """
    return [sorted(p) for p in karmarkar_karp(seqlen_list, k_partitions, equal_size)]


def log_seqlen_unbalance(seqlen_list: Sequence[int], partitions: Sequence[Sequence[int]], prefix: str) -> dict:
    """Token-sum spread before (contiguous equal chunks) and after balancing (``partitions``), as upstream:
    ``{prefix}/min``, ``/max``, ``/minmax_diff`` (contiguous chunks), ``/balanced_min``, ``/balanced_max``,
    ``/mean`` (total / number of partitions)."""
    lengths = _as_int_list(seqlen_list)
    k = len(partitions)
    chunk = max(len(lengths) // k, 1)
    contiguous = [sum(lengths[i : i + chunk]) for i in range(0, len(lengths), chunk)]
    balanced = [sum(lengths[i] for i in part) for part in partitions]
    return {
        f"{prefix}/min": min(contiguous),
        f"{prefix}/max": max(contiguous),
        f"{prefix}/minmax_diff": max(contiguous) - min(contiguous),
        f"{prefix}/balanced_min": min(balanced),
        f"{prefix}/balanced_max": max(balanced),
        f"{prefix}/mean": sum(lengths) / k,
    }


def _largest_sum(lengths: list[int], parts: list[list[int]]) -> int:
    return max((sum(lengths[i] for i in part) for part in parts), default=0)


def pack_within_budget(
    seqlen_list: Sequence[int], k_partitions: int, capacity: int, max_steps: int = 20_000
) -> Optional[list[list[int]]]:
    """``k_partitions`` bins of at most ``capacity`` tokens each (a row longer than ``capacity`` alone in its
    bin), or ``None`` when none exists or none was found within ``max_steps`` placements.

    Depth-first search, rows longest first, each tried in the bins from the emptiest (so the first solution
    found is a balanced one), bins with equal sums tried once; prunes when the rows left exceed the room left.
    With few rows per micro-batch (tens) it is exact in well under ``max_steps``. Indices sorted per bin."""
    lengths = _as_int_list(seqlen_list)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    oversized = [i for i in order if lengths[i] > capacity]
    if len(oversized) > k_partitions:
        return None
    bins: list[list[int]] = [[i] for i in oversized] + [[] for _ in range(k_partitions - len(oversized))]
    sums = [lengths[i] for i in oversized] + [0] * (k_partitions - len(oversized))
    rows = [i for i in order if lengths[i] <= capacity]
    free = len(oversized)  # bins from here on take rows
    left = [0] * (len(rows) + 1)
    for position in range(len(rows) - 1, -1, -1):
        left[position] = left[position + 1] + lengths[rows[position]]
    room = sum(capacity - sums[b] for b in range(free, k_partitions))

    def candidates(position: int) -> list[int]:
        """Bins the row at ``position`` may go to (emptiest first, one per distinct sum), none if pruned."""
        if left[position] > room:
            return []
        length, seen, out = lengths[rows[position]], set(), []
        for b in sorted(range(free, k_partitions), key=lambda b: (sums[b], b)):
            if sums[b] + length <= capacity and sums[b] not in seen:
                seen.add(sums[b])
                out.append(b)
        return out

    # explicit stack (rows can number in the hundreds): one [candidate bins, next choice, bin taken] per row
    stack: list[list] = [[candidates(0), 0, None]] if rows else []
    steps = 0
    while stack:
        frame = stack[-1]
        if frame[2] is not None:  # undo the previous choice of this row
            bins[frame[2]].pop()
            sums[frame[2]] -= lengths[rows[len(stack) - 1]]
            room += lengths[rows[len(stack) - 1]]
            frame[2] = None
        if frame[1] == len(frame[0]):
            stack.pop()
            continue
        steps += 1
        if steps > max_steps:
            return None
        b = frame[0][frame[1]]
        frame[1] += 1
        frame[2] = b
        position = len(stack) - 1
        bins[b].append(rows[position])
        sums[b] += lengths[rows[position]]
        room -= lengths[rows[position]]
        if position + 1 == len(rows):
            return [sorted(part) for part in bins]
        stack.append([candidates(position + 1), 0, None])
    return [sorted(part) for part in bins] if not rows else None


def _partition_within_budget(lengths: list[int], k: int, max_token_len: int) -> list[list[int]]:
    """``k`` micro-batches: Karmarkar-Karp when it keeps every micro-batch (of more than one row) within the
    budget, else a search for ``k`` micro-batches within it (``pack_within_budget``), else the one of
    Karmarkar-Karp and longest-first with the smaller largest micro-batch (module docstring)."""

    def fits(parts: list[list[int]]) -> bool:
        return all(sum(lengths[i] for i in part) <= max_token_len or len(part) <= 1 for part in parts)

    balanced = get_seqlen_balanced_partitions(lengths, k)
    if fits(balanced):
        return balanced
    packed = pack_within_budget(lengths, k, max_token_len)
    if packed is not None:
        return packed
    greedy = [sorted(part) for part in greedy_partition(lengths, k, equal_size=False)]
    return greedy if _largest_sum(lengths, greedy) < _largest_sum(lengths, balanced) else balanced


def sync_max_count(count: int, dp_group: Optional[dist.ProcessGroup] = None, device: str | torch.device = "cpu") -> int:
    """Maximum of ``count`` over the data-parallel group (``count`` itself when torch.distributed is not used)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(dp_group) == 1:
        return int(count)
    tensor = torch.tensor([int(count)], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=dp_group)
    return int(tensor.item())


def rearrange_micro_batches(
    batch: TensorDict | Mapping[str, torch.Tensor] | Sequence[int] | torch.Tensor,
    max_token_len: int,
    dp_group: Optional[dist.ProcessGroup] = None,
    num_batches_divided_by: Optional[int] = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: Optional[int] = None,
    use_dynamic_bsz_balance: bool = True,
    device: str | torch.device = "cpu",
) -> Any:
    """Partition rows into ``min(rows, ceil(tokens / max_token_len))`` token-balanced micro-batches, within
    ``max_token_len`` tokens each whenever such a partition is found (upstream verl's signature and count).

    ``batch`` is either the per-row valid lengths (returns the list of index lists) or, as upstream, a
    ``TensorDict`` with ``attention_mask`` (lengths = its row sums; returns ``(micro_batches, indices)`` with
    one TensorDict per micro-batch). ``num_batches_divided_by`` rounds the count up to a multiple of it
    (pipeline schedules); ``use_dynamic_bsz_balance`` is accepted for compatibility: micro-batches are always
    ordered by their first row. Concatenating them and applying ``get_reverse_idx`` restores the row order.
    See the module docstring for the rules.
    """
    del use_dynamic_bsz_balance
    if isinstance(batch, (TensorDict, Mapping)):
        if "attention_mask" not in batch.keys():
            raise KeyError(f"rearrange_micro_batches needs batch['attention_mask']; keys: {sorted(batch.keys())}")
        indices = rearrange_micro_batches(
            batch["attention_mask"].sum(dim=-1),
            max_token_len,
            dp_group=dp_group,
            num_batches_divided_by=num_batches_divided_by,
            same_micro_num_in_dp=same_micro_num_in_dp,
            min_num_micro_batch=min_num_micro_batch,
            device=device,
        )
        return [batch[torch.tensor(rows, dtype=torch.long)] for rows in indices], indices
    lengths = _as_int_list(batch)
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

    num_rows = len(lengths)
    k = max(1, math.ceil(sum(lengths) / max_token_len), min_num_micro_batch or 1)
    k = min(k, max(num_rows, 1)) if num_rows else k
    partitions = _partition_within_budget(lengths, k, max_token_len)
    target = k
    if same_micro_num_in_dp:
        target = sync_max_count(target, dp_group, device)
    if num_batches_divided_by:
        target = roundup_divisible(target, int(num_batches_divided_by))
    if target != k:
        partitions = get_seqlen_balanced_partitions(lengths, target)
    # Non-empty micro-batches first, in order of their first row; empty ones (only from DP syncing) last.
    partitions.sort(key=lambda part: (len(part) == 0, part[0] if part else 0))
    return partitions


def prepare_dynamic_batch(
    data: Any,
    max_token_len: int,
    dp_group: Optional[dist.ProcessGroup] = None,
    num_batches_divided_by: Optional[int] = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: Optional[int] = None,
    use_dynamic_bsz_balance: bool = True,
) -> tuple[list[Any], list[list[int]]]:
    """Upstream's DataProto form of ``rearrange_micro_batches``: ``(micro DataProtos, index lists)``; each
    micro-batch keeps the non-tensor columns of its rows and ``meta_info``."""
    indices = rearrange_micro_batches(
        data.batch["attention_mask"].sum(dim=-1),
        max_token_len,
        dp_group=dp_group,
        num_batches_divided_by=num_batches_divided_by,
        same_micro_num_in_dp=same_micro_num_in_dp,
        min_num_micro_batch=min_num_micro_batch,
        use_dynamic_bsz_balance=use_dynamic_bsz_balance,
    )
    return [data[rows] for rows in indices], indices


def restore_dynamic_batch(data: torch.Tensor, batch_idx_list: Sequence[Sequence[int]]) -> torch.Tensor:
    """Put rows computed in micro-batch order (``torch.cat`` of the micro-batch outputs) back in row order."""
    order = [i for rows in batch_idx_list for i in rows]
    return data[torch.tensor(get_reverse_idx(order), dtype=torch.long, device=data.device)]


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
