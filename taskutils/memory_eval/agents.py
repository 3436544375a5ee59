"""Evaluation-time agents: the MemAgent memory loop and the direct long-context baseline.

Methods (the ``--api`` choices of the original harness, docs/spec.md#evaluation-harness):

* ``recurrent``: memory agent; final prompt asks for "Therefore, the answer is ..." (docs/spec.md#prompts);
* ``recurrent-boxed``: memory agent; final prompt asks for ``\\boxed{}`` (the training prompt);
* ``openai``: the whole document in one prompt, middle-truncated to ``max_input_tokens``;
* ``boxed``: like ``openai`` but asking for ``\\boxed{}``.

Each agent talks to an OpenAI-compatible server through :func:`client.chat_completion` (official
``openai`` client, retries with backoff). The memory agent walks the document lazily
(:func:`chunking.iter_chunks`), so its host memory does not grow with the document length.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import openai

from recurrent.prompts import NO_MEMORY, render_final_prompt, render_template, render_update_prompt
from taskutils.memory_eval.chunking import DEFAULT_CHARS_PER_TOKEN, TokenSpanner, iter_chunks, middle_truncate
from taskutils.memory_eval.client import RequestStats, RetryPolicy, chat_completion
from verl.utils.reward_score.lenient import extract_solution

__all__ = [
    "AgentConfig",
    "AgentOutput",
    "DIRECT_TEMPLATE_ANSWER_IS",
    "DIRECT_TEMPLATE_BOXED",
    "DirectAgent",
    "MemoryAgent",
    "METHODS",
    "make_agent",
]

METHODS = ("recurrent", "recurrent-boxed", "openai", "boxed")

DIRECT_TEMPLATE_ANSWER_IS = (
    "Please read the following text and answer the question below.\n\n<text>\n{chunk}\n</text>\n\n{prompt}\n\n"
    'Format your response as follows: "Therefore, the answer is (insert answer here)".'
)
"""Direct long-context baseline prompt (docs/spec.md#prompts; ``$DOC$`` -> ``{chunk}``, ``$Q$`` -> ``{prompt}``)."""

DIRECT_TEMPLATE_BOXED = (
    "Please read the following text and answer the question below.\n\n<text>\n{chunk}\n</text>\n\n{prompt}\n\n"
    "Put the answer in \\boxed{}."
)
"""Boxed variant of the direct baseline prompt."""


@dataclass
class AgentConfig:
    """Sampling and budget settings (defaults = the paper's evaluation, docs/spec.md#evaluation-harness)."""

    chunk_tokens: int = 5000
    max_memory_tokens: int = 1024
    max_final_tokens: int = 1024
    max_context_tokens: int | None = None  # memory agent: centre-truncate longer documents (None = never)
    max_input_tokens: int = 120_000  # direct baseline: middle truncation of the document
    max_output_tokens: int = 10_000  # direct baseline
    temperature: float = 0.7
    top_p: float = 0.95
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
    extra_body: dict[str, Any] | None = None  # passed to the server (e.g. {"ignore_eos": True} for vLLM)

    def sampling(self, max_tokens: int) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": max_tokens}
        if self.extra_body:
            kwargs["extra_body"] = dict(self.extra_body)
        return kwargs


@dataclass
class AgentOutput:
    """Result of one item: the raw final response and bookkeeping."""

    response: str
    memory: str | None = None
    num_chunks: int = 0
    stats: RequestStats = field(default_factory=RequestStats)
    elapsed_s: float = 0.0
    truncated_from_tokens: int | None = None
    chunk_seconds: list[float] = field(default_factory=list)


# on_step(kind, index, chunk_text, memory_text): kind is "chunk" or "final"; may be sync or async.
StepCallback = Callable[[str, int, str, str], Any]


def _strip_think(text: str) -> str:
    solution, _ = extract_solution(text, force_think=False)
    return (solution if solution is not None else text).strip()


async def _maybe_await(value: Any) -> None:
    if inspect.isawaitable(value):
        await value


class MemoryAgent:
    """The MemAgent loop: memory <- model(question, memory, chunk) per chunk, then a final answer."""

    def __init__(
        self,
        client: openai.AsyncOpenAI,
        model: str,
        config: AgentConfig | None = None,
        tokenizer: TokenSpanner | None = None,
        final_style: str = "answer_is",
        retry: RetryPolicy | None = None,
    ) -> None:
        self.client = client
        self.model = model
        self.config = config or AgentConfig()
        self.tokenizer = tokenizer
        self.final_style = final_style
        self.retry = retry or RetryPolicy()

    async def run(
        self,
        question: str,
        context: str,
        on_step: StepCallback | None = None,
        stats: RequestStats | None = None,
    ) -> AgentOutput:
        """Read ``context`` chunk by chunk, carrying the memory, and answer ``question``.

        ``on_step(kind, index, chunk, memory_or_answer)`` is called after every turn (sync or
        async); ``stats`` (optional) collects request/retry counts even when the run fails.

        Raises:
            client.RequestFailed: if a turn fails for good (the item is then recorded as failed).
        """
        cfg = self.config
        out = AgentOutput(response="", stats=stats if stats is not None else RequestStats())
        start = time.perf_counter()
        context = context.strip()
        if cfg.max_context_tokens is not None:
            context, before, after = middle_truncate(
                context, cfg.max_context_tokens, self.tokenizer, cfg.chars_per_token
            )
            out.truncated_from_tokens = before if after < before else None
        memory = NO_MEMORY
        for index, chunk in enumerate(iter_chunks(context, cfg.chunk_tokens, self.tokenizer, cfg.chars_per_token)):
            t0 = time.perf_counter()
            message = render_update_prompt(question, memory, chunk)
            content, _ = await chat_completion(
                self.client,
                self.model,
                [{"role": "user", "content": message}],
                self.retry,
                out.stats,
                **cfg.sampling(cfg.max_memory_tokens),
            )
            memory = _strip_think(content) or NO_MEMORY
            out.num_chunks = index + 1
            out.chunk_seconds.append(time.perf_counter() - t0)
            if on_step is not None:
                await _maybe_await(on_step("chunk", index, chunk, memory))
        message = render_final_prompt(question, memory, style=self.final_style)
        content, _ = await chat_completion(
            self.client,
            self.model,
            [{"role": "user", "content": message}],
            self.retry,
            out.stats,
            **cfg.sampling(cfg.max_final_tokens),
        )
        out.response, out.memory = content, memory
        out.elapsed_s = time.perf_counter() - start
        if on_step is not None:
            await _maybe_await(on_step("final", out.num_chunks, "", content))
        return out


class DirectAgent:
    """Long-context baseline: the (middle-truncated) document and the question in one prompt."""

    def __init__(
        self,
        client: openai.AsyncOpenAI,
        model: str,
        config: AgentConfig | None = None,
        tokenizer: TokenSpanner | None = None,
        style: str = "answer_is",
        retry: RetryPolicy | None = None,
    ) -> None:
        self.client = client
        self.model = model
        self.config = config or AgentConfig()
        self.tokenizer = tokenizer
        self.template = DIRECT_TEMPLATE_BOXED if style == "boxed" else DIRECT_TEMPLATE_ANSWER_IS
        self.retry = retry or RetryPolicy()

    async def run(
        self,
        question: str,
        context: str,
        on_step: StepCallback | None = None,
        stats: RequestStats | None = None,
    ) -> AgentOutput:
        """Answer ``question`` from the whole (middle-truncated) ``context`` in one request."""
        cfg = self.config
        out = AgentOutput(response="", stats=stats if stats is not None else RequestStats())
        start = time.perf_counter()
        document, before, after = middle_truncate(context, cfg.max_input_tokens, self.tokenizer, cfg.chars_per_token)
        out.truncated_from_tokens = before if after < before else None
        message = render_template(self.template, prompt=question, chunk=document)
        out.response, _ = await chat_completion(
            self.client,
            self.model,
            [{"role": "user", "content": message}],
            self.retry,
            out.stats,
            **cfg.sampling(cfg.max_output_tokens),
        )
        out.elapsed_s = time.perf_counter() - start
        if on_step is not None:
            await _maybe_await(on_step("final", 0, "", out.response))
        return out


def make_agent(
    method: str,
    client: openai.AsyncOpenAI,
    model: str,
    config: AgentConfig | None = None,
    tokenizer: TokenSpanner | None = None,
    retry: RetryPolicy | None = None,
) -> MemoryAgent | DirectAgent:
    """The agent of evaluation ``method`` (one of :data:`METHODS`).

    Raises:
        ValueError: for an unknown method.
    """
    if method == "recurrent":
        return MemoryAgent(client, model, config, tokenizer, "answer_is", retry)
    if method == "recurrent-boxed":
        return MemoryAgent(client, model, config, tokenizer, "boxed", retry)
    if method == "openai":
        return DirectAgent(client, model, config, tokenizer, "answer_is", retry)
    if method == "boxed":
        return DirectAgent(client, model, config, tokenizer, "boxed", retry)
    raise ValueError(f"unknown evaluation method {method!r}; expected one of {list(METHODS)}")
