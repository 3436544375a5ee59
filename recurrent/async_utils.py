"""Async mode's chat client: OpenAI-style ``chat`` over the rollout engines, plus the agent interface.

:class:`ChatCompletionProxy` is what an async agent talks to::

    completion = await proxy.chat(messages, request_id="sample-7", max_completion_tokens=256)
    messages.append(msg(completion.choices[0]))

For each call it renders the messages with the generation-marked chat template (so the prompt is
token-for-token the prefix the trainer will use), picks a replica (least in-flight requests;
requests sharing a ``request_id`` stick to one replica so multi-turn prompts hit its prefix
cache), calls ``engine.generate`` and decodes. The sampled token ids and log-probs are kept in a
side table keyed by the choice's ``record_id`` (also returned on the choice, as are ``token_ids``
and vLLM's ``stop_reason``), so the generation manager trains on the engine's own tokens.

All proxy work runs on the proxy's own event loop thread; ``chat`` may be awaited from any loop.
The loopback HTTP endpoint (:mod:`recurrent.chat_server`) serves the same proxy.

Agents subclass :class:`AsyncRAgent` and return one :class:`AsyncOutput` per sample.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
import uuid
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from recurrent.chat_template import ChatTemplate, EngineTurn, load_chat_template, tokenize_conversation
from recurrent.replicas import BatchingReplica, EngineReplica, Replica, Router, replicas_from
from verl.workers.config.rollout import RolloutConfig
from verl.workers.rollout.base import SamplingParams, _LoopThread

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncOutput",
    "AsyncRAgent",
    "BatchingReplica",
    "ChatCompletionProxy",
    "EngineReplica",
    "Replica",
    "msg",
    "replicas_from",
    "run_coroutine_in_chat_scheduler_loop",
    "sampling_from_openai",
]

# OpenAI request fields that are accepted and ignored (they do not change sampling here).
_IGNORED_KEYS = {
    "user",
    "tool_choice",
    "parallel_tool_calls",
    "metadata",
    "store",
    "service_tier",
    "top_logprobs",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "extra_headers",
}


def sampling_from_openai(
    kwargs: dict[str, Any], default_max_tokens: int, engine_log_probs: bool = True
) -> tuple[SamplingParams, bool]:
    """Map OpenAI chat-completion sampling fields to :class:`SamplingParams`; also return whether the
    caller asked for ``logprobs``. The engine is asked for the sampled tokens' log-probs when the caller asked or
    ``engine_log_probs`` (the trainer's records). Unsupported values raise ``ValueError`` naming the field."""
    kw = {k: v for k, v in kwargs.items() if v is not None and k not in _IGNORED_KEYS}
    if kw.pop("stream", False):
        raise ValueError("stream=True is not supported; request a complete response")
    for key, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("min_p", 0), ("repetition_penalty", 1)):
        if key in kw and float(kw.pop(key)) != neutral:
            raise ValueError(f"{key} is not supported by the rollout engines (only {neutral})")
    n = int(kw.pop("n", 1))
    best_of = kw.pop("best_of", None)
    if best_of is not None and int(best_of) != n:
        raise ValueError(f"best_of={best_of} is not supported (only best_of == n)")
    fmt = kw.pop("response_format", None)
    if fmt is not None and (fmt.get("type") if isinstance(fmt, dict) else fmt) != "text":
        raise ValueError(f"response_format={fmt!r} is not supported (only text)")
    max_tokens = kw.pop("max_completion_tokens", None)
    legacy = kw.pop("max_tokens", None)
    max_tokens = int(max_tokens if max_tokens is not None else legacy if legacy is not None else default_max_tokens)
    want_logprobs = bool(kw.pop("logprobs", False))
    stop = kw.pop("stop", None)
    params = {
        "n": n,
        "temperature": float(kw.pop("temperature", 1.0)),
        "top_p": float(kw.pop("top_p", 1.0)),
        "top_k": int(kw.pop("top_k", -1)),
        "max_tokens": max_tokens,
        "stop": [stop] if isinstance(stop, str) else (list(stop) if stop else None),
        "stop_token_ids": kw.pop("stop_token_ids", None),
        "seed": kw.pop("seed", None),
        "logprobs": engine_log_probs or want_logprobs,
    }
    if kw:
        raise ValueError(f"unsupported chat completion field(s): {sorted(kw)}")
    return SamplingParams(**params), want_logprobs


