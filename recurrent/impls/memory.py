"""MemAgent: read a long context chunk by chunk, overwrite a plain-text memory, answer from memory.

Per trajectory: ``ceil(context_tokens / chunk_size)`` memory-update conversations (at most
``max_chunks``), then one final-answer conversation. All trajectories still reading at turn k go
to the engine in one batch; trajectories whose context is exhausted wait, and every final answer
is generated together in the last turn. The loop itself (chunks, memory, final turn) is
:mod:`recurrent.memory_loop`, shared with the async agent and the evaluation.

Deliberate differences from the original (docs/spec.md#original-bugs):
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
from recurrent.memory_loop import MemoryLoop, TokenPrompts, lockstep_turn, token_chunks
from recurrent.utils import center_truncate
from verl.protocol import DataProto
from verl.utils.dataset.rl_dataset import RLHFDataset, require_column

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
    # accepted and ignored (the original declared it without a default; docs/spec.md#bug-style-field)
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
        from verl.trainer.config import DataConfig

        truncation = DataConfig.from_config(data_config).truncation
        if truncation != "center":
            raise ValueError(f"MemoryDataset only supports data.truncation=center, got {truncation!r}")
        self.recurrent_config = recurrent_config
        super().__init__(data_files, tokenizer, data_config, processor)
        key = recurrent_config.context_key
        require_column(self.dataframe, key, "recurrent.memory.config.context_key")
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
    """The MemAgent workflow: one :class:`~recurrent.memory_loop.MemoryLoop` per trajectory (token-id
    prompts, :class:`~recurrent.memory_loop.TokenPrompts`), stepped in lock-step
    (:func:`~recurrent.memory_loop.lockstep_turn`)."""

    def __init__(self, tokenizer, config: MemoryConfig):
        super().__init__(tokenizer, config)
        self.prompts = TokenPrompts(tokenizer, final_style="boxed")
        self.drop_ids = {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}
        logger.info(
            "[RECURRENT] max_input_length: %d", config.max_raw_input_length + self.prompts.update_template.length
        )

    def start(self, gen_batch: DataProto, timing_raw: dict) -> None:
        self.loops = self.free_running_loops(gen_batch)
        self.turn: list[int] = []
        self.is_final = False

    def free_running_loops(self, gen_batch: DataProto) -> list[MemoryLoop]:
        """One :class:`MemoryLoop` per trajectory (lock step drives them turn by turn; free-running turns,
        ``rollout.free_running_turns``, each on its own)."""
        cfg = self.config
        contexts = gen_batch.non_tensor_batch["context_ids"]
        questions = gen_batch.non_tensor_batch["prompt_ids"]
        lengths = gen_batch.batch["context_length"].tolist()
        return [
            MemoryLoop(
                questions[i],
                token_chunks(contexts[i], cfg.chunk_size, lengths[i]),
                self.prompts,
                memory_tokens=cfg.max_memorization_length,
                final_tokens=cfg.max_final_response_length,
                max_chunks=cfg.max_chunks,
            )
            for i in range(len(gen_batch))
        ]

    def response_of(self, token_ids: list[int], request) -> list[int]:
        """The answer without EOS/pad ids, at most the request's ``max_tokens`` (what the memory becomes)."""
        return [t for t in token_ids if t not in self.drop_ids][: request.max_tokens]

    def action(self):
        self.turn = lockstep_turn(self.loops)
        requests = [self.loops[i].next_request() for i in self.turn]
        self.is_final = all(r.is_final for r in requests)
        max_tokens = requests[0].max_tokens if requests else self.config.max_final_response_length
        self.sample_index_list.append(torch.tensor(self.turn, dtype=torch.long))
        self.final_mask_list.append(torch.full((len(self.turn),), self.is_final, dtype=torch.bool))
        return [r.prompt for r in requests], {"generation_kwargs": {"max_tokens": max_tokens, "n": 1}}

    def update(self, gen_output: DataProto) -> DataProto:
        responses = gen_output.batch["responses"].tolist()
        lengths = gen_output.batch["response_mask"].sum(-1).tolist()  # responses are right-padded
        for row, i in enumerate(self.turn):
            loop = self.loops[i]
            loop.take(self.response_of(responses[row][: lengths[row]], loop.pending))
        return gen_output

    def done(self) -> bool:
        return self.is_final


REGISTER = RRegister(config_cls=MemoryConfig, dataset_cls=MemoryDataset, agent_cls=MemoryAgent)
