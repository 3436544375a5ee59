"""MemAgent as an async agent: one coroutine per trajectory, text memory, OpenAI-style chat calls.

Same loop (:mod:`recurrent.memory_loop`), prompts, chunking and limits as the sync workflow
(:mod:`recurrent.impls.memory`): the context is tokenised once by the dataset and cut into
``chunk_size``-token chunks (at most ``max_chunks``); each chunk is decoded to text for its
memory-update prompt; the memory is the previous answer's text ("No previous memory" before the
first update); after the last chunk a final prompt asks for the boxed answer
(``max_final_response_length`` tokens).

Differences from sync mode (docs/spec.md#memory-loop): the chunk is decoded and the whole prompt is
tokenised again from text, so token boundaries at the chunk edges can differ from the sync
agent's spliced ids (the text is the same); training uses the engine's own sampled tokens.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from recurrent.async_utils import AsyncOutput, AsyncRAgent, msg
from recurrent.impls.memory import MemoryConfig, MemoryDataset
from recurrent.interface import RRegister
from recurrent.memory_loop import MemoryLoop, MemoryRequest, TextPrompts, run_memory_loop, token_chunks

logger = logging.getLogger(__name__)


class AsyncMemoryDataset(MemoryDataset):
    """:class:`MemoryDataset` that hands the agent the question as text (``prompt``)."""

    def __getitem__(self, i: int) -> dict:
        row = super().__getitem__(i)
        row.pop("prompt_ids")
        row["prompt"] = self.rows[i][self.prompt_key][-1]["content"]
        return row

    @staticmethod
    def get_batch_keys() -> tuple[list[str], list[str]]:
        """(tensor keys, non-tensor keys) the trainer pops into the generation batch."""
        return ["context_length"], ["context_ids", "prompt"]

    get_bactch_keys = get_batch_keys  # the original's spelling


class AsyncMemoryAgent(AsyncRAgent):
    """Read the context chunk by chunk, overwrite the memory, answer from it (one sample): one
    :class:`~recurrent.memory_loop.MemoryLoop` with text prompts, each request awaited over the proxy."""

    async def rollout(self, gen_item) -> AsyncOutput:
        cfg: MemoryConfig = self.config
        idx = self.sample_index(gen_item)
        context = np.asarray(gen_item.non_tensor_batch["context_ids"])
        length = int(gen_item.batch["context_length"])
        chunks = (
            self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
            for ids in token_chunks(context, cfg.chunk_size, length)
        )
        loop = MemoryLoop(
            str(gen_item.non_tensor_batch["prompt"]),
            chunks,
            TextPrompts(final_style="boxed"),
            memory_tokens=cfg.max_memorization_length,
            final_tokens=cfg.max_final_response_length,
            max_chunks=cfg.max_chunks,
        )
        base = self.sampling_params(gen_item.meta_info)
        session = f"mem-{idx}"
        conversations, generating = [], 0.0

        async def send(request: MemoryRequest) -> str:
            nonlocal generating
            messages = [{"role": "user", "content": request.prompt}]
            t0 = time.perf_counter()
            completion = await self.proxy.chat(
                messages, request_id=session, **base, max_completion_tokens=request.max_tokens
            )
            generating += time.perf_counter() - t0
            answer = msg(completion.choices[0])
            conversations.append(messages + [answer])
            return answer["content"]

        started = time.perf_counter()
        await run_memory_loop(loop, send)
        timing = {"mt_misc": time.perf_counter() - started - generating, "mt_async_gen": generating}
        if idx == 0 and logger.isEnabledFor(logging.DEBUG):
            for conv in conversations:
                logger.debug("[sample 0] %s", [(m["role"], _clip(m["content"])) for m in conv])
        n = len(conversations)
        return AsyncOutput(
            conversations, sample_index=[idx] * n, final_mask=[False] * (n - 1) + [True], timing_raw=timing
        )


def _clip(text: str, limit: int = 2000) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return text[:half] + "\n\n...(truncated)\n\n" + text[-half:]


REGISTER = RRegister(config_cls=MemoryConfig, dataset_cls=AsyncMemoryDataset, agent_cls=AsyncMemoryAgent)
