"""Multi-turn tool calling on GSM8K as an async agent (MemAgent's example of a non-memory workflow).

The system prompt gets Qwen's tool block for one tool, ``calc_gsm8k_reward(answer)``, which tells
the model whether its parsed answer is right. Each turn generates at most
``max_generation_per_turn`` tokens and stops at ``</tool_call>``; a tool call is answered with a
``tool`` message and the model continues, for at most ``max_turn`` tool turns. The whole exchange
is one conversation (``final_mask=[True]``): assistant tokens are trained, tool results are not.
A malformed tool call (bad JSON, no name, unknown tool, missing argument) becomes an error message
in the tool result, never an exception.

Data: ``examples/data_preprocess/gsm8k_multiturn_w_tools.py`` (``extra_info.tools_kwargs``
carries the ground truth).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from recurrent.async_utils import AsyncOutput, AsyncRAgent, msg
from recurrent.interface import RConfig, RRegister
from recurrent.tool import (
    INVALID_TOOL,
    ToolCall,
    ToolSchema,
    merge_system_prompt,
    toolcall_extract,
    toolcall_system_prompt,
)
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.reward_score import gsm8k

TOOL_NAME = "calc_gsm8k_reward"
TOOLS = [
    ToolSchema(
        name=TOOL_NAME,
        description=(
            "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, "
            "0.0 if parsed answer is incorrect or not correctly parsed)"
        ),
        parameters={
            "type": "object",
            "properties": {
                "answer": {
                    "type": "string",
                    "description": "The model's answer to the GSM8K math problem, must be a digits",
                }
            },
            "required": ["answer"],
        },
    )
]


@dataclass
class RToolGsm8kConfig(RConfig):
    """``recurrent.tool_gsm8k.config``."""

    # most tool turns per sample
    max_turn: int = 5
    # max new tokens per assistant turn
    max_generation_per_turn: int = 256

    def __post_init__(self):
        for name in ("max_turn", "max_generation_per_turn"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "max_turn" else 1):
                raise ValueError(
                    f"recurrent.tool_gsm8k.config.{name} must be a non-negative integer "
                    f"(max_generation_per_turn >= 1), got {value!r}"
                )


class ToolGsm8kDataset(RLHFDataset):
    """GSM8K rows with chat ``prompt``; adds ``tools_kwargs`` (from ``extra_info``) for the agent."""

    def __init__(self, recurrent_config, data_files, tokenizer, data_config, processor=None):
        self.recurrent_config = recurrent_config
        super().__init__(data_files, tokenizer, data_config, processor)

    def __getitem__(self, i: int) -> dict:
        row = super().__getitem__(i)
        row["tools_kwargs"] = (row.get("extra_info") or {}).get("tools_kwargs") or {}
        return row

    @staticmethod
    def get_batch_keys() -> tuple[list[str], list[str]]:
        """(tensor keys, non-tensor keys) the trainer pops into the generation batch."""
        return [], ["raw_prompt", "tools_kwargs"]

    get_bactch_keys = get_batch_keys  # the original's spelling


def calc_gsm8k_reward(call: ToolCall, ground_truth: Any) -> str:
    """The tool's reply to ``call`` (also for invalid and unknown calls)."""
    if call.name == INVALID_TOOL:
        return f"Error: {call.args.get('msg', 'invalid tool call')}"
    if call.name != TOOL_NAME:
        return f"Unknown tool {call.name}"
    if "answer" not in call.args:
        return "`answer` not found in parsed args"
    answer = str(call.args["answer"])
    solution = answer if answer.startswith("#### ") else f"#### {answer}"
    reward = gsm8k.compute_score(solution, ground_truth, method="flexible")
    return f"Current parsed answer={answer!r} reward={reward}"


class AsyncToolGsm8kAgent(AsyncRAgent):
    """Generate, run tool calls, generate again (see the module docstring)."""

    def __init__(self, proxy, tokenizer, config: RToolGsm8kConfig, rollout_config=None):
        super().__init__(proxy, tokenizer, config, rollout_config)
        self.system_prompt = toolcall_system_prompt(TOOLS)

    async def rollout(self, gen_item) -> AsyncOutput:
        cfg: RToolGsm8kConfig = self.config
        idx = self.sample_index(gen_item)
        raw = gen_item.non_tensor_batch["raw_prompt"]
        tools_kwargs = gen_item.non_tensor_batch.get("tools_kwargs") or {}
        try:
            ground_truth = tools_kwargs[TOOL_NAME]["create_kwargs"]["ground_truth"]
        except (KeyError, TypeError):
            raise KeyError(
                f"row {idx}: tools_kwargs.{TOOL_NAME}.create_kwargs.ground_truth is missing "
                "(preprocess the data with examples/data_preprocess/gsm8k_multiturn_w_tools.py)"
            ) from None
        messages = merge_system_prompt([dict(m) for m in raw], self.system_prompt)
        params = {
            **self.sampling_params(gen_item.meta_info),
            "max_completion_tokens": cfg.max_generation_per_turn,
            "stop": ["</tool_call>"],
        }
        session = f"tool-{idx}"
        timing = {"mt_async_gen": 0.0}
        t0 = time.perf_counter()
        messages.append(msg((await self.proxy.chat(messages, request_id=session, **params)).choices[0]))
        timing["mt_async_gen"] += time.perf_counter() - t0
        tool_calls = invalid_calls = 0
        while tool_calls < cfg.max_turn:
            call = toolcall_extract(messages[-1]["content"])
            if call is None:
                break
            invalid_calls += call.name == INVALID_TOOL
            messages.append({"role": "tool", "content": calc_gsm8k_reward(call, ground_truth)})
            tool_calls += 1
            t0 = time.perf_counter()
            messages.append(msg((await self.proxy.chat(messages, request_id=session, **params)).choices[0]))
            timing["mt_async_gen"] += time.perf_counter() - t0
        return AsyncOutput(
            [messages],
            sample_index=[idx],
            final_mask=[True],
            timing_raw=timing,
            metrics={"workflow/tool_call": tool_calls, "workflow/invalid_tool_call": invalid_calls},
        )


REGISTER = RRegister(config_cls=RToolGsm8kConfig, dataset_cls=ToolGsm8kDataset, agent_cls=AsyncToolGsm8kAgent)
