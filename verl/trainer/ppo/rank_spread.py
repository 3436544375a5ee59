"""Rows to data-parallel ranks: every rank gets a share of every mini-batch.

The trainer numbers the global mini-batches of a step (``mini_batch_id``, the same for any number of ranks: runs of
rows in the single-turn trainer, question groups of trajectories in the multi-turn one) and the worker group's
data-parallel dispatch gives each rank a contiguous chunk of rows (``DataProto.chunk``). Sent in their order, the
single-turn rows put each mini-batch on one or two ranks (with 16 mini-batches on 8 ranks rank 0 held mini-batches
0-1 and nothing else: in each optimizer step one rank computed and the others waited, and the update ran no faster on
8 GPUs than on one), and the multi-turn rows in lock-step order gave the last ranks only the short final answers.

:func:`spread_order` returns a row order under which ``chunk(ranks)`` gives every rank an equal share (within one
row) of every mini-batch. Rows are dealt to ranks mini-batch by mini-batch; with ``by_tokens``
(``trainer.balance_batch``, as upstream's option balances tokens across ranks) each mini-batch's rows are dealt
longest first in a snake order (ranks 0..R-1, then R-1..0), so the ranks' token counts in each optimizer step differ by
at most about one row's length. The update's result does not depend on the order of rows (global token-mean
normalisation, ``verl/workers/actor/dp_actor.py``) beyond floating-point summation order.
"""

from __future__ import annotations

import torch

__all__ = ["spread_order", "spread_metrics"]


def spread_order(mini_batch_id: torch.Tensor, tokens: torch.Tensor, ranks: int, by_tokens: bool) -> torch.Tensor:
    """A permutation of the rows (``order``: send ``data[order]``) under which ``DataProto.chunk(ranks)`` gives each
    rank its share of every mini-batch.

    Full rounds of ``ranks`` rows give one row to every rank; each mini-batch's remaining rows continue one
    round-robin across the mini-batches, so rank ``r`` gets exactly the rows ``chunk`` gives it (the first
    ``N % ranks`` ranks one more)."""
    ids = mini_batch_id.reshape(-1).long()
    n = len(ids)
    if ranks <= 1 or n == 0:
        return torch.arange(n)
    lengths = tokens.reshape(-1).long()
    dealt: list[list[int]] = [[] for _ in range(ranks)]
    spare = 0  # the round-robin of the rows that fill no full round
    for m in torch.unique(ids, sorted=True).tolist():
        rows = torch.nonzero(ids == m).flatten()
        if by_tokens:
            rows = rows[torch.sort(lengths[rows], descending=True, stable=True).indices]
        rows = rows.tolist()
        full = len(rows) - len(rows) % ranks
        for start in range(0, full, ranks):
            order = range(ranks) if (start // ranks) % 2 == 0 else range(ranks - 1, -1, -1)
            for rank, row in zip(order, rows[start : start + ranks]):
                dealt[rank].append(row)
        for row in rows[full:]:
            dealt[spare % ranks].append(row)
            spare += 1
    return torch.tensor([row for rows in dealt for row in rows], dtype=torch.long)


def spread_metrics(
    mini_batch_id: torch.Tensor, tokens: torch.Tensor, ranks: int, prefix: str = "perf/update"
) -> dict[str, float]:
    """How the rows in this order fall on ``ranks`` ranks (``chunk``), per optimizer step:
    ``<prefix>_rank_tokens_max_over_mean``, the busiest rank's tokens over the ranks' mean, averaged over the
    mini-batches (1 = balanced; the step waits for the busiest rank), and ``<prefix>_idle_rank_steps``, the
    (rank, mini-batch) pairs without a row: optimizer steps a rank only waits through (unavoidable only for
    mini-batches of fewer rows than ranks)."""
    ids = mini_batch_id.reshape(-1).long()
    n = len(ids)
    if n == 0 or ranks < 1:
        return {}
    parts = torch.arange(n).tensor_split(ranks)  # DataProto.chunk's split: np.array_split's sizes
    rank_of = torch.repeat_interleave(torch.arange(ranks), torch.tensor([len(p) for p in parts]))
    used = torch.unique(ids)
    column = torch.searchsorted(used, ids)
    load = torch.zeros(ranks, len(used), dtype=torch.float64)
    load.index_put_((rank_of, column), tokens.reshape(-1).double(), accumulate=True)
    rows = torch.zeros(ranks, len(used), dtype=torch.long)
    rows.index_put_((rank_of, column), torch.ones(n, dtype=torch.long), accumulate=True)
    mean = load.mean(dim=0)
    ratios = load.max(dim=0).values[mean > 0] / mean[mean > 0]
    return {
        f"{prefix}_rank_tokens_max_over_mean": float(ratios.mean()) if len(ratios) else 1.0,
        f"{prefix}_idle_rank_steps": float((rows == 0).sum()),
    }
