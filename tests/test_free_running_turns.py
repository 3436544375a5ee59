"""Free-running turns for the sync memory agent (``actor_rollout_ref.rollout.free_running_turns``,
``recurrent/free_running_manager.py``): the rows lock step gives, without lock step's waits."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer

from recurrent.free_running_manager import SEED_STRIDE, FreeRunningGenerationManager
from recurrent.generation_manager import LLMGenerationManager
from recurrent.impls.memory import MemoryAgent, MemoryConfig
from recurrent.interface import RAgent
from recurrent.replicas import Replica
from tests.test_memory_agent import _dataset as memory_dataset
from tests.test_memory_agent import _gen_batch as memory_gen_batch
from verl.trainer.ppo.trainer_core import RolloutClient
from verl.workers.rollout.base import GenerationOutput
from verl.workers.rollout.hf_engine import HFRolloutEngine

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def engine(varied_path):
    """The tiny model with varied continuations: answers differ per prompt and per seed."""
    eng = HFRolloutEngine(str(varied_path), device="cpu", max_batch_size=16, max_model_len=512, seed=0)
    yield eng
    eng.shutdown()


class OneRank:
    """A worker group of one rank over ``engine`` for the trainer's ``RolloutClient`` (a rank's seed per request)."""

    world_size = 1

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, params, seeds):
        from verl.workers.rollout.base import SamplingParams

        sp = SamplingParams.from_dict(params[0])
        per_request = [sp] * len(prompts[0]) if seeds[0] is None else [replace(sp, seed=s) for s in seeds[0]]
        return [self.engine.generate_requests(prompts[0], per_request)]


def _gen_batch(tmp_path, tok, contexts, sampling=None):
    """The memory agent's batch (12-token chunks, memory 8 tokens, answers 6), one question per trajectory."""
    questions = [f"What is code {i}?" for i in range(len(contexts))]
    cfg, ds = memory_dataset(tmp_path, tok, contexts, chunk_size=12, questions=questions)
    gen = memory_gen_batch(ds)
    gen.meta_info["sampling"] = dict(sampling or {"temperature": 1.0, "seed": 5})
    return cfg, gen


def _context(n_words: int, shift: int) -> str:
    return " ".join(WORDS[(shift + k) % len(WORDS)] for k in range(n_words))


def _same(a, b):
    (conv_a, final_a, index_a), (conv_b, final_b, index_b) = a, b
    assert torch.equal(final_a, final_b) and torch.equal(index_a, index_b)
    assert conv_a.meta_info["active_traj_num"] == conv_b.meta_info["active_traj_num"]
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(conv_a.batch[key], conv_b.batch[key]), key
    assert torch.allclose(conv_a.batch["rollout_log_probs"], conv_b.batch["rollout_log_probs"], atol=1e-5)