def msg(choice: Any) -> dict[str, Any]:
    """An OpenAI ``Choice`` as the assistant message to append to a conversation.

    ``content`` gets the matched stop string re-appended (vLLM's ``stop_reason`` when it is a str;
    e.g. ``</tool_call>``, which the API strips); ``finished`` is False when the turn was cut by
    the token limit (the chat template then gives it no end-of-turn token); ``record_id`` links the
    message to the engine tokens kept by the proxy.
    """
    content = choice.message.content or ""
    stop_reason = getattr(choice, "stop_reason", None)
    if isinstance(stop_reason, str):
        content += stop_reason
    out = {"role": "assistant", "content": content, "finished": choice.finish_reason == "stop"}
    record_id = getattr(choice, "record_id", None)
    if record_id:
        out["record_id"] = record_id
    return out


TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>")
"""End-of-turn markers of common chat templates, stripped from a completion that stops on one."""


def turn_end_token_ids(tokenizer: Any) -> set[int]:
    """Ids that end an assistant turn: the tokenizer's special tokens, its added special tokens, and
    the common end-of-turn markers present in its vocabulary. (Some converted tokenizers do not
    list ``<|im_end|>`` as special although the model stops on it; seen with a GGUF-converted
    SmolLM2 under transformers 5.17, whose completions then kept a literal ``<|im_end|>``.)"""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids.update(int(vocab[t]) for t in TURN_END_TOKENS if t in vocab)
    return ids


