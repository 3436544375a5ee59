"""Single-turn baseline as an async agent (module name keeps the original's spelling, "trival").

Each trajectory is one chat call on the dataset's ``raw_prompt`` with at most
``actor_rollout_ref.rollout.response_length`` new tokens; one conversation, ``final_mask=[True]``.
Selectable as ``recurrent.enable=trival`` (original) or ``trivial``.
"""

from __future__ import annotations

import time

from recurrent.async_utils import AsyncOutput, AsyncRAgent, msg
from recurrent.interface import RConfig, RRegister
from verl.utils.dataset.rl_dataset import RLHFDataset


class TrivialDataset(RLHFDataset):
    """Plain chat-prompt rows; the agent reads ``raw_prompt``."""

    def __init__(self, recurrent_config, data_files, tokenizer, data_config, processor=None):
        self.recurrent_config = recurrent_config
        super().__init__(data_files, tokenizer, data_config, processor)

    @staticmethod
    def get_batch_keys() -> tuple[list[str], list[str]]:
        """(tensor keys, non-tensor keys) the trainer pops into the generation batch."""
        return [], ["raw_prompt"]

    get_bactch_keys = get_batch_keys  # the original's spelling


class AsyncTrivialAgent(AsyncRAgent):
    """One chat call per trajectory."""

    def __init__(self, proxy, tokenizer, config=None, rollout_config=None):
        super().__init__(proxy, tokenizer, config if config is not None else RConfig(), rollout_config)

    async def rollout(self, gen_item) -> AsyncOutput:
        idx = self.sample_index(gen_item)
        messages = [dict(m) for m in gen_item.non_tensor_batch["raw_prompt"]]
        max_tokens = self.rollout_config.response_length  # None: the proxy's default (rollout.response_length)
        t0 = time.perf_counter()
        completion = await self.proxy.chat(
            messages,
            request_id=f"trivial-{idx}",
            **self.sampling_params(gen_item.meta_info),
            max_completion_tokens=max_tokens,
        )
        timing = {"mt_async_gen": time.perf_counter() - t0}
        return AsyncOutput(
            [messages + [msg(completion.choices[0])]], sample_index=[idx], final_mask=[True], timing_raw=timing
        )


AsyncTrivalAgent = AsyncTrivialAgent  # the original's spelling
REGISTER = RRegister(config_cls=RConfig, dataset_cls=TrivialDataset, agent_cls=AsyncTrivialAgent)
