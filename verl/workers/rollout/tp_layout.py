"""Tensor-parallel rollout groups: which ranks share one vLLM engine, and how prompts reach them.

With ``actor_rollout_ref.rollout.tensor_model_parallel_size = tp`` the ``world_size`` FSDP ranks form
``world_size // tp`` TP groups of ``tp`` consecutive ranks (``[0, 1], [2, 3], ...`` for tp 2). The ranks of a
group build one vLLM engine sharded across them (vLLM's ``external_launcher`` executor: every rank constructs the
engine itself over the trainer's ``torch.distributed`` world, and vLLM lays its TP groups out the same way:
``torch.arange(world).reshape(-1, dp, pp, pcp, tp)`` in ``vllm/distributed/parallel_state.py``).

An engine of this kind is only correct when every rank of its group runs **the same requests in the same order**
(each rank has its own scheduler; the model's all-reduces pair up only if the schedules agree). So:

* the driver splits a batch into ``dp_size = world_size // tp`` parts, and every rank of group ``g`` gets part
  ``g`` (:func:`split_by_dp`), with the same per-request seeds;
* rank ``tp_rank == 0`` of each group returns the outputs, the others a digest of theirs; the driver concatenates
  the groups' outputs in group order and checks the digests (:func:`collect_by_dp`), so an engine whose ranks
  diverged fails loudly instead of training on garbage.

The per-rank ``(dp_rank, is_collect)`` pairs are the worker's ``set_dispatch_info("rollout", ...)``
(:data:`ROLLOUT_MESH`), the same convention as verl's hybrid engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "TP_KEY",
    "ROLLOUT_MESH",
    "RolloutLayout",
    "GroupDigest",
    "outputs_digest",
    "split_by_dp",
    "collect_by_dp",
]

TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"
ROLLOUT_MESH = "rollout"
_WORLD_KEYS = "trainer.nnodes x trainer.n_gpus_per_node"


@dataclass(frozen=True)
class RolloutLayout:
    """``world_size`` ranks in TP groups of ``tp_size`` consecutive ranks.

    Example: ``RolloutLayout(4, 2)``: groups ``[[0, 1], [2, 3]]``; rank 3 has ``dp_rank`` 1, ``tp_rank`` 1.
    """

    world_size: int
    tp_size: int

    def __post_init__(self) -> None:
        for name, value in (("world size", self.world_size), (TP_KEY, self.tp_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.world_size % self.tp_size:
            raise ValueError(
                f"{TP_KEY}={self.tp_size} must divide the number of ranks ({_WORLD_KEYS} = {self.world_size}): "
                f"each tensor-parallel rollout engine is shared by {self.tp_size} ranks"
            )

    @property
    def dp_size(self) -> int:
        """Number of TP groups (engines), each generating its own part of a batch."""
        return self.world_size // self.tp_size

    def _check(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return rank

    def dp_rank(self, rank: int) -> int:
        """The TP group (engine) of ``rank``."""
        return self._check(rank) // self.tp_size

    def tp_rank(self, rank: int) -> int:
        """Position of ``rank`` inside its TP group (vLLM's TP rank)."""
        return self._check(rank) % self.tp_size

    def is_collect(self, rank: int) -> bool:
        """Whether the driver takes ``rank``'s outputs (TP rank 0 of each group)."""
        return self.tp_rank(rank) == 0

    def group(self, dp_rank: int) -> list[int]:
        """The ranks of TP group ``dp_rank``."""
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside the {self.dp_size} TP groups")
        return list(range(dp_rank * self.tp_size, (dp_rank + 1) * self.tp_size))

    def groups(self) -> list[list[int]]:
        return [self.group(g) for g in range(self.dp_size)]

    def dispatch_info(self) -> list[tuple[int, bool]]:
        """``(dp_rank, is_collect)`` of every rank, in rank order (what the workers declare)."""
        return [(self.dp_rank(r), self.is_collect(r)) for r in range(self.world_size)]


@dataclass(frozen=True)
class GroupDigest:
    """What a non-collecting TP rank returns instead of its outputs: their count and digest."""

    count: int
    digest: str


def outputs_digest(outputs: Sequence[Sequence[Any]]) -> GroupDigest:
    """Digest of per-prompt lists of :class:`~verl.workers.rollout.base.GenerationOutput`: the sampled token ids
    and finish reasons (what must agree across the ranks of one engine)."""
    h = hashlib.sha1()
    for samples in outputs:
        h.update(b"[")
        for out in samples:
            h.update(repr((list(out.token_ids), out.finish_reason)).encode())
        h.update(b"]")
    return GroupDigest(len(outputs), h.hexdigest())


def _check_info(info: Sequence[tuple[int, bool]]) -> int:
    """Validate per-rank ``(dp_rank, is_collect)`` and return the number of groups."""
    from verl.single_controller.decorator import check_mesh_info

    return check_mesh_info(ROLLOUT_MESH, info)


def split_by_dp(num_items: int, info: Sequence[tuple[int, bool]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split ``num_items`` rows over the TP groups of ``info`` (``np.array_split``: uneven allowed, a group may
    get none). Returns ``(indices per group, indices per rank)``; every rank of a group gets its group's indices."""
    parts = np.array_split(np.arange(num_items), _check_info(info))
    return parts, [parts[dp] for dp, _ in info]


def collect_by_dp(results: Sequence[Any], info: Sequence[tuple[int, bool]]) -> list:
    """Concatenate the collecting ranks' result lists in group order; check every other rank's
    :class:`GroupDigest` against its group's outputs. ``results`` is in rank order."""
    if len(results) != len(info):
        raise ValueError(f"{len(results)} results for {len(info)} ranks")
    picked: list[Any] = [None] * _check_info(info)
    for rank, (dp, collect) in enumerate(info):
        if collect:
            picked[dp] = results[rank]
    for rank, (dp, collect) in enumerate(info):
        if collect:
            continue
        got, want = results[rank], outputs_digest(picked[dp])
        if not isinstance(got, GroupDigest):
            raise TypeError(f"rank {rank} (TP group {dp}) returned {type(got).__name__}, expected a GroupDigest")
        if got != want:
            collector = next(r for r, (d, c) in enumerate(info) if d == dp and c)
            raise RuntimeError(
                f"the ranks of TP rollout group {dp} generated different outputs (rank {rank}: {got.count} prompts, "
                f"digest {got.digest[:12]}; rank {collector}: {want.count} prompts, digest {want.digest[:12]}): "
                "their vLLM engines ran different requests or seeds, so the sharded model is out of step"
            )
    return [item for part in picked for item in part]
