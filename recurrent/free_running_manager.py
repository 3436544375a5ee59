"""Free-running turns for sync agents (``actor_rollout_ref.rollout.free_running_turns``).

Lock step (:class:`recurrent.generation_manager.LLMGenerationManager`, the default and the original MemAgent's
design) sends turn k of every trajectory as one batch, so a turn lasts as long as its longest answer while the
engine's batch empties. Here each trajectory runs on its own: its next request (the agent's state machine,
:meth:`recurrent.interface.RAgent.free_running_loops`) goes to the engine as soon as its answer arrived, and the
engine batches whatever requests are in flight. Prompts stay token ids spliced by the agent (no text round trip,
unlike async mode's agents); only the scheduling changes. With answers of varied length this took 0.50-0.83x the
engine steps of lock step on a CPU (``benchmarks/bench_turn_scheduling.py``); on one H200 its steps cost more (they mix
prefills into decodes), and it has not been shown faster there (``benchmarks/RESULTS.md``).

What the trainer gets is what lock step gives: the same rows in the same order (memory turns turn by turn in
trajectory order, then every final answer), the same ``final_mask``/``sample_index`` and ``active_traj_num``. Seeds
are per (turn, trajectory): ``seed + 1_000_003 x (call + turn) + trajectory``, with ``call`` the rollout client's
call counter (the trainer resets it each step), which is lock step's seed of every request when all trajectories
have the same number of chunks.

Each trajectory sticks to one engine (:class:`recurrent.replicas.Router`: least loaded at its first turn). Over a
Ray worker group each request is a call of its own (:class:`recurrent.replicas.RequestReplica`), up to
``calls_per_rank`` at once per rank; the trainer gives each worker that many threads for ``generate``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from recurrent.generation_manager import LLMGenerationManager
from recurrent.interface import RAgent, require_free_running
from recurrent.replicas import Router, replicas_from
from verl.protocol import DataProto
from verl.workers.rollout.base import GenerationOutput, SamplingParams, _LoopThread

logger = logging.getLogger(__name__)

__all__ = ["FreeRunningGenerationManager", "SEED_STRIDE"]

SEED_STRIDE = 1_000_003  # the rollout client's seed step per call (verl/trainer/ppo/trainer_core.py)


@dataclass
class _Row:
    trajectory: int
    turn: int
    is_final: bool
    prompt: list[int]
    output: GenerationOutput

    @property
    def order(self) -> tuple[int, int, int]:
        """Lock step's order: memory turns turn by turn, then all final answers; trajectories in order within."""
        return (1, 0, self.trajectory) if self.is_final else (0, self.turn, self.trajectory)


