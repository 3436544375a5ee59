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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai

from recurrent.memory_loop import MemoryLoop, MemoryRequest, TextPrompts, run_memory_loop
from recurrent.prompts import render_template
from taskutils.memory_eval.chunking import DEFAULT_CHARS_PER_TOKEN, TokenSpanner, iter_chunks, middle_truncate
from taskutils.memory_eval.client import RequestStats, RetryPolicy, chat_completion

__all__ = [
    "AgentConfig",
    "AgentOutput",
    "DIRECT_TEMPLATE_ANSWER_IS",
    "DIRECT_TEMPLATE_BOXED",
    "DirectAgent",
    "MEMORY_METHODS",
    "METHODS",
    "MemoryAgentClient",
    "make_agent",
    "memory_chunks",
    "memory_loop",
]

METHODS = ("recurrent", "recurrent-boxed", "openai", "boxed")

MEMORY_METHODS = {"recurrent": "answer_is", "recurrent-boxed": "boxed"}
"""Memory-agent evaluation method -> final prompt style (:data:`recurrent.prompts.FINAL_STYLES`)."""

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


async def _maybe_await(value: Any) -> None:
    if inspect.isawaitable(value):
        await value


def memory_chunks(
    context: str, config: AgentConfig, tokenizer: TokenSpanner | None = None
) -> tuple[Iterator[str], int | None]:
    """The memory agent's view of a document: its chunks (lazy) and the token count it was cut from.

    The document is stripped, centre-truncated to ``config.max_context_tokens`` (first + last half,
    when set) and cut into ``config.chunk_tokens``-token chunks (:func:`~taskutils.memory_eval.chunking.
    iter_chunks`; approximate character chunks without a tokenizer). The second value is the
    document's token count when it was truncated, else None.
    """
    context = context.strip()
    truncated_from = None
    if config.max_context_tokens is not None:
        context, before, after = middle_truncate(context, config.max_context_tokens, tokenizer, config.chars_per_token)
        truncated_from = before if after < before else None
    return iter_chunks(context, config.chunk_tokens, tokenizer, config.chars_per_token), truncated_from


def memory_loop(
    question: str,
    chunks: Iterable[str],
    config: AgentConfig,
    final_style: str = "answer_is",
    memory: str | None = None,
    start_chunk: int = 0,
) -> MemoryLoop:
    """The evaluation's :class:`~recurrent.memory_loop.MemoryLoop` for one item: text prompts, the
    ``<think>`` block of a memory update dropped, ``config``'s token budgets; ``memory`` /
    ``start_chunk`` resume it mid-document."""
    return MemoryLoop(
        question,
        chunks,
        TextPrompts(final_style=final_style, strip_think=True),
        memory_tokens=config.max_memory_tokens,
        final_tokens=config.max_final_tokens,
        memory=memory,
        start_chunk=start_chunk,
    )


class MemoryAgentClient:
    """The MemAgent loop (:mod:`recurrent.memory_loop`) over an OpenAI-compatible endpoint:
    memory <- model(question, memory, chunk) per chunk, then a final answer."""

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
        chunks, out.truncated_from_tokens = memory_chunks(context, cfg, self.tokenizer)
        loop = memory_loop(question, chunks, cfg, self.final_style)
        turn_started = start

        async def send(request: MemoryRequest) -> str:
            nonlocal turn_started
            turn_started = time.perf_counter()
            messages = [{"role": "user", "content": request.prompt}]
            content, _ = await chat_completion(
                self.client, self.model, messages, self.retry, out.stats, **cfg.sampling(request.max_tokens)
            )
            return content

        async def on_turn(request: MemoryRequest, content: str) -> None:
            if request.is_final:
                out.response, out.memory = content, loop.memory
                out.elapsed_s = time.perf_counter() - start
                if on_step is not None:
                    await _maybe_await(on_step("final", loop.chunks_read, "", content))
                return
            out.num_chunks = loop.chunks_read
            out.chunk_seconds.append(time.perf_counter() - turn_started)
            if on_step is not None:
                await _maybe_await(on_step("chunk", request.index, request.chunk, loop.memory))

        await run_memory_loop(loop, send, on_turn)
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
) -> MemoryAgentClient | DirectAgent:
    """The agent of evaluation ``method`` (one of :data:`METHODS`).

    Raises:
        ValueError: for an unknown method.
    """
    if method in MEMORY_METHODS:
        return MemoryAgentClient(client, model, config, tokenizer, MEMORY_METHODS[method], retry)
    if method == "openai":
        return DirectAgent(client, model, config, tokenizer, "answer_is", retry)
    if method == "boxed":
        return DirectAgent(client, model, config, tokenizer, "boxed", retry)
    raise ValueError(f"unknown evaluation method {method!r}; expected one of {list(METHODS)}")
