"""A replica that takes whole batches (a Ray worker rank in async mode) sends a turn's requests in one call.

A call returns when its last answer is done, and requests that arrive during it wait for it. The chat proxy
renders and tokenises each prompt in a thread pool, so a turn's requests reach the replica a few at a time; sent
as they came, a turn became two calls, one after the other (``bench_turn_scheduling.py``: twice the engine steps).
The replica now holds its next call while the proxy still prepares requests.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer

from recurrent.async_utils import ChatCompletionProxy
from recurrent.replicas import BatchingReplica
from verl.workers.rollout.base import GenerationOutput, SamplingParams


def _recording_submit(sent: list[int], seconds: float):
    async def submit(prompts, params, seeds):
        sent.append(len(prompts))
        await asyncio.sleep(seconds)
        return [[GenerationOutput([7, 8], None, "length")] for _ in prompts]

    return submit


async def _staggered(replica: BatchingReplica, preparing: dict[str, int], count: int, gap: float):
    async def one(i: int):
        await asyncio.sleep(gap * i)  # requests reach the replica one after the other
        preparing["n"] -= 1
        return await replica.generate([i + 1], SamplingParams(max_tokens=2))

    return await asyncio.gather(*[one(i) for i in range(count)])


def test_the_next_call_waits_for_requests_still_in_preparation():
    sent: list[int] = []
    preparing = {"n": 4}
    replica = BatchingReplica(_recording_submit(sent, 0.1), "rank0", hold=lambda: preparing["n"] > 0)
    results = asyncio.run(_staggered(replica, preparing, 4, 0.05))
    assert sent == [4] and replica.call_sizes == [4]
    assert [r[0].token_ids for r in results] == [[7, 8]] * 4


def test_without_a_hold_requests_that_arrive_during_a_call_wait_for_it():
    sent: list[int] = []
    preparing = {"n": 4}
    replica = BatchingReplica(_recording_submit(sent, 0.1), "rank0")
    asyncio.run(_staggered(replica, preparing, 4, 0.05))
    assert sent[0] == 1 and sum(sent) == 4 and len(sent) >= 2  # the first request went out alone


def test_a_hold_that_never_ends_delays_a_call_by_max_hold_s_only():
    sent: list[int] = []
    replica = BatchingReplica(_recording_submit(sent, 0.0), "rank0", hold=lambda: True, max_hold_s=0.2)

    async def go():
        start = time.perf_counter()
        await replica.generate([1], SamplingParams(max_tokens=2))
        return time.perf_counter() - start

    waited = asyncio.run(go())
    assert sent == [1] and 0.2 <= waited < 2.0


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_the_proxy_sends_a_turn_of_concurrent_chats_in_one_call(tok):
    sent: list[int] = []
    replica = BatchingReplica(_recording_submit(sent, 0.05), "rank0")
    proxy = ChatCompletionProxy(replica, tok)
    try:
        assert replica.hold is not None

        async def turn(count: int):
            messages = [[{"role": "user", "content": f"Read part {i}. " * (5 + i)}] for i in range(count)]
            return await asyncio.gather(*[proxy.chat(m, request_id=f"s{i}") for i, m in enumerate(messages)])

        assert len(proxy.run(turn(16))) == 16
        assert sent == [16]
        # a request whose prompt cannot be tokenised leaves no request counted in preparation behind
        bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        with pytest.raises(ValueError, match="only text content parts"):
            proxy.run(proxy.chat(bad))
        assert proxy._preparing == 0
        start = time.perf_counter()
        proxy.run(turn(3))
        assert sent == [16, 3] and time.perf_counter() - start < replica.max_hold_s
    finally:
        proxy.close()
