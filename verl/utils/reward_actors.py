"""The thread reward manager's Ray actors: one per node, each owning a process pool.

Each node's ``RewardActor`` runs ``(verifier, kwargs)`` requests in a ``ProcessPoolExecutor``; ``RewardActorPool``
splits a request list into contiguous, nearly-equal slices across actors (``np.array_split``), one call per actor,
gathered in order (fewer requests than actors works, an empty list works). Actors are created with ``num_cpus=0``
so they never take CPUs away from training workers or from the verifier processes themselves.

This module imports neither torch nor ``verl.protocol`` (nor the ``verl.workers.reward_manager`` package, which
does): a Ray worker that hosts a ``RewardActor`` imports this module only, and skips torch's start-up (~3 s a
process on 2 CPU cores). ``verl/workers/reward_manager/thread.py`` is the manager that uses it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import cloudpickle
import numpy as np
import ray

__all__ = ["RewardActor", "RewardActorPool"]


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
