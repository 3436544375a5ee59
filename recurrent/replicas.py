"""The rollout engines as async mode's chat proxy sees them (:mod:`recurrent.async_utils`): a :class:`Replica` is one
engine instance with async ``generate`` and wake/sleep; :func:`replicas_from` makes them from an engine, a worker group
or the trainer's rollout client; :class:`Router` picks one per request (least in flight, sticky per request id so a
multi-turn conversation hits one replica's prefix cache)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from verl.workers.rollout.base import GenerationOutput, RolloutEngine, SamplingParams

__all__ = [
    "BatchingReplica",
    "EngineReplica",
    "Replica",
    "RequestReplica",
    "Router",
    "WorkerReplica",
    "ray_rank_replicas",
    "replicas_from",
]


class Replica:
    """One rollout engine instance as the proxy sees it: async ``generate`` plus wake/sleep."""

    name = "replica"
    eos_token_ids: list[int] = []

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> list[GenerationOutput]:
        raise NotImplementedError

    async def wake_up(self) -> None:
        """Load weights / KV cache (default: nothing to do)."""

    async def sleep(self) -> None:
        """Free accelerator memory (default: nothing to do)."""


class EngineReplica(Replica):
    """An in-process :class:`RolloutEngine` (HF or vLLM); its ``generate`` batches concurrent requests."""

    def __init__(self, engine: RolloutEngine, name: str | None = None):
        self.engine = engine
        self.name = name or type(engine).__name__
        self.eos_token_ids = list(getattr(engine, "eos_token_ids", None) or [])

    async def generate(self, prompt_ids, params, request_id=None):
        return await self.engine.generate(prompt_ids, params, request_id)

    async def wake_up(self) -> None:
        await asyncio.to_thread(self.engine.wake_up)

    async def sleep(self) -> None:
        await asyncio.to_thread(self.engine.sleep)


class WorkerReplica(EngineReplica):
    """The engine of an in-process worker (``LocalWorkerGroup``): each request runs under the worker's
    :class:`~verl.workers.rollout.guard.RolloutGuard`, as the worker's own ``generate`` does, so a weight sync or sleep
    during it is refused and the worker's generation clock (``perf/rollout/generate_s``, the update's overlap)
    counts it; wake-up and sleep are the worker's (a wake-up after a sleep that dropped the weights syncs them).
    """

    def __init__(self, worker: Any, name: str | None = None):
        super().__init__(worker.rollout, name)
        self.worker = worker

    async def generate(self, prompt_ids, params, request_id=None):
        with self.worker.rollout_guard.generating("generate"):
            return await self.engine.generate(prompt_ids, params, request_id)

    async def wake_up(self) -> None:
        await asyncio.to_thread(self.worker.wake_up_rollout)

    async def sleep(self) -> None:
        await asyncio.to_thread(self.worker.sleep_rollout)


class _CallingReplica(Replica):
    """A replica whose backend is called with batches (``submit``), with optional async ``wake``/``sleep`` hooks."""

    def __init__(self, submit: Any, name: str, wake: Any = None, sleep: Any = None):
        self._submit = submit
        self.name = name
        self._wake, self._sleep = wake, sleep
        self.calls = 0  # calls sent (for tests and metrics)

    async def wake_up(self) -> None:
        if self._wake is not None:
            await self._wake()

    async def sleep(self) -> None:
        if self._sleep is not None:
            await self._sleep()


class BatchingReplica(_CallingReplica):
    """A backend that takes whole batches (a worker-group rank): concurrent requests are queued and
    sent together, one call per distinct sampling setting, as soon as the previous call returned.

    ``submit(prompts, params_dict, seeds_or_None)`` returns an awaitable of one output list per prompt.

    A call returns when all its answers are done, and requests that arrive meanwhile wait for it: a turn whose
    requests reach the replica a few at a time (each prompt is rendered and tokenised in a thread pool first) would
    go out as two calls, one after the other, each as long as the turn's longest answer. So while ``hold()`` is
    true (the chat proxy sets it: requests are still being prepared) the next call waits, at most
    ``max_hold_s``, for them to arrive.
    """

    def __init__(
        self,
        submit: Any,
        name: str = "batching",
        wake: Any = None,
        sleep: Any = None,
        hold: Callable[[], bool] | None = None,
        max_hold_s: float = 2.0,
    ):
        super().__init__(submit, name, wake, sleep)
        self.hold = hold
        self.max_hold_s = max_hold_s
        self._pending: list[tuple[list[int], SamplingParams, asyncio.Future]] = []
        self._draining = False
        self.call_sizes: list[int] = []  # requests per call, in order

    async def generate(self, prompt_ids, params, request_id=None):
        future = asyncio.get_running_loop().create_future()
        self._pending.append((list(prompt_ids), params, future))
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._pending:
                await self._wait_for_requests_in_preparation()
                batch, self._pending = self._pending, []
                groups: dict[str, list[tuple[list[int], SamplingParams, asyncio.Future]]] = {}
                for item in batch:
                    key = repr(sorted((k, v) for k, v in asdict(item[1]).items() if k != "seed"))
                    groups.setdefault(key, []).append(item)
                await asyncio.gather(*[self._send(items) for items in groups.values()])
        finally:
            self._draining = False

    async def _wait_for_requests_in_preparation(self) -> None:
        if self.hold is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_hold_s
        while self.hold() and loop.time() < deadline:
            await asyncio.sleep(0.001)

    async def _send(self, items) -> None:
        params = asdict(items[0][1])
        params.pop("seed", None)
        seeds = [it[1].seed for it in items]
        self.calls += 1
        self.call_sizes.append(len(items))
        try:
            results = await self._submit(
                [it[0] for it in items], params, None if all(s is None for s in seeds) else seeds
            )
            if len(results) != len(items):
                raise RuntimeError(f"replica {self.name} returned {len(results)} results for {len(items)} prompts")
            for (_, _, fut), res in zip(items, results):
                if not fut.done():
                    fut.set_result(res)
        except BaseException as exc:  # noqa: BLE001 - delivered to every waiting request
            for _, _, fut in items:
                if not fut.done():
                    fut.set_exception(exc)


class RequestReplica(_CallingReplica):
    """A backend that takes whole batches, sent one request per call, up to ``max_in_flight`` calls at once: each
    answer comes back as soon as it is done, so a trajectory's next turn does not wait for other trajectories'
    answers (free-running; ``actor_rollout_ref.rollout.async_free_running_calls``). The backend must run that many
    calls at once (a worker with as many threads for ``generate``); the engine batches them.

    ``submit(prompts, params_dict, seeds_or_None)`` as for :class:`BatchingReplica`.
    """

    def __init__(self, submit: Any, max_in_flight: int, name: str = "request", wake: Any = None, sleep: Any = None):
        if max_in_flight < 1:
            raise ValueError(f"RequestReplica needs max_in_flight >= 1, got {max_in_flight}")
        super().__init__(submit, name, wake, sleep)
        self.max_in_flight = max_in_flight
        self._slots: asyncio.Semaphore | None = None  # made on the loop that first uses it

    async def generate(self, prompt_ids, params, request_id=None):
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_in_flight)
        sent = asdict(params)
        seed = sent.pop("seed", None)
        async with self._slots:
            self.calls += 1
            results = await self._submit([list(prompt_ids)], sent, None if seed is None else [seed])
        if len(results) != 1:
            raise RuntimeError(f"replica {self.name} returned {len(results)} results for 1 prompt")
        return results[0]


def ray_rank_replicas(wg: Any, free_running_calls: int = 0) -> list[Replica]:
    """One replica per rank of a Ray worker group whose role has ``generate(prompts, params_dict, seeds)`` (and
    optionally ``wake_up_rollout``/``sleep_rollout``): a :class:`BatchingReplica`, or with ``free_running_calls = k
    > 0`` a :class:`RequestReplica` with up to ``k`` calls in flight."""
    has_wake, has_sleep = hasattr(wg, "wake_up_rollout"), hasattr(wg, "sleep_rollout")
    if hasattr(wg, "call_rank"):  # in the method's concurrency group (the rollout thread, trainer.rollout_overlap)
        call = wg.call_rank
    else:
        role, _ = wg._route("generate") if hasattr(wg, "_route") else ("default", "generate")

        def call(rank, method, *args):
            return wg.workers[rank].call.remote(role, method, *args)

    replicas: list[Replica] = []
    for rank in range(len(wg.workers)):

        def submit(prompts, params, seeds, rank=rank):
            return call(rank, "generate", prompts, params, seeds)

        async def wake(rank=rank):
            await call(rank, "wake_up_rollout")

        async def sleep(rank=rank):
            await call(rank, "sleep_rollout")

        hooks = (wake if has_wake else None, sleep if has_sleep else None)
        if free_running_calls > 0:
            replicas.append(RequestReplica(submit, free_running_calls, f"rank{rank}", *hooks))
        else:
            replicas.append(BatchingReplica(submit, f"rank{rank}", *hooks))
    return replicas


def replicas_from(rollout: Any, free_running_calls: int = 0) -> list[Replica]:
    """Replicas for an engine, a list of them, replicas, the trainer's ``RolloutClient`` (``.wg``),
    an in-process worker group (``.worker.rollout``) or a Ray worker group (``.workers``; ``free_running_calls``:
    :func:`ray_rank_replicas`)."""
    if isinstance(rollout, Replica):
        return [rollout]
    if isinstance(rollout, RolloutEngine):
        return [EngineReplica(rollout)]
    if isinstance(rollout, (list, tuple)):
        return [r for item in rollout for r in replicas_from(item, free_running_calls)]
    if hasattr(rollout, "wg"):
        return replicas_from(rollout.wg, free_running_calls)
    worker = getattr(rollout, "worker", None)
    if worker is not None and getattr(worker, "rollout", None) is not None:
        return [WorkerReplica(worker)]
    if hasattr(rollout, "workers"):
        return ray_rank_replicas(rollout, free_running_calls)
    raise TypeError(
        f"cannot use {type(rollout).__name__} as a rollout for async mode: expected a RolloutEngine, a Replica, "
        "a list of them, a RolloutClient or a worker group"
    )


class Router:
    """Least-loaded replica choice with sticky sessions (LRU map request id -> replica)."""

    def __init__(self, num_replicas: int, max_sessions: int):
        self.in_flight = [0] * num_replicas
        self.assigned = [0] * num_replicas
        self.sessions: OrderedDict[str, list[int]] = OrderedDict()  # id -> [replica, calls so far]
        self.max_sessions = max_sessions

    def acquire(self, request_id: str | None) -> tuple[int, int]:
        """Return ``(replica, index of this call within the session)``."""
        session = self.sessions.get(request_id) if request_id is not None else None
        if session is None:
            replica = min(range(len(self.in_flight)), key=lambda i: (self.in_flight[i], self.assigned[i], i))
            session = [replica, 0]
            if request_id is not None:
                self.sessions[request_id] = session
                while len(self.sessions) > self.max_sessions:
                    self.sessions.popitem(last=False)
        elif request_id is not None:
            self.sessions.move_to_end(request_id)
        replica, turn = session
        session[1] += 1
        self.in_flight[replica] += 1
        self.assigned[replica] += 1
        return replica, turn

    def release(self, replica: int) -> None:
        self.in_flight[replica] -= 1
