"""Synchronous multi-conversation driver: runs any :class:`RAgent` turn by turn against a rollout.

The rollout is anything with ``generate_batch(prompt_ids: list[list[int]], params) ->
list[list[GenerationOutput]]`` (the engines in ``verl.workers.rollout`` and the trainer's
rollout client over Ray replicas). All prompts of one turn go to the rollout in one call, so
the engine batches them.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from recurrent.interface import RAgent
from recurrent.utils import build_conversation_batch, concat_conversations
from verl.protocol import DataProto
from verl.utils.conversation_batch import engine_log_probs

logger = logging.getLogger(__name__)


class LLMGenerationManager:
    """Drive a sync agent and return one flat batch of conversations.

    ``gen_batch.meta_info["sampling"]`` carries the trainer's base sampling parameters
    (temperature, top_p, top_k, greedy, seed ...); the agent's per-turn ``generation_kwargs``
    (``max_tokens`` ...) are layered on top.
    """

    def __init__(self, tokenizer, rollout, agent: RAgent):
        self.tokenizer = tokenizer
        self.rollout = rollout
        self.agent = agent
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def run_llm_loop(self, gen_batch: DataProto, timing_raw: dict | None = None):
        """Return ``(conversations: DataProto, final_mask [C] bool, sample_index [C] long)``.

        Conversations are in generation order (all turn-1 rows, then turn-2 rows, ...). Each row
        has ``prompts`` (left-padded), ``responses`` (right-padded), ``input_ids``,
        ``attention_mask``, ``position_ids``, ``response_mask`` and, when the engine returns them,
        ``rollout_log_probs``; widths are those of the batch (the widest turn).
        """
        from verl.workers.rollout.base import SamplingParams

        timing = defaultdict(float)
        base_sampling = dict(gen_batch.meta_info.get("sampling", {}))
        self.agent.start(gen_batch, timing)
        outputs: list[DataProto] = []
        active_counts: list[int] = []
        while not self.agent.done():
            t0 = time.perf_counter()
            prompts, meta = self.agent.action()
            params = SamplingParams.from_dict({**base_sampling, **meta.get("generation_kwargs", {})})
            if params.n != 1:
                raise ValueError(f"workflow turns must sample n=1 per conversation, got n={params.n}")
            prompt_lists = [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in prompts]
            active_counts.append(len(prompt_lists))
            t1 = time.perf_counter()
            results = self.rollout.generate_batch(prompt_lists, params)
            t2 = time.perf_counter()
            turn = self._turn_batch(prompt_lists, [r[0] for r in results])
            outputs.append(self.agent.update(turn))
            t3 = time.perf_counter()
            timing["mt_prepare"] += t1 - t0
            timing["mt_gen"] += t2 - t1
            timing["mt_update"] += t3 - t2
        final_mask, sample_index = self.agent.end()
        if len(sample_index) != sum(active_counts):
            raise RuntimeError(f"agent reported {len(sample_index)} conversations but generated {sum(active_counts)}")
        n_final = int(final_mask.sum())
        if n_final != len(gen_batch):
            raise RuntimeError(f"{n_final} final conversations for {len(gen_batch)} trajectories")
        logger.info("ACTIVE_TRAJ_NUM: %s", active_counts)
        conversations = concat_conversations(outputs, self.pad_id)
        conversations.meta_info["active_traj_num"] = active_counts
        conversations.meta_info["pad_token_id"] = self.pad_id
        if timing_raw is not None:
            for k, v in timing.items():
                timing_raw[k] = timing_raw.get(k, 0.0) + v
        return conversations, final_mask, sample_index

    def _turn_batch(self, prompts: list[list[int]], outs: list[Any]) -> DataProto:
        tensors = build_conversation_batch(prompts, [o.token_ids for o in outs], self.pad_id)
        lp = engine_log_probs(outs, tensors["responses"].shape[1])
        if lp is not None:
            tensors["rollout_log_probs"] = lp
        non_tensors = {"finish_reason": np.array([o.finish_reason for o in outs], dtype=object)}
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
