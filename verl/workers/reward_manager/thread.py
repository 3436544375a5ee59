"""Reward scoring off the driver: one Ray actor per node, each owning a process pool.

The driver only decodes responses and ships ``(verifier, kwargs)`` lists; each node's
``RewardActor`` runs them in a ``ProcessPoolExecutor``. Requests are split into contiguous,
nearly-equal slices across actors (``np.array_split``), one call per actor, gathered in order.
Fixes of the original (docs/spec.md#bug-reward-manager): fewer requests than actors works, an empty batch works.

Actors are created with ``num_cpus=0`` so they never take CPUs away from training workers or
from the verifier processes themselves. They live in ``verl/utils/reward_actors.py``, which imports no torch: the
actor's Ray worker starts without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cloudpickle
import torch

from verl.protocol import DataProto
from verl.utils.reward_actors import RewardActor, RewardActorPool
from verl.utils.reward_score import default_compute_score
from verl.workers.reward_manager.naive import collect, reward_requests

__all__ = ["RewardActor", "RewardActorPool", "ThreadRewardManager"]


class ThreadRewardManager:
    def __init__(
        self,
        tokenizer,
        compute_score: Callable | None = None,
        num_examine: int = 0,
        reward_fn_key: str = "data_source",
        max_workers: int | None = None,
        **reward_kwargs: Any,
    ):
        self.tokenizer = tokenizer
        self.compute_score = compute_score or default_compute_score
        self.num_examine = num_examine
        self.reward_fn_key = reward_fn_key  # data.reward_fn_key: the column passed as data_source
        self.reward_kwargs = reward_kwargs  # reward_model.reward_kwargs: extra keyword arguments of each call
        try:
            cloudpickle.dumps(self.compute_score)
        except Exception as e:  # noqa: BLE001
            raise TypeError(
                f"reward function {self.compute_score!r} cannot be pickled for the reward actors: {e}"
            ) from e
        self.pool = RewardActorPool(max_workers=max_workers)

    def __call__(self, data: DataProto) -> tuple[torch.Tensor, dict[str, list]]:
        requests = [{**r, **self.reward_kwargs} for r in reward_requests(data, self.tokenizer, self.reward_fn_key)]
        results = self.pool.map(self.compute_score, requests)
        return collect(results, requests, self.num_examine)
