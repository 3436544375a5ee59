"""The rollout-engine interface: token ids in, token ids out, one coroutine per request.

Every engine (vLLM, the plain HF/torch engine) implements :class:`RolloutEngine`, so the synchronous
generation manager (many requests at once, :meth:`RolloutEngine.generate_batch`) and async agents (one
coroutine per sample, :meth:`RolloutEngine.generate`) drive the same object. Engines are picked by name
through :func:`get_rollout_engine`, which is what ``actor_rollout_ref.rollout.name=vllm|hf`` selects.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

FinishReason = Literal["stop", "length"]
T = TypeVar("T")

# verl/HF-style aliases accepted by SamplingParams.from_dict, mapped to our field names.
_KEY_ALIASES = {
    "response_length": "max_tokens",
    "max_new_tokens": "max_tokens",
}


@dataclass
class SamplingParams:
    """How to sample one request (engine independent).

    ``greedy=True`` (or ``temperature == 0``) takes the arg-max token; ``top_k=-1`` and ``top_p=1.0``
    disable those filters. ``stop_token_ids`` and ``stop`` (strings) end a sample early; the token that
    completes the stop condition is kept in the output, as is an EOS token. ``seed`` makes a request
    reproducible: sample ``i`` of ``n`` uses ``seed + i``. ``logprobs=True`` returns the log-probability
    of each sampled token under the distribution it was sampled from (after temperature and top-k/top-p;
    for greedy decoding, the temperature-1 distribution).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 1024
    stop_token_ids: list[int] | None = None
    stop: list[str] | None = None
    seed: int | None = None
    logprobs: bool = False
    greedy: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is not None:
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    @property
    def is_greedy(self) -> bool:
        """True when the arg-max token is taken (``greedy`` flag or zero temperature)."""
        return self.greedy or self.temperature == 0.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a config mapping that may use verl-style keys.

        ``do_sample=False`` means greedy; ``response_length`` and ``max_new_tokens`` mean ``max_tokens``.
        ``logprobs`` may be a bool or an int (vLLM style: any number >= 0 asks for the sampled token's
        log-prob). Unknown keys raise ``KeyError`` naming them.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        unknown: list[str] = []
        for key, value in dict(d).items():
            if key == "do_sample":
                if not value:
                    kwargs["greedy"] = True
                continue
            name = _KEY_ALIASES.get(key, key)
            if name not in fields:
                unknown.append(key)
                continue
            if name in kwargs and kwargs[name] != value:
                raise ValueError(
                    f"SamplingParams.from_dict: key {key!r}={value!r} conflicts with {name}={kwargs[name]!r}"
                )
            kwargs[name] = value
        if unknown:
            valid = sorted(fields | set(_KEY_ALIASES) | {"do_sample"})
            raise KeyError(f"SamplingParams.from_dict: unknown key(s) {sorted(unknown)}; valid keys are {valid}")
        if "logprobs" in kwargs and not isinstance(kwargs["logprobs"], bool):
            lp = kwargs["logprobs"]
            kwargs["logprobs"] = lp is not None and int(lp) >= 0
        for key in ("stop_token_ids", "stop"):
            if key in kwargs and kwargs[key] is not None:
                kwargs[key] = list(kwargs[key])
        return cls(**kwargs)


@dataclass
class GenerationOutput:
    """One generated sample: the new token ids (prompt excluded), their log-probs, and why it ended."""

    token_ids: list[int]
    log_probs: list[float] | None
    finish_reason: FinishReason


