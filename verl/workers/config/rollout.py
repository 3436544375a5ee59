"""The rollout (generation engine) section ``actor_rollout_ref.rollout``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from verl.workers.config.base import BaseConfig, Checks

__all__ = [
    "ValKwargsConfig",
    "RolloutConfig",
    "ROLLOUT_NAMES",
    "ROLLOUT_MODES",
    "resolve_engine_stream",
    "resolve_engine_reserved_sms",
    "engine_sms_not_applicable",
]

# Rollout engines (verl.workers.rollout.base.get_rollout_engine).
ROLLOUT_NAMES = ("vllm", "hf")
ROLLOUT_MODES = ("sync", "async")
# CUDA streams of the vLLM engine thread (verl/workers/rollout/engine_stream.py).
ENGINE_STREAMS = ("shared", "high_priority")
# Where the engine runs (verl/workers/rollout/child_process.py).
ENGINE_PROCESSES = ("worker", "child")


def resolve_engine_stream(value: Optional[str], rollout_overlap: bool, uses_vllm_on_gpu: bool) -> str:
    """``rollout.engine_stream`` as the workers get it: a value given stands; null is ``high_priority`` where
    generation runs beside training in one process (``trainer.rollout_overlap`` with vLLM on a GPU; one H200, 1.5B
    one-step-off step 43-44 s against 45-46 s on the shared stream), else ``shared`` (nothing runs beside it)."""
    if value is not None:
        return value
    return "high_priority" if rollout_overlap and uses_vllm_on_gpu else "shared"


def engine_sms_not_applicable(rollout_overlap: bool, uses_vllm_on_gpu: bool, engine_process: str) -> Optional[str]:
    """Why SMs cannot be kept for the engine (``rollout.engine_reserved_sms``, ``rollout.balance_reserved_sms``),
    None when they can: that needs an engine running beside training in the training process's CUDA context, i.e.
    ``trainer.rollout_overlap``, vLLM on a GPU and ``engine_process=worker`` (kernels of another process, the
    ``child`` engine, do not share the SMs with this one's: the GPU time-slices between processes)."""
    if not rollout_overlap:
        return "trainer.rollout_overlap is off (no generation runs beside training)"
    if not uses_vllm_on_gpu:
        return "it applies to vLLM on CUDA"
    if engine_process != "worker":
        return f"rollout.engine_process={engine_process} (the engine's process does not share the training SMs)"
    return None


def resolve_engine_reserved_sms(
    value: int, rollout_overlap: bool, uses_vllm_on_gpu: bool, engine_process: str
) -> tuple[int, Optional[str]]:
    """``rollout.engine_reserved_sms`` as the workers get it, and why it was set to 0 (None when it stands; see
    :func:`engine_sms_not_applicable`)."""
    if value <= 0:
        return value, None
    why_not = engine_sms_not_applicable(rollout_overlap, uses_vllm_on_gpu, engine_process)
    return (value, None) if why_not is None else (0, why_not)


def _check_sampling(c: Checks) -> None:
    c.number("temperature", lambda v: v >= 0, ">= 0")
    c.number("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
    c.integer("top_k", 1, also=(-1,))
    c.integer("n", 1)


@dataclass
class ValKwargsConfig(BaseConfig):
    """``actor_rollout_ref.rollout.val_kwargs``: sampling of validation rollouts."""

    SECTION = "actor_rollout_ref.rollout.val_kwargs"

    # Top-k for validation; -1 = off.
    top_k: int = -1
    # Top-p for validation.
    top_p: float = 1.0
    # Temperature for validation (0 = greedy).
    temperature: float = 0.0
    # Rollouts per validation prompt.
    n: int = 1
    # Sample during validation (False = greedy).
    do_sample: bool = False

    def check(self, c: Checks) -> None:
        _check_sampling(c)


@dataclass
class RolloutConfig(BaseConfig):
    """``actor_rollout_ref.rollout``; null log-prob keys follow the actor's (the YAML interpolates them)."""

    SECTION = "actor_rollout_ref.rollout"

    # Engine: vllm | hf (plain transformers engine for CPU and tests).
    name: str = "vllm"
    # sync: the sync generation manager drives the engine; async: agents as coroutines (server mode).
    mode: str = "sync"
    # Async chat scheduler class; null in sync mode.
    chat_scheduler: Optional[str] = None
    # Sampling temperature for training rollouts.
    temperature: float = 1.0
    # Top-k for training rollouts; -1 = off.
    top_k: int = -1
    # Top-p for training rollouts; 1 = off.
    top_p: float = 1.0
    # FIRE sampling (upstream option; not implemented, must stay False).
    use_fire_sampling: bool = False
    # Prompt length used to size the engine; null = follows data.max_prompt_length.
    prompt_length: Optional[int] = None
    # Response length used to size the engine; null = follows data.max_response_length.
    response_length: Optional[int] = None
    # Engine dtype; should match the training dtype.
    dtype: str = "bfloat16"
    # Fraction of GPU memory vLLM may use (weights + KV cache).
    gpu_memory_utilization: float = 0.5
    # Keep generating after EOS.
    ignore_eos: bool = False
    # Disable CUDA graphs (and vLLM's torch.compile); None = False on a GPU, True on CPU.
    enforce_eager: Optional[bool] = None
    # Free the rollout's GPU memory while training (vLLM sleep).
    free_cache_engine: bool = True
    # vLLM sleep level: 2 drops weights and KV cache; 1 backs the weights up to host memory.
    sleep_level: int = 2
    # How vLLM initialises weights before the first sync.
    load_format: str = "dummy_dtensor"
    # vLLM tensor parallel size: groups of this many consecutive ranks share one engine.
    tensor_model_parallel_size: int = 2
    # vLLM token budget per scheduler step.
    max_num_batched_tokens: int = 8192
    # vLLM: capture CUDA graphs for steps of up to this many tokens; null = vLLM's default.
    cudagraph_max_tokens: Optional[int] = None
    # vLLM max context; null = prompt_length + response_length.
    max_model_len: Optional[int] = None
    # vLLM max concurrent sequences (the HF engine caps its preallocated batch at 64 on CPU, 256 on GPU).
    max_num_seqs: int = 1024
    # vLLM on CUDA: the engine thread's CUDA stream, shared | high_priority (verl/workers/rollout/engine_stream.py).
    engine_stream: Optional[str] = None
    # With trainer.rollout_overlap, vLLM on CUDA in the worker's process: SMs kept free of the training passes for the
    # engine (the trainer's kernels run in a CUDA green context of the others; verl/workers/training_sms.py); 0 = off.
    engine_reserved_sms: int = 0
    # With engine_reserved_sms kept: after each step move it by 8 SMs towards the side that finished last (the
    # training waited for the rollout ahead: more for the engine; the rollout waited for the training: fewer).
    balance_reserved_sms: bool = False
    # Python's thread switch interval in the worker process (ms); null = Python's default (5 ms).
    gil_switch_interval_ms: Optional[float] = None
    # Where the engine runs: worker (a thread of the worker's process) | child (its own process on the worker's
    # device; weights by CUDA IPC handle; verl/workers/rollout/child_process.py).
    engine_process: str = "worker"
    # HF engine: rows of its preallocated static KV cache; null = min(max_num_seqs, 64 on CPU / 256 on GPU).
    hf_max_batch_size: Optional[int] = None
    # Seed of the rollout engine's sampler (each request gets its own, derived from it); null = unseeded.
    seed: Optional[int] = 0
    # Training rollouts return the engine's log-probs of the sampled tokens (TIS, the weight-sync check metrics).
    calculate_log_probs: bool = True
    # Deprecated global micro-batch size for old log-probs (divided by the data-parallel size).
    log_prob_micro_batch_size: Optional[int] = None
    # Rows per micro-batch per GPU of the old-log-prob pass; null = actor.ppo_micro_batch_size_per_gpu.
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    # Token-budget micro-batches for the old-log-prob pass; null = follows actor.use_dynamic_bsz.
    log_prob_use_dynamic_bsz: Optional[bool] = None
    # Token budget per GPU micro-batch of the old-log-prob pass; null = follows actor.ppo_max_token_len_per_gpu.
    log_prob_max_token_len_per_gpu: Optional[int] = None
    # Hide vLLM's periodic stats logging.
    disable_log_stats: bool = True
    # vLLM chunked prefill.
    enable_chunked_prefill: bool = True
    # Sample (True) or greedy decode (False) during training.
    do_sample: bool = True
    # Rollouts per prompt (GRPO group size).
    n: int = 1
    # Extra vLLM EngineArgs fields, passed as given (null values are dropped; free-form).
    engine_kwargs: dict = field(default_factory=lambda: {"swap_space": None})
    # Async mode: chat template name or .jinja path; null = auto-detect.
    chat_template: Optional[str] = None
    # Async mode: drop samples whose agent raised instead of failing the step.
    async_drop_failed_samples: bool = False
    # Async mode: max agent coroutines in flight; null = all samples at once.
    async_max_concurrency: Optional[int] = None
    # Async mode: also serve the chat proxy as /v1/chat/completions on a loopback port.
    async_http_server: bool = False
    # Async mode over Ray worker ranks: 0 = batched calls (a turn's requests on a rank return together); k > 0 =
    # one call per request, up to k in flight per rank (free-running turns).
    async_free_running_calls: int = 0
    # Sync workflows (the memory agent): each trajectory sends its next turn as soon as its answer arrives instead of
    # waiting for the turn's longest answer (free-running; one call per request, the engine batches them).
    free_running_turns: bool = False
    # Sampling used for validation rollouts.
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)

    def check(self, c: Checks) -> None:
        c.choice("name", ROLLOUT_NAMES)
        c.choice("engine_stream", ENGINE_STREAMS, allow_none=True)
        c.integer("engine_reserved_sms", 0)
        c.number("gil_switch_interval_ms", lambda v: v > 0, "> 0", allow_none=True)
        c.choice("engine_process", ENGINE_PROCESSES)
        c.choice("mode", ROLLOUT_MODES)
        _check_sampling(c)
        for name in ("prompt_length", "response_length", "max_model_len", "cudagraph_max_tokens"):
            c.integer(name, 1, allow_none=True)
        c.integer("max_num_batched_tokens", 1)
        c.integer("max_num_seqs", 1)
        c.integer("tensor_model_parallel_size", 1)
        c.integer("async_max_concurrency", 1, allow_none=True)
        c.integer("async_free_running_calls", 0)
        c.integer("log_prob_max_token_len_per_gpu", 1, allow_none=True)
        c.number("gpu_memory_utilization", lambda v: 0 < v <= 1, "in (0, 1]")
        if "sleep_level" not in c.bad and self.sleep_level not in (1, 2):
            c.error(f"{c.key('sleep_level')} must be 1 or 2, got {self.sleep_level!r}")
        if self.free_running_turns is True and self.mode == "async":
            c.error(
                f"{c.key('free_running_turns')}=True is for sync workflows; in async mode set "
                f"{c.key('async_free_running_calls')} (requests in flight per rank) instead"
            )
        tp = self.tensor_model_parallel_size
        if self.engine_process == "child" and self.name == "vllm" and isinstance(tp, int) and tp > 1:
            c.error(
                f"{c.key('engine_process')}=child runs one engine per worker in a process of its own: it cannot be "
                f"tensor parallel across ranks ({c.key('tensor_model_parallel_size')}={tp}); set it to 1 or "
                f"{c.key('engine_process')}=worker"
            )
        if self.use_fire_sampling is True:
            c.error(f"{c.key('use_fire_sampling')}=True is not implemented; set it to False")
        if c.bad & {"cudagraph_max_tokens", "max_num_batched_tokens", "max_model_len"}:
            return
        graphs, budget = self.cudagraph_max_tokens, self.max_num_batched_tokens
        if graphs is not None and graphs >= 1 and graphs > budget:
            c.error(
                f"{c.key('cudagraph_max_tokens')} ({graphs}) must be <= {c.key('max_num_batched_tokens')} ({budget})"
            )
        max_len = self.engine_max_len
        if self.name == "vllm" and not self.enable_chunked_prefill and max_len is not None and budget < max_len:
            c.error(
                f"{c.key('max_num_batched_tokens')} ({budget}) must be >= the max model length ({max_len}) when "
                f"{c.key('enable_chunked_prefill')} is False"
            )

    @property
    def engine_max_len(self) -> Optional[int]:
        """The engine's context: ``max_model_len``, else ``prompt_length + response_length`` (None if unknown)."""
        if self.max_model_len:
            return int(self.max_model_len)
        if isinstance(self.prompt_length, int) and isinstance(self.response_length, int):
            return self.prompt_length + self.response_length
        return None

    def sampling(self, validate: bool = False) -> dict:
        """The request sampling of a training (or validation) rollout: temperature, top_p, top_k, greedy."""
        src = self.val_kwargs if validate else self
        return {
            "temperature": float(src.temperature),
            "top_p": float(src.top_p),
            "top_k": int(src.top_k),
            "greedy": not bool(src.do_sample),
        }