class FreeRunningGenerationManager(LLMGenerationManager):
    """Drive a sync agent's trajectories free-running (module docstring); ``run_llm_loop`` as lock step's.

    Args:
        tokenizer: the model's tokenizer (pad id).
        rollout: an engine, replicas, the trainer's ``RolloutClient`` or a worker group (:func:`replicas_from`).
        agent: an agent with :meth:`~recurrent.interface.RAgent.free_running_loops`.
        calls_per_rank: requests in flight per rank of a Ray worker group (>= 1; in-process engines take any number).

    Raises:
        ValueError: the agent runs in lock step only, or ``calls_per_rank`` < 1.
    """

    def __init__(self, tokenizer: Any, rollout: Any, agent: RAgent, calls_per_rank: int):
        require_free_running(type(agent))
        if calls_per_rank < 1:
            raise ValueError(f"calls_per_rank must be >= 1, got {calls_per_rank}")
        super().__init__(tokenizer, rollout, agent)
        self.replicas = replicas_from(rollout, calls_per_rank)
        self._loop_thread: _LoopThread | None = None

    def in_flight_limit(self) -> int | None:
        """Requests the ranks run at once (the sum of their ``calls_per_rank``), None when an in-process engine takes
        any number."""
        limits = [getattr(r, "max_in_flight", None) for r in self.replicas]
        return None if any(limit is None for limit in limits) else sum(limits)

    def run_llm_loop(self, gen_batch: DataProto, timing_raw: dict | None = None):
        """Return ``(conversations, final_mask [C] bool, sample_index [C] long)`` as lock step does.

        A batch with more trajectories than the ranks run at once (a validation batch larger than the training
        batch the workers' threads were sized for) runs in lock step, which sends each rank its whole turn in one
        call, instead of leaving the surplus waiting for threads."""
        limit = self.in_flight_limit()
        if limit is not None and len(gen_batch) > limit:
            logger.info(
                "free-running turns: %d trajectories but %d requests in flight at most; this rollout runs in lock step",
                len(gen_batch),
                limit,
            )
            return super().run_llm_loop(gen_batch, timing_raw)
        base = dict(gen_batch.meta_info.get("sampling", {}))
        if int(base.get("n", 1)) != 1:
            raise ValueError(f"workflow turns must sample n=1 per conversation, got n={base['n']}")
        loops = self.agent.free_running_loops(gen_batch)
        if len(loops) != len(gen_batch):
            raise RuntimeError(f"agent made {len(loops)} trajectories for a batch of {len(gen_batch)}")
        # the trainer's rollout client counts its calls (lock step: one per turn), from 0 each step; its seeds follow
        client = self.rollout if hasattr(self.rollout, "generate_batch") and hasattr(self.rollout, "calls") else None
        first_call = int(client.calls) if client is not None else 0
        calls0 = sum(int(getattr(r, "calls", 0)) for r in self.replicas)
        if self._loop_thread is None:
            self._loop_thread = _LoopThread("free-running-turns")
        t0 = time.perf_counter()
        per_trajectory = self._loop_thread.run(self._run_all(loops, base, first_call))
        t1 = time.perf_counter()
        rows = sorted((row for rows in per_trajectory for row in rows), key=lambda r: r.order)
        if client is not None:
            client.calls = first_call + max(len(rows) for rows in per_trajectory)
        conversations = self._turn_batch([r.prompt for r in rows], [r.output for r in rows])
        counts: dict[tuple[int, int], int] = defaultdict(int)
        for row in rows:
            counts[row.order[:2]] += 1
        active_counts = list(counts.values())  # rows are sorted, so the turns are in order
        conversations.meta_info["active_traj_num"] = active_counts
        conversations.meta_info["pad_token_id"] = self.pad_id
        replica_calls = sum(int(getattr(r, "calls", 0)) for r in self.replicas) - calls0
        conversations.meta_info["metrics"] = {"rollout/replica_calls": float(replica_calls)}
        final_mask = torch.tensor([r.is_final for r in rows], dtype=torch.bool)
        sample_index = torch.tensor([r.trajectory for r in rows], dtype=torch.long)
        if int(final_mask.sum()) != len(gen_batch):
            raise RuntimeError(f"{int(final_mask.sum())} final conversations for {len(gen_batch)} trajectories")
        logger.info("ACTIVE_TRAJ_NUM: %s", active_counts)
        if timing_raw is not None:
            timing_raw["mt_gen"] = timing_raw.get("mt_gen", 0.0) + t1 - t0
            timing_raw["mt_update"] = timing_raw.get("mt_update", 0.0) + time.perf_counter() - t1
        return conversations, final_mask, sample_index

    async def _run_all(self, loops: list[Any], base: dict[str, Any], first_call: int) -> list[list[_Row]]:
        router = Router(len(self.replicas), max_sessions=len(loops) + 1)
        tasks = [
            asyncio.ensure_future(self._run_one(i, loop, base, first_call, router)) for i, loop in enumerate(loops)
        ]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # a failed trajectory fails the rollout: stop generating for the others
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _run_one(self, i: int, loop: Any, base: dict[str, Any], first_call: int, router: Router) -> list[_Row]:
        rows: list[_Row] = []
        seed = base.get("seed")
        while not loop.done:
            request = loop.next_request()
            turn = len(rows)
            params = {**base, "max_tokens": request.max_tokens, "n": 1}
            if seed is not None:
                params["seed"] = int(seed) + SEED_STRIDE * (first_call + turn) + i
            prompt = request.prompt.tolist() if isinstance(request.prompt, torch.Tensor) else list(request.prompt)
            replica, _ = router.acquire(f"trajectory-{i}")
            try:
                outputs = await self.replicas[replica].generate(prompt, SamplingParams.from_dict(params))
            finally:
                router.release(replica)
            output = outputs[0]
            loop.take(self.agent.response_of(list(output.token_ids), request))
            rows.append(_Row(i, turn, request.is_final, prompt, output))
        return rows

    def shutdown(self) -> None:
        """Stop the manager's event loop thread."""
        if self._loop_thread is not None:
            self._loop_thread.stop()
            self._loop_thread = None
