"""The MemAgent loop, written once: read a document chunk by chunk, overwrite the memory, answer from it.

A :class:`MemoryLoop` is the state machine of one trajectory (one training sample or one evaluation
item). Given the question and the document's chunks it emits the next request (:meth:`MemoryLoop.
next_request`: a memory-update prompt for the next chunk, then the final-answer prompt, each with its
``max_tokens``) and consumes the model's response (:meth:`MemoryLoop.take`): the response of an
update becomes the memory (an empty one falls back to :data:`~recurrent.prompts.NO_MEMORY`), the
response of the final turn is the answer. The loop never calls a model; its drivers do:

* the sync training agent (:class:`recurrent.impls.memory.MemoryAgent`) steps many loops in
  lock-step (:func:`lockstep_turn`) with :class:`TokenPrompts` (token ids spliced into the chat
  template, the context tokenised once);
* the async training agent (:class:`recurrent.impls.async_memory.AsyncMemoryAgent`) awaits each
  request over the chat proxy (:func:`run_memory_loop`) with :class:`TextPrompts`;
* the evaluation client (:class:`taskutils.memory_eval.agents.MemoryAgentClient`, used by
  ``quickstart.py`` and ``taskutils/memory_eval/run.py``) awaits each request over an
  OpenAI-compatible endpoint with ``TextPrompts(strip_think=True)``;
* the batched evaluation runner (:mod:`taskutils.memory_eval.batched`) drives many loops at once on
  an in-process engine and resumes a loop mid-document (``memory=``, ``start_chunk=``).

Prompt texts live in :mod:`recurrent.prompts`; chunking of text documents for evaluation lives in
:mod:`taskutils.memory_eval.chunking`, chunking of token ids for training in :func:`token_chunks`.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from recurrent.prompts import (
    MEMORY_UPDATE_TEMPLATE,
    NO_MEMORY,
    final_template,
    render_final_prompt,
    render_update_prompt,
)

__all__ = [
    "MemoryLoop",
    "MemoryRequest",
    "TextPrompts",
    "TokenPrompts",
    "lockstep_turn",
    "run_memory_loop",
    "strip_think",
    "token_chunks",
]

UPDATE = "update"
FINAL = "final"


@dataclass(frozen=True)
class MemoryRequest:
    """One request of a loop: what to send and how many tokens the answer may have."""

    kind: str
    """``"update"`` (memory update for one chunk) or ``"final"`` (the answer from the memory)."""
    index: int
    """Update: the chunk's index in the document; final: the number of chunks read."""
    prompt: Any
    """The user message: text (:class:`TextPrompts`) or chat-templated token ids (:class:`TokenPrompts`)."""
    max_tokens: int
    """Max new tokens of the response (memory size for an update, answer length for the final)."""
    chunk: Any = None
    """The chunk of an update (text or token ids); None for the final turn."""

    @property
    def is_final(self) -> bool:
        return self.kind == FINAL


def strip_think(text: str) -> str:
    """``text`` without a leading ``<think>...</think>`` block, stripped (the text itself if it has none)."""
    from verl.utils.reward_score.lenient import extract_solution

    solution, _ = extract_solution(text, force_think=False)
    return (solution if solution is not None else text).strip()


class TextPrompts:
    """Prompts as user-message text (:mod:`recurrent.prompts`); text responses become the memory.

    Args:
        final_style: ``"boxed"`` (training, ``\\boxed{}``) or ``"answer_is"`` ("Therefore, the answer is").
        strip_think: drop a ``<think>`` block from a memory update's response (evaluation) instead of
            keeping the response as is (training trains on what the model wrote).
    """

    no_memory = NO_MEMORY

    def __init__(self, final_style: str = "boxed", strip_think: bool = False) -> None:
        final_template(final_style)  # ValueError naming the accepted styles
        self.final_style = final_style
        self.strip_think = strip_think

    def update(self, question: str, memory: str, chunk: str) -> str:
        return render_update_prompt(question, memory, chunk)

    def final(self, question: str, memory: str) -> str:
        return render_final_prompt(question, memory, style=self.final_style)

    def memory_of(self, response: str) -> str:
        return strip_think(response) if self.strip_think else response


class TokenPrompts:
    """Prompts as chat-templated token ids: question, memory and chunk ids are spliced into the
    tokenised template without tokenising them again (the sync trainer's rollout prompts).

    Raises:
        ValueError: if the tokenizer's chat template does not render the user message.
    """

    def __init__(self, tokenizer: Any, final_style: str = "boxed") -> None:
        from recurrent.utils import TokenTemplate, chat_template_string

        chat = chat_template_string(tokenizer)
        if "{message}" not in chat:
            raise ValueError("the tokenizer's chat template did not render the user message")
        self.update_template = TokenTemplate(chat.replace("{message}", MEMORY_UPDATE_TEMPLATE), tokenizer)
        self.final_template = TokenTemplate(chat.replace("{message}", final_template(final_style)), tokenizer)
        self.no_memory = tokenizer.encode(NO_MEMORY, add_special_tokens=False)

    def update(self, question: Sequence[int], memory: Sequence[int], chunk: Sequence[int]):
        return self.update_template.format(prompt=question, memory=memory, chunk=chunk)

    def final(self, question: Sequence[int], memory: Sequence[int]):
        return self.final_template.format(prompt=question, memory=memory)

    def memory_of(self, response: Sequence[int]) -> list[int]:
        return list(response)


