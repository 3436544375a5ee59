"""Free-running async turns over Ray ranks (``actor_rollout_ref.rollout.async_free_running_calls = k > 0``).

A rank's batched ``generate`` call returns when its longest answer is done, so the trajectories on a rank meet in
lock step turn after turn. With ``k > 0`` every request is a call of its own (:class:`RequestReplica`), up to ``k``
in flight per rank, and the worker runs ``k`` of them at once (its ``rollout`` concurrency group has ``k`` threads):
each answer comes back as soon as it is done.
"""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from recurrent.async_utils import ChatCompletionProxy
from recurrent.replicas import BatchingReplica, RequestReplica, ray_rank_replicas, replicas_from
from verl.workers.rollout.base import GenerationOutput, SamplingParams


def test_request_replica_sends_one_call_per_request_with_at_most_k_in_flight():
    calls, in_flight, peak = [], [0], [0]

    async def submit(prompts, params, seeds):
        calls.append((prompts, params["max_tokens"], seeds))
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        await asyncio.sleep(0.02 * len(calls))  # later calls take longer
        in_flight[0] -= 1
        return [[GenerationOutput([len(p)], None, "length")] for p in prompts]

    replica = RequestReplica(submit, max_in_flight=3, name="rank0")

    async def many():
        requests = [replica.generate([1] * (i + 1), SamplingParams(max_tokens=4, seed=10 + i)) for i in range(5)]
        return await asyncio.gather(*requests, replica.generate([9, 9], SamplingParams(max_tokens=2)))

    results = asyncio.run(many())
    assert [r[0].token_ids for r in results] == [[1], [2], [3], [4], [5], [2]]
    assert replica.calls == 6 and peak[0] == 3
    assert all(len(prompts) == 1 for prompts, _, _ in calls)
    seeds = sorted(s[0] for _, _, s in calls if s is not None)
    assert seeds == [10, 11, 12, 13, 14] and sum(1 for *_, s in calls if s is None) == 1
    with pytest.raises(ValueError, match="max_in_flight >= 1"):
        RequestReplica(submit, max_in_flight=0)


def _toy_rollout_worker_cls():
    """A Ray worker whose ``generate`` runs in the ``rollout`` concurrency group and records how many calls ran at
    once (defined in a function so Ray pickles it by value)."""
    import threading
    import time as _time
    from collections import namedtuple

    from verl.single_controller import Dispatch, Worker, register

    out = namedtuple("Out", ["token_ids", "log_probs", "finish_reason"])

    class ToyRollout(Worker):
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()
            self.sizes, self.in_flight, self.peak = [], 0, 0

        @register(dispatch_mode=Dispatch.ALL_TO_ALL, concurrency_group="rollout")
        def generate(self, prompts, params, seeds=None):
            with self.lock:
                self.sizes.append(len(prompts))
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
            _time.sleep(0.3)
            with self.lock:
                self.in_flight -= 1
            return [[out([5 + self.rank, 6], None, "length")] for _ in prompts]

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def stats(self):
            return self.sizes, self.peak

    return ToyRollout


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_ray_ranks_run_the_requests_as_concurrent_single_calls(tok, ray_cluster):
    from verl.single_controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool

    cls = RayClassWithInitArgs(_toy_rollout_worker_cls()).update_options(
        {"concurrency_groups": {"rollout": 4, "train": 1}}
    )
    wg = RayWorkerGroup(ResourcePool([2], use_gpu=False, name_prefix="freerun"), cls)
    try:
        assert [type(r) for r in ray_rank_replicas(wg)] == [BatchingReplica] * 2
        proxy = ChatCompletionProxy(wg, tok, free_running_calls=4)
        try:
            assert [type(r) for r in proxy.replicas] == [RequestReplica] * 2
            assert {r.max_in_flight for r in proxy.replicas} == {4}

            async def turn():
                chats = [proxy.chat([{"role": "user", "content": f"x{i}"}], request_id=f"s{i}") for i in range(8)]
                return await asyncio.gather(*chats)

            done = proxy.run(turn())
            stats = wg.stats()
        finally:
            proxy.close()
        assert sorted(tuple(c.choices[0].token_ids) for c in done) == [(5, 6)] * 4 + [(6, 6)] * 4
        for sizes, peak in stats:
            assert sizes == [1, 1, 1, 1] and peak >= 2  # four calls of one request, run at once
    finally:
        wg.shutdown()


def test_the_trainer_gives_the_rollout_thread_k_threads_in_async_mode_only(caplog):
    from tests.test_config import compose_config
    from verl.trainer.ppo.ray_worker_group import actor_rollout_ref_class
    from verl.workers.config.base import ConfigError

    key = "actor_rollout_ref.rollout.async_free_running_calls"
    # 8 questions x 4 samples over 2 ranks: 16 trajectories per rank
    sizes = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "trainer.n_gpus_per_node=2"]
    with caplog.at_level("WARNING", logger="verl.trainer.ppo.ray_worker_group"):
        free = actor_rollout_ref_class(
            compose_config([*sizes, "actor_rollout_ref.rollout.mode=async", f"{key}=16"]), "cpu"
        )
    assert free.options == {"concurrency_groups": {"rollout": 16, "train": 1}}
    assert not caplog.records
    with caplog.at_level("WARNING", logger="verl.trainer.ppo.ray_worker_group"):
        actor_rollout_ref_class(compose_config([*sizes, "actor_rollout_ref.rollout.mode=async", f"{key}=6"]), "cpu")
    assert "async_free_running_calls=6 is below the 16 trajectories each rank serves" in caplog.text
    both = ["trainer.rollout_overlap=True", "actor_rollout_ref.rollout.mode=async", f"{key}=3"]
    assert actor_rollout_ref_class(compose_config(both), "cpu").options["concurrency_groups"]["rollout"] == 3
    assert actor_rollout_ref_class(compose_config([f"{key}=16"]), "cpu").options == {}  # sync mode: no effect
    assert actor_rollout_ref_class(compose_config(["actor_rollout_ref.rollout.mode=async"]), "cpu").options == {}
    with pytest.raises(ConfigError, match="async_free_running_calls must be"):
        actor_rollout_ref_class(compose_config(["actor_rollout_ref.rollout.mode=async", f"{key}=-1"]), "cpu")


def test_replicas_from_passes_the_calls_through_the_trainers_rollout_client(ray_cluster, tok):
    class Client:  # the trainer's RolloutClient holds the worker group as .wg
        def __init__(self, wg):
            self.wg = wg

    from verl.single_controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool

    wg = RayWorkerGroup(
        ResourcePool([1], use_gpu=False, name_prefix="freerun1"), RayClassWithInitArgs(_toy_rollout_worker_cls())
    )
    try:
        assert [type(r) for r in replicas_from(Client(wg), 2)] == [RequestReplica]
        assert [type(r) for r in replicas_from([Client(wg)], 0)] == [BatchingReplica]
    finally:
        wg.shutdown()
