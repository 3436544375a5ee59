"""MemAgent: read a long context chunk by chunk, overwrite a plain-text memory, answer from memory.

Per trajectory: ``ceil(context_tokens / chunk_size)`` memory-update conversations (at most
``max_chunks``), then one final-answer conversation. All trajectories still reading at turn k go
to the engine in one batch; trajectories whose context is exhausted wait, and every final answer
is generated together in the last turn.

Deliberate differences from the original (memagent-spec §11):
* the final prompt renders ``\\boxed{}`` (the original sync agent sent ``\\boxed{{}}``);
* the final turn is limited by ``max_final_response_length`` (the original used
  ``max_memorization_length``; both default to 1024);
* ``style`` is not a required config field;
* a question longer than ``max_prompt_length`` widens the batch instead of breaking concatenation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from recurrent.interface import RAgent, RConfig, RRegister
from recurrent.prompts import MEMORY_FINAL_TEMPLATE_BOXED, MEMORY_UPDATE_TEMPLATE, NO_MEMORY
from recurrent.utils import TokenTemplate, center_truncate, chat_template_string
from verl.protocol import DataProto
from verl.utils.dataset.rl_dataset import RLHFDataset

logger = logging.getLogger(__name__)


@dataclass
class MemoryConfig(RConfig):
    """``recurrent.memory.config``; defaults are the original run scripts' values."""

    # dataset column holding the long context
    context_key: str = "context"
    # token budget of the question (sizing only)
    max_prompt_length: int = 1024
    # tokens of context per memory-update turn
    chunk_size: int = 5000
    # max new tokens of a memory update (= memory size)
    max_memorization_length: int = 1024
    # max chunks per sample; longer contexts are center-truncated to max_chunks * chunk_size
    max_chunks: int = 8
    # max new tokens of the final answer
    max_final_response_length: int = 1024
    # accepted and ignored (the original declared it without a default; spec §11 item 1)
    style: str | None = None

    def __post_init__(self):
        for name in (
            "max_prompt_length",
            "chunk_size",
            "max_memorization_length",
            "max_chunks",
            "max_final_response_length",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"recurrent.memory.config.{name} must be a positive integer, got {value!r}")

    @property
    def max_context_length(self) -> int:
        return self.max_chunks * self.chunk_size

    @property
    def max_raw_input_length(self) -> int:
        return self.max_prompt_length + self.chunk_size + self.max_memorization_length


class MemoryDataset(RLHFDataset):
    """Rows with a question (``prompt``) and a long ``context``; the context is tokenised once."""

    def __init__(self, recurrent_config: MemoryConfig, data_files, tokenizer, data_config, processor=None):
        truncation = data_config.get("truncation", "center")
        if truncation != "center":
            raise ValueError(f"MemoryDataset only supports data.truncation=center, got {truncation!r}")
        self.recurrent_config = recurrent_config
        super().__init__(data_files, tokenizer, data_config, processor)
        key = recurrent_config.context_key
        for i, row in enumerate(self.rows):
            if not isinstance(row.get(key), str):
                raise ValueError(
                    f"{row.get('_source_file')} row {i}: field {key!r} must be a string "
                    f"(recurrent.memory.config.context_key), got {type(row.get(key)).__name__}"
                )

    def __getitem__(self, i: int) -> dict:
        row = dict(self.rows[i])
        messages = row.pop(self.prompt_key)
        context = row.pop(self.recurrent_config.context_key)
        ctx = self.tokenizer.encode(context, add_special_tokens=False)
        ctx = np.asarray(center_truncate(ctx, self.recurrent_config.max_context_length), dtype=np.int64)
        row["context_ids"] = ctx
        row["context_length"] = torch.tensor(len(ctx), dtype=torch.long)
        row["prompt_ids"] = self.tokenizer.encode(messages[-1]["content"], add_special_tokens=False)
        return self.stamp_row(row, self.row_positions[i])

    def prompt_length(self, row: dict) -> int:
        """The question's tokens (``prompt_ids``, what every turn's prompt embeds), for filter_overlong_prompts."""
        return len(self.tokenizer.encode(row[self.prompt_key][-1]["content"], add_special_tokens=False))

    def prompt_length_limit(self) -> tuple[int, str]:
        """The question budget ``recurrent.memory.config.max_prompt_length``: ``data.max_prompt_length`` only sizes
        the engine here (the original compared the templated question with max_chunks * chunk_size, which never
        filters)."""
        return self.recurrent_config.max_prompt_length, "recurrent.memory.config.max_prompt_length"

    @staticmethod
    def get_batch_keys() -> tuple[list[str], list[str]]:
        """(tensor keys, non-tensor keys) the trainer pops into the generation batch."""
        return ["context_length"], ["context_ids", "prompt_ids"]

    get_bactch_keys = get_batch_keys  # the original's spelling