class ChatCompletionProxy:
    """OpenAI-style chat over one or more rollout replicas (see the module docstring).

    Args:
        rollout: engine(s), replicas, a worker group or the trainer's ``RolloutClient``
            (:func:`replicas_from`).
        tokenizer: the model's tokenizer (not modified).
        chat_template: template name/path; None picks one for the tokenizer.
        model_name: the id served as ``model``.
        default_max_tokens: used when a request gives neither ``max_completion_tokens`` nor ``max_tokens``.
        eos_token_ids: ids that end a turn (stripped from ``content``); default: the replicas' and
            the tokenizer's EOS ids.
        free_running_calls: for the ranks of a Ray worker group: 0 = batched calls, k > 0 = one call per request,
            up to k in flight per rank (:func:`recurrent.replicas.ray_rank_replicas`).
        engine_log_probs: ask the engine for every sampled token's log-prob (recorded for training:
            ``rollout.calculate_log_probs``); False: only for requests that ask for ``logprobs``.
    """

    def __init__(
        self,
        rollout: Any,
        tokenizer: Any,
        chat_template: str | ChatTemplate | None = None,
        model_name: str = "model",
        *,
        default_max_tokens: int = 1024,
        max_sticky_sessions: int = 10_000,
        max_records: int = 200_000,
        tokenize_threads: int = 4,
        eos_token_ids: Sequence[int] | None = None,
        free_running_calls: int = 0,
        engine_log_probs: bool = True,
    ):
        self.replicas: list[Replica] = replicas_from(rollout, free_running_calls)
        self.engine_log_probs = bool(engine_log_probs)
        if not self.replicas:
            raise ValueError("ChatCompletionProxy needs at least one rollout replica")
        self.tokenizer = tokenizer
        self.template = (
            chat_template if isinstance(chat_template, ChatTemplate) else load_chat_template(tokenizer, chat_template)
        )
        self.model_name = model_name
        self.default_max_tokens = int(default_max_tokens)
        eos = set(eos_token_ids or [])
        if not eos_token_ids:
            for rep in self.replicas:
                eos.update(getattr(rep, "eos_token_ids", None) or [])
            if tokenizer.eos_token_id is not None:
                eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = sorted(eos)
        self._turn_end_ids = turn_end_token_ids(tokenizer)
        self._router = Router(len(self.replicas), max_sticky_sessions)
        self._records: OrderedDict[str, EngineTurn] = OrderedDict()
        self._records_lock = threading.Lock()
        self.max_records = max_records
        self._loop_thread = _LoopThread("ChatCompletionProxy-loop")
        self.loop = self._loop_thread.loop
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, tokenize_threads), thread_name_prefix="chat-tok")
        self._awake = True
        self._wake_lock: asyncio.Lock | None = None
        self.requests_per_replica = [0] * len(self.replicas)
        # chat requests on their way to a replica (waking it, rendering and tokenising the prompt): a replica that
        # takes whole batches holds its next call until they arrive, so that a turn goes out in one call
        self._preparing = 0
        for replica in self.replicas:
            if isinstance(replica, BatchingReplica) and replica.hold is None:
                replica.hold = lambda: self._preparing > 0
        self._anonymous_calls = 0
        self.server = None  # a ChatServer when one is started for this proxy

    # ---------------------------------------------------------------- event loop helpers
    def run(self, coro: Any) -> Any:
        """Run ``coro`` on the proxy loop and block until it finishes (call from outside that loop)."""
        return self._loop_thread.run(coro)

    async def _on_loop(self, coro: Any) -> Any:
        if asyncio.get_running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def in_thread(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run CPU work (tokenisation) in the proxy's thread pool without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    # ---------------------------------------------------------------- engines
    async def wake_up(self) -> None:
        """Wake every replica (load weights / KV cache) unless already awake."""
        await self._on_loop(self._set_awake(True))

    async def sleep(self) -> None:
        """Put every replica to sleep (free accelerator memory); the next ``chat`` wakes them."""
        await self._on_loop(self._set_awake(False))

    async def _set_awake(self, awake: bool) -> None:
        if self._wake_lock is None:
            self._wake_lock = asyncio.Lock()
        async with self._wake_lock:
            if self._awake == awake:
                return
            t0 = time.perf_counter()
            await asyncio.gather(*[(r.wake_up() if awake else r.sleep()) for r in self.replicas])
            self._awake = awake
            logger.debug(
                "ChatCompletionProxy: replicas %s in %.2fs", "woke" if awake else "slept", time.perf_counter() - t0
            )

    async def reset_sessions(self) -> None:
        """Forget sticky sessions and their turn counters (the manager calls this per batch: after a
        weight update no prefix cache survives, and session ids may repeat from batch to batch)."""

        async def _clear() -> None:
            self._router.sessions.clear()

        await self._on_loop(_clear())

    # ---------------------------------------------------------------- records (engine tokens)
    def _store(self, record_id: str, turn: EngineTurn) -> None:
        with self._records_lock:
            self._records[record_id] = turn
            while len(self._records) > self.max_records:
                self._records.popitem(last=False)

    def record(self, message: dict[str, Any]) -> EngineTurn | None:
        """The engine turn behind an assistant message (by its ``record_id``), if still kept."""
        rid = message.get("record_id") if isinstance(message, dict) else None
        if not rid:
            return None
        with self._records_lock:
            return self._records.get(rid)

    def forget(self, conversations: Sequence[Sequence[dict[str, Any]]]) -> None:
        """Drop the records of these conversations' messages (after they were tokenised)."""
        with self._records_lock:
            for conv in conversations:
                for m in conv:
                    if isinstance(m, dict) and m.get("record_id"):
                        self._records.pop(m["record_id"], None)

    @property
    def num_records(self) -> int:
        return len(self._records)

    def tokenize(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = False, tools: list[dict] | None = None
    ):
        """:func:`recurrent.chat_template.tokenize_conversation` with this proxy's template and records."""
        return tokenize_conversation(
            self.tokenizer, self.template, messages, add_generation_prompt, tools, lookup=self.record
        )

    # ---------------------------------------------------------------- chat
    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        request_id: str | None = None,
        model: str | None = None,
        tools: list[dict] | None = None,
        **sampling: Any,
    ):
        """One chat completion (an ``openai.types.chat.ChatCompletion``); see the module docstring.

        ``request_id`` keys sticky routing (and per-turn seeds when ``seed`` is given). Raises
        ``ValueError`` for bad requests and whatever the engine raises.
        """
        return await self._on_loop(self._chat(messages, request_id, model, tools, sampling))

    async def get_chat_completions(self, model: str | None = None, **openai_kwargs: Any):
        """The original MemAgent API: ``(ChatCompletion, None)`` or ``(None, exception)``.

        ``extra_headers={"x-request-id": ...}`` (optionally prefixed ``chatcmpl-``) selects the session.
        """
        try:
            headers = openai_kwargs.pop("extra_headers", None) or {}
            rid = headers.get("x-request-id")
            if rid and rid.startswith("chatcmpl-"):
                rid = rid[len("chatcmpl-") :]
            messages = openai_kwargs.pop("messages")
            return await self.chat(messages, request_id=rid, model=model, **openai_kwargs), None
        except Exception as exc:  # noqa: BLE001 - returned, as in the original API
            return None, exc

    async def _chat(self, messages, request_id, model, tools, sampling):
        from openai.types.chat import ChatCompletion

        if model is not None and model != self.model_name:
            raise LookupError(f"model {model!r} is not served here (available: {self.model_name!r})")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        params, want_logprobs = sampling_from_openai(sampling, self.default_max_tokens, self.engine_log_probs)
        self._preparing += 1
        try:
            if not self._awake:
                await self._set_awake(True)
            prompt = await self.in_thread(self.tokenize, messages, True, tools)
        finally:
            self._preparing -= 1
        replica, turn = self._router.acquire(request_id)
        if params.seed is not None:  # distinct, reproducible seeds per session turn (per call without an id)
            if request_id is not None:
                seed = int(params.seed) + zlib.crc32(request_id.encode()) + 7919 * turn
            else:
                self._anonymous_calls += 1
                seed = int(params.seed) + 104729 * self._anonymous_calls
            params.seed = seed % (2**31 - 1)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.requests_per_replica[replica] += 1
        try:
            outputs = await self.replicas[replica].generate(prompt.ids, params, completion_id)
        finally:
            self._router.release(replica)
        choices = [
            self._choice(i, o, prompt.ids, params, completion_id, want_logprobs, prompt_text=prompt.text)
            for i, o in enumerate(outputs)
        ]
        usage = {
            "prompt_tokens": len(prompt.ids),
            "completion_tokens": sum(len(o.token_ids) for o in outputs),
            "total_tokens": len(prompt.ids) + sum(len(o.token_ids) for o in outputs),
        }
        return ChatCompletion(
            id=completion_id,
            object="chat.completion",
            created=int(time.time()),
            model=self.model_name,
            choices=choices,
            usage=usage,
            prompt_token_ids=prompt.ids,
        )

    def _choice(
        self,
        index: int,
        out: Any,
        prompt_ids: list[int],
        params: SamplingParams,
        completion_id: str,
        want_logprobs: bool,
        prompt_text: str | None = None,
    ):
        from openai.types.chat import ChatCompletionMessage, ChatCompletionTokenLogprob
        from openai.types.chat.chat_completion import Choice, ChoiceLogprobs

        tokens = list(out.token_ids)
        content_len = len(tokens)
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        visible, stop_text = text, None
        hits = (
            [(text.find(s), s) for s in (params.stop or []) if s and s in text] if out.finish_reason == "stop" else []
        )
        if hits:  # stopped on a stop string: content is everything up to it (vLLM's stop_reason)
            pos, stop_text = min(hits)
            visible = text[:pos]
        elif out.finish_reason == "stop" and tokens:
            ends = set(self.eos_token_ids) | set(params.stop_token_ids or [])
            if tokens[-1] in ends or tokens[-1] in self._turn_end_ids:  # the end token is not part of the content
                content_len -= 1
                text = visible = self.tokenizer.decode(tokens[:content_len], skip_special_tokens=False)
        record_id = f"{completion_id}-{index}"
        self._store(
            record_id,
            EngineTurn(
                prompt_ids=prompt_ids,
                token_ids=tokens,
                log_probs=out.log_probs,
                finish_reason=out.finish_reason,
                text=text,
                content_len=content_len,
                stop_text=stop_text,
                visible=visible,
                prompt_text=prompt_text,
            ),
        )
        logprobs = None
        if want_logprobs and out.log_probs is not None:
            logprobs = ChoiceLogprobs(
                content=[
                    ChatCompletionTokenLogprob(
                        token=self.tokenizer.decode([t]), logprob=float(lp), bytes=None, top_logprobs=[]
                    )
                    for t, lp in zip(tokens, out.log_probs)
                ]
            )
        return Choice(
            index=index,
            finish_reason=out.finish_reason,
            logprobs=logprobs,
            message=ChatCompletionMessage(role="assistant", content=visible),
            stop_reason=stop_text,
            token_ids=tokens,
            record_id=record_id,
        )

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Stop the HTTP server (if any), the thread pool and the proxy loop (engines stay up)."""
        if self.server is not None:
            self.server.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._loop_thread.stop()

    @classmethod
    def from_rollout(cls, rollout: Any, tokenizer: Any, **kwargs: Any) -> ChatCompletionProxy:
        """Same as the constructor (kept for readability at call sites)."""
        return cls(rollout, tokenizer, **kwargs)


def run_coroutine_in_chat_scheduler_loop(proxy: ChatCompletionProxy, coro: Any) -> Any:
    """The original helper's name: run ``coro`` on the proxy's loop and wait for its result."""
    return proxy.run(coro)


# ==================================================================================== agent interface
class AsyncOutput:
    """What an async agent returns for one sample.

    ``conversations``: lists of ``{"role", "content", ...}`` messages, each trained as one sequence;
    ``sample_index`` (long, one per conversation, the trajectory row); ``final_mask`` (bool, True for
    the trajectory's answer conversation; exactly one); ``timing_raw`` and ``metrics`` (per-sample
    numbers, reduced over the batch by the manager; ``workflow/num_conv`` is added if missing).
    """

    def __init__(
        self,
        conversations: list[list[dict[str, Any]]],
        sample_index: Any,
        final_mask: Any,
        timing_raw: dict[str, float] | None = None,
        metrics: dict[str, float] | None = None,
    ):
        self.conversations = conversations
        self.sample_index = torch.as_tensor(sample_index, dtype=torch.long).reshape(-1)
        self.final_mask = torch.as_tensor(final_mask, dtype=torch.bool).reshape(-1)
        self.timing_raw = dict(timing_raw or {})
        self.metrics = dict(metrics or {})
        self.metrics.setdefault("workflow/num_conv", len(conversations))
        self.batch: dict[str, Any] | None = None  # filled by the manager

    def __repr__(self) -> str:
        return (
            f"AsyncOutput({len(self.conversations)} conversations, sample_index={self.sample_index.tolist()}, "
            f"final_mask={self.final_mask.tolist()})"
        )


class AsyncRAgent(ABC):
    """An agent written as an async function of one sample (MemAgent's async mode).

    Lifecycle per batch: ``start(gen_batch, timing_raw)``; ``rollout(item)`` for every sample
    concurrently (``item.non_tensor_batch["sample_index"]`` is its row); ``end()``.
    """

    def __init__(self, proxy: ChatCompletionProxy, tokenizer: Any, config: Any, rollout_config: Any = None):
        self.proxy = proxy
        self.tokenizer = tokenizer
        self.config = config
        # ``actor_rollout_ref.rollout`` as the typed RolloutConfig (a mapping is converted; absent keys: YAML defaults)
        self.rollout_config = RolloutConfig.from_config(rollout_config if rollout_config is not None else {})

    def start(self, gen_batch: Any, timing_raw: dict) -> None:
        """Called once per batch before any rollout (optional)."""

    def end(self) -> None:
        """Called once per batch after every rollout, also after a failure (optional)."""

    @abstractmethod
    async def rollout(self, gen_item: Any) -> AsyncOutput:
        """Run the workflow for one sample (a ``DataProtoItem``) and return its conversations."""

    @staticmethod
    def sample_index(gen_item: Any) -> int:
        """The trajectory row of ``gen_item``."""
        return int(gen_item.non_tensor_batch["sample_index"])

    def sampling_params(self, meta_info: dict[str, Any]) -> dict[str, Any]:
        """OpenAI-style sampling kwargs for this batch (``max_completion_tokens`` is the agent's job).

        The trainer's ``meta_info["sampling"]`` (temperature, top_p, top_k, greedy, seed) wins; else
        the original rules: rollout temperature/top_p, greedy when ``do_sample`` is False, and
        ``val_kwargs`` when ``validate`` is True.
        """
        sampling = meta_info.get("sampling")
        if sampling:
            greedy = bool(sampling.get("greedy", False)) or float(sampling.get("temperature", 1.0)) == 0.0
            out = {
                "n": 1,
                "temperature": 0.0 if greedy else float(sampling.get("temperature", 1.0)),
                "top_p": 1.0 if greedy else float(sampling.get("top_p", 1.0)),
            }
            if int(sampling.get("top_k", -1)) > 0 and not greedy:
                out["top_k"] = int(sampling["top_k"])
            if sampling.get("seed") is not None:
                out["seed"] = int(sampling["seed"])
            return out
        rc = self.rollout_config
        out = {"n": 1, "temperature": rc.temperature, "top_p": rc.top_p}
        if meta_info.get("do_sample", True) is False:
            out.update(top_p=1.0, temperature=0.0, n=1)
        elif meta_info.get("validate", False):
            out.update(top_p=rc.val_kwargs.top_p, temperature=rc.val_kwargs.temperature, n=1)
        return out

    @staticmethod
    def reduce_timings(timings: list[dict[str, float]]) -> dict[str, float]:
        """Per-sample timings -> batch timings: keys containing "async" (concurrent awaits) are
        averaged, the others (sequential code) summed."""
        if not timings:
            return {}
        keys = dict.fromkeys(k for t in timings for k in t)
        out = {}
        for k in keys:
            values = [float(t.get(k, 0.0)) for t in timings]
            out[k] = float(np.mean(values)) if "async" in k else float(np.sum(values))
        return out

    @staticmethod
    def reduce_metrics(metrics: list[dict[str, float]]) -> dict[str, float]:
        """Per-sample metrics -> ``{k}_mean``, ``{k}_min``, ``{k}_max`` over samples."""
        keys = dict.fromkeys(k for m in metrics for k in m)
        out = {}
        for k in keys:
            values = np.asarray([float(m[k]) for m in metrics if k in m], dtype=np.float64)
            out[f"{k}_mean"], out[f"{k}_min"], out[f"{k}_max"] = (
                float(values.mean()),
                float(values.min()),
                float(values.max()),
            )
        return out