_END = object()


class MemoryLoop:
    """The memory agent's state machine for one trajectory.

    Args:
        question: the question (text or token ids, as ``prompts`` expects).
        chunks: the document's chunks in order (a list, or a lazy iterator: it is read one chunk per
            update, so a long document is never held whole).
        prompts: :class:`TextPrompts` or :class:`TokenPrompts` (renders requests, turns responses into memory).
        memory_tokens: max new tokens of a memory update.
        final_tokens: max new tokens of the final answer.
        max_chunks: a document with more chunks raises ``ValueError`` when the extra chunk is reached
            (None: no limit).
        memory: the memory to start from (resume); None or empty: ``prompts.no_memory``.
        start_chunk: chunks already read (resume); that many are skipped from ``chunks``.
    """

    def __init__(
        self,
        question: Any,
        chunks: Iterable[Any],
        prompts: TextPrompts | TokenPrompts,
        *,
        memory_tokens: int,
        final_tokens: int,
        max_chunks: int | None = None,
        memory: Any = None,
        start_chunk: int = 0,
    ) -> None:
        if start_chunk < 0:
            raise ValueError(f"start_chunk must be >= 0, got {start_chunk}")
        self.question = question
        self.prompts = prompts
        self.memory_tokens = memory_tokens
        self.final_tokens = final_tokens
        self.max_chunks = max_chunks
        self.memory = self._or_no_memory(memory)
        self.chunks_read = start_chunk
        self.answer: Any = None
        self.done = False
        self._chunks: Iterator[Any] = itertools.islice(iter(chunks), start_chunk, None)
        self._pending: MemoryRequest | None = None

    def _or_no_memory(self, memory: Any) -> Any:
        return self.prompts.no_memory if memory is None or len(memory) == 0 else memory

    @property
    def pending(self) -> MemoryRequest | None:
        """The request emitted by :meth:`next_request` and not yet answered (None if there is none)."""
        return self._pending

    def next_request(self) -> MemoryRequest:
        """The next request; the same one again until :meth:`take` answers it.

        Raises:
            RuntimeError: if the loop is done (its final answer was taken).
            ValueError: if the document has more than ``max_chunks`` chunks.
        """
        if self._pending is not None:
            return self._pending
        if self.done:
            raise RuntimeError("the memory loop is done: its final answer was already taken")
        chunk = next(self._chunks, _END)
        if chunk is _END:
            prompt = self.prompts.final(self.question, self.memory)
            self._pending = MemoryRequest(FINAL, self.chunks_read, prompt, self.final_tokens)
        else:
            if self.max_chunks is not None and self.chunks_read >= self.max_chunks:
                raise ValueError(
                    f"the document has more than max_chunks={self.max_chunks} chunks "
                    "(the dataset should have truncated it)"
                )
            prompt = self.prompts.update(self.question, self.memory, chunk)
            self._pending = MemoryRequest(UPDATE, self.chunks_read, prompt, self.memory_tokens, chunk)
        return self._pending

    def take(self, response: Any) -> MemoryRequest:
        """Consume the response to the pending request and return that request.

        An update's response becomes the memory (``prompts.memory_of``; empty -> ``prompts.no_memory``);
        the final response becomes :attr:`answer` and the loop is done.

        Raises:
            RuntimeError: if no request is pending.
        """
        request = self._pending
        if request is None:
            raise RuntimeError("MemoryLoop.take() without a pending request (call next_request() first)")
        if request.is_final:
            self.answer = response
            self.done = True
        else:
            self.memory = self._or_no_memory(self.prompts.memory_of(response))
            self.chunks_read += 1
        self._pending = None
        return request


def token_chunks(ids: Sequence[int], chunk_size: int, length: int | None = None) -> Iterator[Sequence[int]]:
    """Consecutive ``chunk_size``-token slices of the first ``length`` (default: all) tokens of ``ids``.

    Raises:
        ValueError: if ``chunk_size`` is not positive.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    n = len(ids) if length is None else int(length)
    for lo in range(0, n, chunk_size):
        yield ids[lo : min(lo + chunk_size, n)]


def lockstep_turn(loops: Sequence[MemoryLoop]) -> list[int]:
    """Indices of the loops in the next lock-step turn: every loop with a memory update pending, or,
    once none has one, every loop (all final answers in one turn). Loops that are done are left out."""
    live = [i for i, loop in enumerate(loops) if not loop.done]
    updates = [i for i in live if not loops[i].next_request().is_final]
    return updates or live


async def run_memory_loop(
    loop: MemoryLoop,
    send: Callable[[MemoryRequest], Awaitable[Any]],
    on_turn: Callable[[MemoryRequest, Any], Any] | None = None,
) -> Any:
    """Drive ``loop`` to its end: ``await send(request)`` answers each request; return the final answer.

    ``on_turn(request, response)`` (sync or async) is called after each response was taken (so
    ``loop.memory`` is the memory after an update).
    """
    while not loop.done:
        request = loop.next_request()
        response = await send(request)
        loop.take(response)
        if on_turn is not None:
            result = on_turn(request, response)
            if inspect.isawaitable(result):
                await result
    return loop.answer
