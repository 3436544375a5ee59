"""Reward scoring off the driver: one Ray actor per node, each owning a process pool.

The driver only decodes responses and ships ``(verifier, kwargs)`` lists; each node's
``RewardActor`` runs them in a ``ProcessPoolExecutor``. Requests are split into contiguous,
nearly-equal slices across actors (``np.array_split``), one call per actor, gathered in order.
Fixes of the original (docs/spec.md#bug-reward-manager): fewer requests than actors works, an empty batch works.

Actors are created with ``num_cpus=0`` so they never take CPUs away from training workers or
from the verifier processes themselves.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import cloudpickle
import numpy as np
import ray
import torch

from verl.protocol import DataProto
from verl.utils.reward_score import default_compute_score
from verl.workers.reward_manager.naive import collect, reward_requests


def _call(fn_bytes: bytes, kwargs: dict[str, Any]) -> Any:
    fn = cloudpickle.loads(fn_bytes)
    return fn(**kwargs)


@ray.remote(num_cpus=0)
class RewardActor:
    def __init__(self, max_workers: int | None = None):
        self.pool = ProcessPoolExecutor(max_workers=max_workers or max(1, (os.cpu_count() or 2) // 2))

    def ready(self) -> bool:
        return True

    def batch_reward(self, fn_bytes: bytes, requests: list[dict[str, Any]]) -> list[Any]:
        futures = [self.pool.submit(_call, fn_bytes, req) for req in requests]
        return [f.result() for f in futures]


class RewardActorPool:
    """One named ``RewardActor`` per alive node (reused if it already exists)."""

    def __init__(self, max_workers: int | None = None, namespace: str = "memagent_reward"):
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        self.actors = []
        for i, node in enumerate(nodes):
            strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            self.actors.append(
                RewardActor.options(
                    name=f"RewardActor_{i}",
                    namespace=namespace,
                    get_if_exists=True,
                    scheduling_strategy=strategy,
                ).remote(max_workers)
            )
        ray.get([a.ready.remote() for a in self.actors])

    def map(self, fn: Callable, requests: list[dict[str, Any]]) -> list[Any]:
        if not requests:
            return []
        fn_bytes = cloudpickle.dumps(fn)
        slices = [s for s in np.array_split(np.arange(len(requests)), len(self.actors)) if len(s)]
        refs = [a.batch_reward.remote(fn_bytes, [requests[i] for i in s]) for a, s in zip(self.actors, slices)]
        out: list[Any] = []
        for part in ray.get(refs):
            out.extend(part)
        return out


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