class _LoopThread:
    """An asyncio event loop running forever in a daemon thread (the engine's own loop)."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this loop and block the calling thread until it finishes."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("cannot block on the engine loop from inside the engine loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class RolloutEngine(ABC):
    """Server-style generation engine: token ids in, token ids out, async per request.

    Subclasses implement :meth:`generate` (safe to call from any event loop, concurrently) and the
    weight/memory hooks. :meth:`generate_batch` is a synchronous convenience that submits every
    prompt at once on the engine's own event loop, so the engine sees them together and batches them.
    """

    _loop_thread: _LoopThread | None = None

    @abstractmethod
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> list[GenerationOutput]:
        """Generate ``params.n`` continuations of ``prompt_ids``; returns ``n`` outputs."""

    def generate_batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[GenerationOutput]]:
        """Generate for every prompt (all submitted at once); result ``i`` belongs to ``prompts[i]``."""
        return self.generate_requests(prompts, [params] * len(prompts))

    def generate_requests(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[list[GenerationOutput]]:
        """Generate for prompt ``i`` with ``params[i]``, all submitted at once; result ``i`` belongs to
        ``prompts[i]`` (no prompts: no results, nothing submitted)."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        return self._generate_requests(prompts, params) if prompts else []

    def _generate_requests(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[list[GenerationOutput]]:
        """:meth:`generate_requests` for a non-empty batch of matching lengths: one :meth:`generate` per prompt on
        the engine's loop. Engines that queue requests themselves override it to add the whole batch in one go."""

        async def _all() -> list[list[GenerationOutput]]:
            return list(await asyncio.gather(*(self.generate(list(p), sp) for p, sp in zip(prompts, params))))

        return self.run_on_loop(_all())

    def run_on_loop(self, coro: Any) -> Any:
        """Run ``coro`` on the engine's own event loop (where concurrent :meth:`generate` calls are
        batched together) and return its result; for callers that schedule many requests themselves."""
        return self._engine_loop().run(coro)

    def submit_on_loop(self, coro: Any) -> concurrent.futures.Future:
        """Schedule ``coro`` on the engine's own event loop without waiting: its future."""
        return asyncio.run_coroutine_threadsafe(coro, self._engine_loop().loop)

    def _engine_loop(self) -> _LoopThread:
        if self._loop_thread is None:
            self._loop_thread = _LoopThread(f"{type(self).__name__}-loop")
        return self._loop_thread

    def _stop_engine_loop(self) -> None:
        if self._loop_thread is not None:
            self._loop_thread.stop()
            self._loop_thread = None

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(name, tensor)`` pairs (HF state-dict names) into the engine's model, then drop any
        prefix cache so no KV computed with the old weights is reused."""

    @abstractmethod
    def sleep(self) -> None:
        """Release accelerator memory (weights and KV cache) until :meth:`wake_up`."""

    @abstractmethod
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo :meth:`sleep`; ``tags`` (``["weights"]``, ``["kv_cache"]``) wakes one part only (engines that
        cannot split their memory wake everything on the first call)."""

    def step_counters(self) -> tuple[int, float] | None:
        """``(steps, seconds)``: the engine steps run so far and the wall seconds spent inside them (running
        totals), for telling the engine's own time from the rest of a generation; None where the engine has no
        step loop of its own to count."""
        return None

    @property
    def weights_discarded(self) -> bool:
        """True when :meth:`sleep` dropped the weights (vLLM sleep level 2) and no :meth:`update_weights` has
        refilled them since: the next wake-up must be followed by a full weight sync."""
        return False

    @abstractmethod
    def shutdown(self) -> None:
        """Stop background threads/processes; pending requests fail."""

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class FixedWeightsEngine(RolloutEngine):
    """An engine whose weights never change (test doubles, benchmark stand-ins, a fixed external model):
    the weight and memory hooks do nothing and :meth:`shutdown` stops the engine's event loop, so a
    subclass implements :meth:`generate` only."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass

    def shutdown(self) -> None:
        self._stop_engine_loop()


def _make_hf(**kwargs: Any) -> RolloutEngine:
    from verl.workers.rollout.hf_engine import HFRolloutEngine

    return HFRolloutEngine(**kwargs)


def _make_vllm(**kwargs: Any) -> RolloutEngine:
    from verl.workers.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(**kwargs)


_ENGINE_REGISTRY: dict[str, Callable[..., RolloutEngine]] = {"hf": _make_hf, "vllm": _make_vllm}


def register_rollout_engine(name: str, factory: Callable[..., RolloutEngine]) -> None:
    """Register a factory under ``name`` (for ``actor_rollout_ref.rollout.name``)."""
    if name in _ENGINE_REGISTRY:
        raise ValueError(f"rollout engine {name!r} is already registered")
    _ENGINE_REGISTRY[name] = factory


def get_rollout_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Create the engine registered as ``name`` (``vllm`` or ``hf``) with ``kwargs``."""
    try:
        factory = _ENGINE_REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown rollout engine name {name!r} (actor_rollout_ref.rollout.name); "
            f"valid names: {sorted(_ENGINE_REGISTRY)}"
        ) from None
    return factory(**kwargs)