class MemoryAgent(RAgent):
    """The MemAgent workflow as a lock-step state machine over a batch of trajectories."""

    def __init__(self, tokenizer, config: MemoryConfig):
        super().__init__(tokenizer, config)
        chat = chat_template_string(tokenizer)
        if "{message}" not in chat:
            raise ValueError("the tokenizer's chat template did not render the user message")
        self.update_template = TokenTemplate(chat.replace("{message}", MEMORY_UPDATE_TEMPLATE), tokenizer)
        self.final_template = TokenTemplate(chat.replace("{message}", MEMORY_FINAL_TEMPLATE_BOXED), tokenizer)
        self.no_memory = tokenizer.encode(NO_MEMORY, add_special_tokens=False)
        self.drop_ids = torch.tensor([t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None])
        logger.info("[RECURRENT] max_input_length: %d", config.max_raw_input_length + self.update_template.length)

    def start(self, gen_batch: DataProto, timing_raw: dict) -> None:
        self.contexts = gen_batch.non_tensor_batch["context_ids"]
        self.questions = gen_batch.non_tensor_batch["prompt_ids"]
        self.ctx_length = gen_batch.batch["context_length"].clone()
        self.memory: list[list[int] | None] = [None] * len(gen_batch)
        self.step = 0
        self.is_final = False
        self.active: torch.Tensor | None = None

    def action(self):
        c = self.config.chunk_size
        active = self.ctx_length > self.step * c
        n = len(self.ctx_length)
        if not bool(active.any()):
            prompts = [
                self.final_template.format(prompt=self.questions[i], memory=self.memory[i] or self.no_memory)
                for i in range(n)
            ]
            self.sample_index_list.append(torch.arange(n))
            self.final_mask_list.append(torch.ones(n, dtype=torch.bool))
            self.is_final = True
            max_tokens = self.config.max_final_response_length
        else:
            idx = torch.nonzero(active, as_tuple=False).squeeze(-1)
            lo, hi = self.step * c, (self.step + 1) * c
            prompts = [
                self.update_template.format(
                    prompt=self.questions[i],
                    memory=self.memory[i] or self.no_memory,
                    chunk=self.contexts[i][lo:hi],
                )
                for i in idx.tolist()
            ]
            self.sample_index_list.append(idx)
            self.final_mask_list.append(torch.zeros(len(idx), dtype=torch.bool))
            max_tokens = self.config.max_memorization_length
        self.active = None if self.is_final else idx
        return prompts, {"generation_kwargs": {"max_tokens": max_tokens, "n": 1}}

    def update(self, gen_output: DataProto) -> DataProto:
        if not self.is_final:
            responses = gen_output.batch["responses"]
            keep = gen_output.batch["response_mask"].bool() & ~torch.isin(responses, self.drop_ids)
            for row, i in enumerate(self.active.tolist()):
                self.memory[i] = responses[row][keep[row]][: self.config.max_memorization_length].tolist()
            self.step += 1
        return gen_output

    def done(self) -> bool:
        return self.is_final


REGISTER = RRegister(config_cls=MemoryConfig, dataset_cls=MemoryDataset, agent_cls=MemoryAgent)