@pytest.mark.parametrize(
    "case",
    [
        # same number of chunks everywhere, sampled: the seeds per (turn, trajectory) are lock step's
        ("sampled", [_context(30, s) for s in range(6)], {"temperature": 1.0, "seed": 5, "logprobs": True}),
        # 2 to 8 chunks, greedy: short documents' final answers come early here (seeds matter not)
        ("greedy", [_context(n, n) for n in (4, 40, 15, 28, 9, 33)], {"greedy": True, "logprobs": True}),
    ],
    ids=lambda c: c[0],
)
def test_free_running_gives_lock_steps_rows_with_a_real_engine(tmp_path, tok, engine, case):
    _, contexts, sampling = case
    cfg, gen = _gen_batch(tmp_path, tok, contexts, sampling=sampling)
    client = RolloutClient(OneRank(engine))
    lock = LLMGenerationManager(tok, client, MemoryAgent(tok, cfg)).run_llm_loop(gen)
    assert client.calls == len(lock[0].meta_info["active_traj_num"])
    free_manager = FreeRunningGenerationManager(tok, engine, MemoryAgent(tok, cfg), calls_per_rank=1)
    try:
        free = free_manager.run_llm_loop(gen, timing := {})
    finally:
        free_manager.shutdown()
    _same(free, lock)
    assert len(set(map(tuple, lock[0].batch["responses"].tolist()))) > len(contexts)  # answers vary
    assert timing["mt_gen"] > 0 and "mt_update" in timing
    chunks = [-(-n // cfg.chunk_size) for n in gen.batch["context_length"].tolist()]
    turns = [sum(c > t for c in chunks) for t in range(max(chunks))] + [len(chunks)]
    assert free[0].meta_info["active_traj_num"] == turns
    assert (len(set(chunks)) == 1) if case[0] == "sampled" else (len(set(chunks)) >= 3)


class TimedReplica(Replica):
    """Answers ``n`` tokens after ``delay(prompt)`` seconds; logs ("send"/"done", trajectory, turn) and seeds.

    Only the scheduling is under test here (the rows against a real engine are above)."""

    def __init__(self, tok, slow_question: list[int], delay: float):
        self.tok, self.slow, self.delay = tok, slow_question, delay
        self.log: list[tuple[str, str]] = []
        self.seeds: list[int | None] = []
        self.in_flight = self.peak = 0

    def _is_slow(self, prompt):
        n = len(self.slow)
        return any(prompt[i : i + n] == self.slow for i in range(len(prompt) - n + 1))

    async def generate(self, prompt_ids, params, request_id=None):
        who = "slow" if self._is_slow(prompt_ids) else "fast"
        self.log.append(("send", who))
        self.seeds.append(params.seed)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.delay if who == "slow" else 0.0)
        self.in_flight -= 1
        self.log.append(("done", who))
        ids = self.tok.encode("note", add_special_tokens=False)[: params.max_tokens]
        return [GenerationOutput(ids, [-0.5] * len(ids), "stop")]


def test_a_fast_trajectory_runs_ahead_of_a_slow_one(tmp_path, tok):
    """Trajectory 1's answers take 0.3 s, trajectory 0's none: trajectory 0 reads all 8 of its chunks and answers
    while trajectory 1 is still on its first (lock step would send each turn's two requests together)."""
    cfg, gen = _gen_batch(tmp_path, tok, [_context(40, 0), _context(40, 3)], sampling={"seed": 100})
    replica = TimedReplica(tok, tok.encode("What is code 1?", add_special_tokens=False), delay=0.3)
    client_calls = RolloutClient(None)  # the trainer's rollout client: its call counter
    client_calls.calls = 7
    manager = FreeRunningGenerationManager(tok, [replica], MemoryAgent(tok, cfg), calls_per_rank=1)
    manager.rollout = client_calls
    try:
        conv, final_mask, sample_index = manager.run_llm_loop(gen)
    finally:
        manager.shutdown()
    turns = -(-int(gen.batch["context_length"][0]) // cfg.chunk_size) + 1  # memory turns + the final answer
    assert turns == 9 and int(gen.batch["context_length"][1]) == int(gen.batch["context_length"][0])
    first_slow_done = replica.log.index(("done", "slow"))
    assert replica.log[:first_slow_done].count(("send", "fast")) == turns
    assert replica.peak == 2
    # seed + stride x (the client's calls + turn) + trajectory; the client's counter moves on by the turns
    sent = [who for what, who in replica.log if what == "send"]
    fast_seeds = [seed for who, seed in zip(sent, replica.seeds) if who == "fast"]
    assert fast_seeds == [100 + SEED_STRIDE * (7 + t) for t in range(turns)]
    assert sorted(replica.seeds) == sorted(100 + SEED_STRIDE * (7 + t) + i for t in range(turns) for i in (0, 1))
    assert client_calls.calls == 7 + turns
    # lock step's order: turn by turn, then the finals
    assert sample_index.tolist() == [0, 1] * turns
    assert final_mask.tolist() == [False] * (2 * turns - 2) + [True] * 2
    assert conv.meta_info["active_traj_num"] == [2] * turns


def test_the_engine_sees_every_trajectory_at_once_over_a_ray_like_rank(tmp_path, tok):
    """Over a rank (RequestReplica via a worker group) each request is a call of its own, calls_per_rank at once."""
    import threading

    class Rank:
        def __init__(self):
            self.lock = threading.Lock()
            self.in_flight = self.peak = 0
            self.sizes = []

        def call(self, prompts, params, seeds):
            with self.lock:
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
                self.sizes.append(len(prompts))
            time.sleep(0.05)
            with self.lock:
                self.in_flight -= 1
            return [[GenerationOutput([7, 8], [-0.1, -0.1], "stop")] for _ in prompts]

    rank = Rank()

    class Group:  # what ray_rank_replicas calls: one worker, call_rank(rank, "generate", ...) -> an awaitable
        workers = [object()]

        @staticmethod
        def call_rank(r, method, *args):
            return asyncio.get_running_loop().run_in_executor(pool, rank.call, *args)

    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(4)
    cfg, gen = _gen_batch(tmp_path, tok, [_context(20, s) for s in range(4)], sampling={})
    manager = FreeRunningGenerationManager(tok, Group(), MemoryAgent(tok, cfg), calls_per_rank=4)
    try:
        conv, _, _ = manager.run_llm_loop(gen)
    finally:
        manager.shutdown()
        pool.shutdown()
    assert set(rank.sizes) == {1} and rank.peak == 4
    assert conv.meta_info["metrics"]["rollout/replica_calls"] == len(conv) == len(rank.sizes)


def test_a_batch_larger_than_the_ranks_threads_runs_in_lock_step(tmp_path, tok):
    """2 threads per rank, 1 rank, 3 trajectories (a validation batch larger than the training batch): the turns
    go to the rank whole, through the trainer's rollout client, instead of one trajectory waiting for a thread."""
    sizes = []

    class Group:  # a Ray worker group of one rank: the rollout client's generate, and call_rank for single calls
        world_size = 1
        workers = [object()]

        def generate(self, prompts, params, seeds):
            sizes.append(len(prompts[0]))
            return [[[GenerationOutput([7, 8], [-0.1, -0.1], "stop")] for _ in prompts[0]]]

        def call_rank(self, rank, method, prompts, params, seeds):
            async def one():
                sizes.append(len(prompts))
                return [[GenerationOutput([7, 8], [-0.1, -0.1], "stop")] for _ in prompts]

            return one()

    cfg, gen = _gen_batch(tmp_path, tok, [_context(20, s) for s in range(3)], sampling={})
    client = RolloutClient(Group())
    manager = FreeRunningGenerationManager(tok, client, MemoryAgent(tok, cfg), calls_per_rank=2)
    try:
        assert manager.in_flight_limit() == 2
        lock, _, _ = manager.run_llm_loop(gen)
        assert set(sizes) == {3} and client.calls == len(sizes)  # whole turns, lock step's calls
        sizes.clear()
        free, _, _ = manager.run_llm_loop(gen[:2])
        assert set(sizes) == {1} and len(sizes) == len(free)  # within the threads: a call per request
    finally:
        manager.shutdown()
    assert FreeRunningGenerationManager(tok, [Replica()], MemoryAgent(tok, cfg), 1).in_flight_limit() is None


def test_a_replica_given_as_the_rollout_keeps_its_call_count(tmp_path, tok):
    """Only the trainer's rollout client's counter moves on by the turns: a replica's ``calls`` is its own count."""
    from recurrent.replicas import RequestReplica

    async def submit(prompts, params, seeds):
        return [[GenerationOutput([7, 8], [-0.1, -0.1], "stop")] for _ in prompts]

    replica = RequestReplica(submit, 8)
    cfg, gen = _gen_batch(tmp_path, tok, [_context(20, s) for s in range(3)], sampling={"seed": 1})
    manager = FreeRunningGenerationManager(tok, replica, MemoryAgent(tok, cfg), calls_per_rank=8)
    try:
        first, _, _ = manager.run_llm_loop(gen)
        second, _, _ = manager.run_llm_loop(gen)
    finally:
        manager.shutdown()
    assert first.meta_info["metrics"]["rollout/replica_calls"] == len(first)
    assert second.meta_info["metrics"]["rollout/replica_calls"] == len(second)
    assert replica.calls == len(first) + len(second)


def test_an_in_process_workers_engine_runs_under_its_rollout_guard(tmp_path, tok):
    """An in-process worker group (``LocalWorkerGroup``): each request runs under the worker's RolloutGuard, so a
    weight sync during the rollout is refused and the worker's generation clock counts it; wake-up and sleep are the
    worker's (they sync the weights after a sleep that dropped them)."""
    from types import SimpleNamespace

    from recurrent.replicas import WorkerReplica, replicas_from
    from verl.workers.rollout.guard import RolloutGuard

    guard = RolloutGuard()
    seen = {"refused": 0, "in_flight": 0, "calls": []}

    class Engine:
        async def generate(self, prompt_ids, params, request_id=None):
            seen["in_flight"] = max(seen["in_flight"], guard.in_flight)
            try:
                with guard.changing("sync_rollout_weights"):
                    pass
            except RuntimeError:
                seen["refused"] += 1
            await asyncio.sleep(0.01)
            return [GenerationOutput([7, 8], [-0.1, -0.1], "stop")]

    worker = SimpleNamespace(
        rollout=Engine(),
        rollout_guard=guard,
        wake_up_rollout=lambda: seen["calls"].append("wake"),
        sleep_rollout=lambda: seen["calls"].append("sleep"),
    )
    group = SimpleNamespace(worker=worker)
    [replica] = replicas_from(group)
    assert type(replica) is WorkerReplica
    cfg, gen = _gen_batch(tmp_path, tok, [_context(20, s) for s in range(3)], sampling={"seed": 1})
    manager = FreeRunningGenerationManager(tok, group, MemoryAgent(tok, cfg), calls_per_rank=1)
    try:
        conv, _, _ = manager.run_llm_loop(gen)
    finally:
        manager.shutdown()
    assert seen["refused"] == len(conv) and seen["in_flight"] == 3  # the three trajectories at once
    assert guard.in_flight == 0 and guard.busy_seconds() >= 0.01 * len(conv) / 3
    asyncio.run(replica.wake_up())
    asyncio.run(replica.sleep())
    assert seen["calls"] == ["wake", "sleep"]


def test_a_failing_trajectory_fails_the_rollout_and_stops_the_others(tmp_path, tok):
    class Failing(Replica):
        def __init__(self):
            self.calls = 0

        async def generate(self, prompt_ids, params, request_id=None):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("engine died")
            await asyncio.sleep(0.01)
            return [GenerationOutput([7], [-0.1], "stop")]

    cfg, gen = _gen_batch(tmp_path, tok, [_context(40, s) for s in range(3)], sampling={})
    replica = Failing()
    manager = FreeRunningGenerationManager(tok, replica, MemoryAgent(tok, cfg), calls_per_rank=1)
    try:
        with pytest.raises(RuntimeError, match="engine died"):
            manager.run_llm_loop(gen)
        time.sleep(0.1)
        assert replica.calls <= 4  # the others were cancelled, not run to their end (15 requests)
    finally:
        manager.shutdown()


def test_lock_step_only_agents_and_bad_settings_are_refused(tok):
    class LockStepOnly(RAgent):
        def start(self, gen_batch, timing_raw):
            pass

        def action(self):
            return [], {}

        def update(self, gen_output):
            return gen_output

        def done(self):
            return True

    with pytest.raises(ValueError, match="free_running_turns=True needs a sync agent .* LockStepOnly"):
        FreeRunningGenerationManager(tok, [Replica()], LockStepOnly(tok, MemoryConfig()), calls_per_rank=1)
    with pytest.raises(ValueError, match="calls_per_rank must be >= 1"):
        FreeRunningGenerationManager(tok, [Replica()], MemoryAgent(tok, MemoryConfig()), calls_per_rank=0)


def test_the_trainer_wires_free_running_turns(tmp_path):
    from tests.test_config import compose_config
    from verl.trainer.config_preflight import rollout_tp_errors
    from verl.trainer.ppo.ray_worker_group import actor_rollout_ref_class
    from verl.workers.config import RolloutConfig
    from verl.workers.config.base import ConfigError

    key = "actor_rollout_ref.rollout.free_running_turns"
    sizes = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "trainer.n_gpus_per_node=3"]
    # 32 trajectories over 3 ranks: 11 generate threads per worker
    free = actor_rollout_ref_class(compose_config([*sizes, f"{key}=True"]), "cpu")
    assert free.options == {"concurrency_groups": {"rollout": 11, "train": 1}}
    assert actor_rollout_ref_class(compose_config(sizes), "cpu").options == {}
    with pytest.raises(ConfigError, match="free_running_turns=True is for sync workflows.*async_free_running_calls"):
        RolloutConfig.from_config(
            compose_config([f"{key}=True", "actor_rollout_ref.rollout.mode=async"]).actor_rollout_ref.rollout
        )
    tp = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    errors = rollout_tp_errors(compose_config([*tp, f"{key}=True"]))
    assert any(f"{key}=True with actor_rollout_ref.rollout.tensor_model_parallel_size=2" in e for e in errors)
    assert not any(key in e for e in rollout_tp_errors(compose_config(tp)))
