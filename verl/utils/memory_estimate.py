"""Per-rank GPU and host memory of the colocated actor + ref + rollout worker, estimated from the config.

Called once at start-up by ``verl.trainer.main_ppo.run`` (``verl/utils/memory_startup.py::startup_memory_check``)
before any model loads: it reads the model's ``config.json`` (``transformers.AutoConfig``, no weights), prints a
per-rank table and, on a GPU run with ``trainer.memory_check=error``, refuses a config that cannot fit with a message
naming the knob to turn.

What each rank holds follows ``verl/workers/fsdp_workers.py`` and ``verl/utils/fsdp_utils.py`` as they are:

* **actor**: parameters loaded in float32 and sharded by FSDP2 over ``S`` ranks (``fsdp_config.fsdp_size`` when it
  divides the world size, else all ranks), bf16 compute through ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``. Per trainable parameter: 4 bytes master weight + 4 bytes gradient + 8 bytes AdamW moments
  (``exp_avg``, ``exp_avg_sq``) = 16 bytes, the mixed-precision Adam figure of the ZeRO paper (Rajbhandari et al.
  2020, arXiv 1910.02054, section 3.1: "2 + 2 + 12 = 16 bytes" with fp16 copies; here the fp32 master weight *is*
  the parameter and the bf16 copy exists only for the layer being computed), all divided by ``S``.
* **offload**: ``param_offload`` parks the parameter shards on the host between computations (``_resident`` in the
  worker) and brings them back for each computation. ``optimizer_offload`` builds ``OffloadedAdamW``
  (``verl/utils/offload_optim.py``): the Adam moments live in host buffers of exactly their size for the whole run
  and stream through the GPU one bucket at a time inside the step, so no phase holds them on the GPU; the step
  holds three buckets (one computing, one arriving, one leaving; ``offload_bucket_bytes`` or one large tensor's
  state each, by the optimizer's own bucket plan ``streamed_peak_bytes``: the embeddings' 4.1 GiB at Qwen2.5-7B).
* **optimizer step**: ``torch.optim.AdamW`` with the default foreach implementation allocates one full-size
  temporary (``torch._foreach_sqrt(exp_avg_sqs)`` in ``torch/optim/adam.py::_multi_tensor_adam``): 4 more bytes per
  trainable parameter during the step (``adam_step_temp_bytes``); torch's fused AdamW none (0: the default on a
  CUDA run, ``actor_rollout_ref.actor.optim.fused``); streamed (``OffloadedAdamW``, foreach), one bucket's worth
  (half a bucket: the ``exp_avg_sq`` half).
* **FSDP2 working set**: the bf16 all-gathered parameters of the root unit (embeddings, final norm, lm_head; kept
  for the whole forward/backward) and of two decoder layers (the one computing and the prefetched one; of every
  layer with ``fsdp_config.reshard_after_forward=False``, which keeps them gathered through the pass), plus one
  unit's unsharded gradient in bf16 and its fp32 copy for the reduce-scatter (2 + 4 bytes per parameter; for the
  root unit at the end of backward, when activations and logits are already freed, so only the excess counts).
* **activations** (bf16): following Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", arXiv 2205.05198, section 4.1) re-derived for a pre-norm SwiGLU decoder with grouped-query
  attention and fused (flash/flex) attention: per token and layer ``24 h + 6 kv + 8 i`` bytes (two RMSNorms saving
  fp32 and bf16 copies 12 h; q, rotated q/k, attention output and o_proj input 10 h + 6 kv; gate, up, silu and
  product 8 i, and the MLP input 2 h), with ``h`` hidden size, ``kv`` = KV heads x head dim, ``i`` the MLP width. With
  gradient checkpointing only a checkpointed layer's input stays (2 h per token), plus one layer recomputed in the
  backward (``one_layer``); with ``model.gradient_checkpointing_every`` N the ``c = ceil(L / N)`` layers of index
  ``% N == 0`` are checkpointed and the other ``L - c`` keep their activations: ``c x 2 h + (L - c) x one_layer +
  one_layer`` per token (N = 1: ``L x 2 h + one_layer``). With liger-kernel's fused kernels (``model.use_liger``,
  resolved as the worker resolves it) each RMSNorm saves only its bf16 input (2 h instead of 6 h) and the SwiGLU
  saves gate and up but not the SiLU output (6 i instead of 8 i): ``16 h + 6 kv + 6 i``. One H200, Qwen2.5-1.5B,
  16K-token micro-batches without checkpointing: the update's peak fell 14.7 GiB with liger, this rule predicts 12.9.
* **logits**: only response positions go through ``lm_head`` (``logits_to_keep``); each such token holds a
  ``[vocab]`` row: bf16 output (2) + fp32 cast (4) + saved log-softmax (4) + its gradient (4) + bf16 gradient (2) =
  16 bytes per element in the update, 10 without grad (log-prob passes). The fused log-prob head
  (``model.use_fused_kernels``, ``verl/workers/actor/fused_logprob.py``) computes ``fused_kernel_options.chunk_size``
  tokens at a time: one ``[chunk, vocab]`` block of fp32 logits plus one fp32 temporary of the same size (the
  exponentials of ``logsumexp`` in the forward, the logits' gradient in the backward), ``FUSED_CHUNK_BYTES`` = 8
  bytes per element of ``min(chunk_size, tokens) x vocab``, with or without grad.
* **ref** (``actor.use_kl_loss``): the same float32 load and sharding, no gradients or optimizer; on the host
  between uses with ``ref.fsdp_config.param_offload``.
* **rollout**: vLLM takes ``gpu_memory_utilization`` x the GPU's memory for its weights (rollout dtype, divided by
  ``tensor_model_parallel_size``) and KV cache (the rest of its share; ``2 x layers x kv_heads x head_dim x 2``
  bytes per token in bf16). With ``free_cache_engine`` it sleeps while training: ``sleep_level`` 1 backs the weights
  up to host memory, 2 drops them (the weight sync refills them). It is created after the actor and ref are on the
  GPU and before they are offloaded (the ``init`` phase). The HF engine keeps weights and a static KV cache of
  ``hf_max_batch_size`` rows of ``max_model_len`` tokens and never sleeps. With ``rollout.engine_process=child`` the
  engine's process adds its own CUDA context and workspaces (``CHILD_ENGINE_RUNTIME_BYTES``) to every phase and its
  own resident memory (``host_baseline_bytes``) on the host.
* **host**: the worker process (``host_baseline_bytes``: Python, torch, CUDA and vLLM libraries), the offloaded
  states above, vLLM's sleep-level-1 weight backup, and at load time the full float32 model that
  ``load_causal_lm`` materialises before moving it to the GPU (``load_host_bytes_per_param``); the reference
  model loads after the optimizer is built, so with ``optimizer_offload`` and a reference model the load phase
  holds both.

Phases (the GPU holds different things at different times; the peak is the largest): ``init``, ``rollout``
(generation), ``log-prob`` (old and reference log-probs), ``update`` (forward/backward of one micro-batch),
``step`` (the optimizer step), ``sync`` (weight sync: vLLM weights awake, KV cache not yet).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from verl.utils.fsdp_utils import resolve_fused_adamw
from verl.utils.model_shape import ModelShape, count_params_on_meta
from verl.utils.offload_optim import DEFAULT_BUCKET_BYTES, streamed_peak_bytes

__all__ = [
    "GiB",
    "ModelShape",
    "count_params_on_meta",
    "MemoryPlan",
    "MemoryEstimate",
    "MemoryCheckError",
    "plan_from_config",
    "estimate_memory",
]

GiB = 2**30
PHASES = ("init", "rollout", "log-prob", "update", "step", "sync")
# CUDA context, cuBLAS/NCCL workspaces: a fixed allowance per GPU process.
RUNTIME_OVERHEAD_BYTES = 2 * GiB
# Resident memory of one worker process before any model (Python, torch, CUDA libraries, vLLM).
HOST_BASELINE_BYTES = 4 * GiB
# rollout.engine_process=child: the engine's own process on the GPU (its CUDA context, cuBLAS workspaces; no NCCL).
CHILD_ENGINE_RUNTIME_BYTES = 1 * GiB
# load_causal_lm builds the whole model in float32 on the host before ``.to(device)`` and sharding.
LOAD_HOST_BYTES_PER_PARAM = 4.0
# Bytes per [token, vocab] element of the logits (see the module docstring).
TRAIN_LOGITS_BYTES = 16.0
NO_GRAD_LOGITS_BYTES = 10.0
# Bytes per [chunk, vocab] element of the fused log-prob head: fp32 logits + one fp32 temporary of their size.
FUSED_CHUNK_BYTES = 8.0
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2}


class MemoryCheckError(ValueError):
    """A config whose estimated per-rank memory does not fit the GPU or the host; the message names the knobs."""


# ---------------------------------------------------------------------------------------------------- the config
@dataclass
class MemoryPlan:
    """The config values that decide per-rank memory (``plan_from_config`` reads them from the trainer config)."""

    world_size: int = 1
    shard_size: int = 1
    ranks_per_node: int = 1
    param_offload: bool = False
    optimizer_offload: bool = False
    # {actor,ref}.fsdp_config.reshard_after_forward: False keeps every layer gathered within a pass
    reshard_after_forward: bool = True
    # rollout.engine_process=child: the engine runs in a process of its own (its runtime and resident memory)
    engine_in_child: bool = False
    ref_reshard_after_forward: bool = True
    use_ref: bool = False
    ref_param_offload: bool = False
    lora_rank: int = 0
    lora_targets: Any = "all-linear"
    gradient_checkpointing: bool = True
    # model.gradient_checkpointing_every: only every N-th decoder layer is checkpointed
    gradient_checkpointing_every: int = 1
    # model.use_liger as the worker resolves it (liger's RMSNorm/SwiGLU save fewer activations); set by the start-up
    # check, which reads the model's HF config (liger patches by model type; plan_from_config leaves it False)
    liger: bool = False
    update_tokens: int = 16384
    update_logit_tokens: int = 16384
    log_prob_tokens: int = 16384
    log_prob_logit_tokens: int = 16384
    fused_logits: bool = False
    # actor_rollout_ref.model.fused_kernel_options.chunk_size: tokens per [chunk, vocab] block of the fused head
    fused_chunk_size: int = 1024
    rollout_name: str = "vllm"
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    rollout_dtype_bytes: int = 2
    # bytes per element of vLLM's KV cache: rollout.engine_kwargs.kv_cache_dtype (fp8*: 1); None: rollout_dtype_bytes
    kv_cache_dtype_bytes: Optional[int] = None
    free_cache_engine: bool = True
    # trainer.rollout_overlap: the next step's rollout runs during the update, so the engine stays awake then
    rollout_overlap: bool = False
    sleep_level: int = 2
    max_model_len: int = 2048
    hf_max_batch_size: int = 64
    # bytes per trainable parameter of AdamW's step temporary: 4 for foreach (torch's default and OffloadedAdamW's
    # buckets), 0 for fused (actor_rollout_ref.actor.optim.fused, resolved as the worker does: plan_from_config)
    adam_step_temp_bytes: float = 4.0
    # state bytes per bucket streamed through the GPU by OffloadedAdamW (optimizer_offload)
    offload_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    host_baseline_bytes: int = HOST_BASELINE_BYTES
    load_host_bytes_per_param: float = LOAD_HOST_BYTES_PER_PARAM


def _rows(per_gpu: Any, global_: Any, world: int, default: int = 1) -> int:
    if per_gpu:
        return int(per_gpu)
    if global_:
        return max(1, int(global_) // max(1, world))
    return default


def _kv_cache_dtype_bytes(rollout: Any, dtype_bytes: int) -> int:
    """Bytes per KV-cache element of the rollout engine: vLLM's ``engine_kwargs.kv_cache_dtype`` (``fp8``,
    ``fp8_e4m3``, ``fp8_e5m2``, ... : 1 byte; ``auto`` or unset: ``dtype_bytes``, the rollout dtype's); the HF engine
    caches in the rollout dtype."""
    kv_dtype = str((rollout.get("engine_kwargs") or {}).get("kv_cache_dtype") or "auto")
    if str(rollout.get("name", "vllm")) != "vllm" or kv_dtype == "auto":
        return dtype_bytes
    return 1 if kv_dtype.startswith("fp8") else _DTYPE_BYTES.get(kv_dtype, dtype_bytes)


def plan_from_config(cfg: Any, device: str = "cuda") -> MemoryPlan:
    """Read a :class:`MemoryPlan` from the composed trainer config (``actor_rollout_ref``, ``data``, ``trainer``) for
    workers on ``device`` (``cuda`` | ``cpu``: where the actor's trainable parameters are when AdamW is built)."""
    arr, trainer = cfg.actor_rollout_ref, cfg.trainer
    actor, rollout, ref, model = arr.actor, arr.rollout, arr.get("ref") or {}, arr.model
    world = int(trainer.nnodes) * int(trainer.n_gpus_per_node)
    fsdp_size = int((actor.get("fsdp_config") or {}).get("fsdp_size", -1) or -1)
    shard = fsdp_size if 1 <= fsdp_size < world and world % fsdp_size == 0 else world
    prompt = int(rollout.get("prompt_length") or cfg.data.get("max_prompt_length") or 0)
    response = int(rollout.get("response_length") or cfg.data.get("max_response_length") or 0)
    row = max(1, prompt + response)
    resp_frac = response / row
    rollout_dtype_bytes = _DTYPE_BYTES.get(str(rollout.get("dtype", "bfloat16")), 2)

    def budget(dynamic: bool, max_tokens: Any, rows: int) -> tuple[int, int]:
        # a micro-batch holds up to max_tokens valid tokens, more by less than one row where no partition into
        # ceil(tokens / max_tokens) micro-batches fits (verl/utils/seqlen_balancing.py), a longer row alone
        if dynamic:
            tokens = int(max_tokens or 16384) + row
            return tokens, int(math.ceil(tokens * resp_frac))
        return rows * row, rows * response

    afc, rfc = actor.get("fsdp_config") or {}, ref.get("fsdp_config") or {}
    update_rows = _rows(actor.get("ppo_micro_batch_size_per_gpu"), actor.get("ppo_micro_batch_size"), world)
    update_tokens, update_logits = budget(
        bool(actor.get("use_dynamic_bsz")), actor.get("ppo_max_token_len_per_gpu"), update_rows
    )
    lp_dynamic = rollout.get("log_prob_use_dynamic_bsz")
    lp_dynamic = bool(actor.get("use_dynamic_bsz")) if lp_dynamic is None else bool(lp_dynamic)
    lp_rows = _rows(
        rollout.get("log_prob_micro_batch_size_per_gpu"), rollout.get("log_prob_micro_batch_size"), world, update_rows
    )
    lp_tokens, lp_logits = budget(
        lp_dynamic, rollout.get("log_prob_max_token_len_per_gpu") or actor.get("ppo_max_token_len_per_gpu"), lp_rows
    )
    max_model_len = int(rollout.get("max_model_len") or 0) or row
    # the worker's choice (verl/utils/fsdp_utils.py::build_optimizer): on a CUDA run null -> fused, no temporary
    fused_adamw = resolve_fused_adamw(
        (actor.get("optim") or {}).get("fused"),
        [device],
        offload=bool(afc.get("optimizer_offload", False)),
        key="actor_rollout_ref.actor.optim.fused",
    )
    cap = 256
    hf_batch = int(rollout.get("hf_max_batch_size") or min(int(rollout.get("max_num_seqs") or cap), cap))
    return MemoryPlan(
        world_size=world,
        shard_size=shard,
        ranks_per_node=int(trainer.n_gpus_per_node),
        param_offload=bool(afc.get("param_offload", False)),
        optimizer_offload=bool(afc.get("optimizer_offload", False)),
        reshard_after_forward=bool(afc.get("reshard_after_forward", True)),
        ref_reshard_after_forward=bool(rfc.get("reshard_after_forward", True)),
        use_ref=bool(actor.get("use_kl_loss", False)),
        ref_param_offload=bool(rfc.get("param_offload", False)),
        lora_rank=int(model.get("lora_rank", 0) or 0),
        lora_targets=model.get("target_modules", "all-linear"),
        gradient_checkpointing=bool(model.get("enable_gradient_checkpointing", False)),
        gradient_checkpointing_every=int(model.get("gradient_checkpointing_every", 1) or 1),
        update_tokens=update_tokens,
        update_logit_tokens=update_logits,
        log_prob_tokens=lp_tokens,
        log_prob_logit_tokens=lp_logits,
        # actor_rollout_ref.model.use_fused_kernels: the chunked log-prob head (verl/workers/actor/fused_logprob.py)
        fused_logits=bool(model.get("use_fused_kernels", False)),
        fused_chunk_size=int((model.get("fused_kernel_options") or {}).get("chunk_size", 1024) or 1024),
        rollout_name=str(rollout.get("name", "vllm")),
        engine_in_child=str(rollout.get("engine_process", "worker")) == "child",
        gpu_memory_utilization=float(rollout.get("gpu_memory_utilization", 0.5)),
        tensor_parallel_size=max(1, int(rollout.get("tensor_model_parallel_size", 1) or 1)),
        rollout_dtype_bytes=rollout_dtype_bytes,
        kv_cache_dtype_bytes=_kv_cache_dtype_bytes(rollout, rollout_dtype_bytes),
        free_cache_engine=bool(rollout.get("free_cache_engine", True)) and not trainer.get("rollout_overlap", False),
        rollout_overlap=bool(trainer.get("rollout_overlap", False)),
        sleep_level=int(rollout.get("sleep_level", 2) or 2),
        max_model_len=max_model_len,
        hf_max_batch_size=hf_batch,
        adam_step_temp_bytes=0.0 if fused_adamw else 4.0,
    )


# ---------------------------------------------------------------------------------------------------- the estimate
@dataclass
class MemoryEstimate:
    """Bytes per rank: ``gpu[phase][component]`` and ``host[phase][component]`` (phases ``load`` and ``steady``)."""

    shape: ModelShape
    plan: MemoryPlan
    gpu_capacity: Optional[int]
    host_capacity: Optional[int]
    gpu: dict[str, dict[str, float]] = field(default_factory=dict)
    host: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def trainable_params(self) -> int:
        p = self.plan
        return self.shape.lora_params(p.lora_rank, p.lora_targets) if p.lora_rank > 0 else self.shape.num_params

    def gpu_total(self, phase: str) -> float:
        return sum(self.gpu[phase].values())

    @property
    def gpu_peak(self) -> tuple[str, float]:
        """The phase with the largest GPU need and that need in bytes."""
        phase = max(self.gpu, key=self.gpu_total)
        return phase, self.gpu_total(phase)

    @property
    def host_per_rank(self) -> float:
        return max(sum(parts.values()) for parts in self.host.values())

    @property
    def host_per_node(self) -> float:
        return self.host_per_rank * self.plan.ranks_per_node

    def problems(self) -> list[str]:
        """Why the config cannot fit, each with the knob to change; empty when it fits (or capacity is unknown)."""
        out = []
        if self.gpu_capacity:
            out += self.notes
            for phase in self.gpu:
                total = self.gpu_total(phase)
                if total > self.gpu_capacity:
                    out.append(self._gpu_problem(phase, total))
        if self.host_capacity and self.host_per_node > self.host_capacity:
            out.append(self._host_problem())
        return out

    def _gpu_problem(self, phase: str, total: float) -> str:
        p, parts = self.plan, self.gpu[phase]
        actor, ro = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
        more_gpus = f"use more GPUs (trainer.n_gpus_per_node={p.ranks_per_node}, trainer.nnodes)"
        fixes: list[tuple[float, str]] = []
        training = phase in ("log-prob", "update", "step")
        sharded = sum(parts.get(k, 0) for k in ("actor params", "grads", "optimizer", "adam step temp"))
        if phase in ("update", "step") and sharded:
            why = (
                ""
                if p.optimizer_offload or not parts.get("optimizer")
                else f" or set {actor}.fsdp_config.optimizer_offload=True (the Adam states stream through the GPU)"
            )
            fixes.append(
                (
                    sharded,
                    f"actor parameters, gradients and Adam states need {_gib(sharded)} per rank here, sharded over "
                    f"{p.shard_size} rank(s): {more_gpus}{why}",
                )
            )
        for name, size in parts.items():
            if not size:
                continue
            if name == "optimizer" and phase not in ("update", "step"):
                fixes.append(
                    (
                        size,
                        f"actor optimizer states need {_gib(size)} per rank; set "
                        f"{actor}.fsdp_config.optimizer_offload=True or {more_gpus}",
                    )
                )
            elif name == "actor params" and phase == "rollout":
                fixes.append((size, f"actor parameters need {_gib(size)}; set {actor}.fsdp_config.param_offload=True"))
            elif name == "ref params" and phase != "log-prob":
                fixes.append(
                    (
                        size,
                        f"the reference model needs {_gib(size)}; set "
                        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
                    )
                )
            elif name in ("rollout weights", "KV cache") and training and p.rollout_name == "vllm":
                knob = "trainer.rollout_overlap=False" if p.rollout_overlap else f"{ro}.free_cache_engine=True"
                fixes.append((size, f"vLLM keeps its {name} ({_gib(size)}) while training; set {knob}"))
            elif name == "KV cache" and p.rollout_name == "vllm":
                fixes.append(
                    (
                        size,
                        f"lower {ro}.gpu_memory_utilization (now {p.gpu_memory_utilization}: {_gib(size)} of KV cache)",
                    )
                )
            elif name == "KV cache":
                fixes.append((size, f"lower {ro}.hf_max_batch_size or {ro}.max_model_len (KV cache {_gib(size)})"))
            elif name in ("activations", "logits") and phase == "update":
                dynamic = p.update_tokens != p.update_logit_tokens
                knob = "ppo_max_token_len_per_gpu" if dynamic else "ppo_micro_batch_size_per_gpu"
                model = "actor_rollout_ref.model"
                ckpt = (
                    f"; set {model}.enable_gradient_checkpointing=True"
                    if not p.gradient_checkpointing
                    else f"; lower {model}.gradient_checkpointing_every (now {p.gradient_checkpointing_every})"
                    if p.gradient_checkpointing_every > 1
                    else ""
                )
                fixes.append((size, f"{name} of one micro-batch need {_gib(size)}; lower {actor}.{knob}{ckpt}"))
            elif name in ("activations", "logits") and phase == "log-prob":
                fixes.append(
                    (
                        size,
                        f"{name} of one log-prob micro-batch need {_gib(size)}; lower {ro}.log_prob_max_token_len_per_gpu "
                        "and actor_rollout_ref.ref.log_prob_max_token_len_per_gpu (or their micro-batch sizes)",
                    )
                )
        fixes.sort(key=lambda f: -f[0])
        advice = "; ".join(text for _, text in fixes[:3]) or more_gpus
        return (
            f"GPU memory per rank in phase '{phase}': {_gib(total)} needed, {_gib(self.gpu_capacity)} on the device "
            f"(over by {_gib(total - self.gpu_capacity)}). To fit: {advice}. (trainer.memory_check=warn runs it anyway)"
        )

    def _host_problem(self) -> str:
        p = self.plan
        steady, load = self.host["steady"], self.host["load"]
        parts = ", ".join(f"{k} {_gib(v)}" for k, v in {**steady, **load}.items() if v)
        fixes = []
        if steady.get("optimizer (offloaded)"):
            fixes.append("use more GPUs so the offloaded Adam states shard further (trainer.n_gpus_per_node, nnodes)")
        if steady.get("vLLM weight backup"):
            fixes.append("set actor_rollout_ref.rollout.sleep_level=2 (no host backup of the rollout weights)")
        if steady.get("actor params (offloaded)") or steady.get("ref params (offloaded)"):
            fixes.append("turn off actor/ref fsdp_config.param_offload if the GPU has room")
        fixes.append("use fewer ranks per node (trainer.n_gpus_per_node) or a node with more memory")
        return (
            f"host memory: {p.ranks_per_node} rank(s) per node x {_gib(self.host_per_rank)} ({parts}) = "
            f"{_gib(self.host_per_node)} needed, the node has {_gib(self.host_capacity)}. To fit: {'; '.join(fixes)}. "
            "(trainer.memory_check=warn runs it anyway)"
        )

    def format_table(self, title: str = "") -> str:
        """A compact per-rank table: GPU GiB per component and phase, then host GiB."""
        s, p = self.shape, self.plan
        head = (
            f"memory estimate per rank{(' (' + title + ')') if title else ''}: {_count(s.num_params)} params "
            f"({_count(self.trainable_params)} trainable), {p.world_size} rank(s), FSDP shard {p.shard_size}, "
            f"rollout {p.rollout_name}"
        )
        lines = [head, f"  {'GPU GiB':<20}" + "".join(f"{ph:>9}" for ph in self.gpu)]
        names = list(dict.fromkeys(n for parts in self.gpu.values() for n in parts))
        for name in names:
            lines.append(f"  {name:<20}" + "".join(_cell(self.gpu[ph].get(name, 0)) for ph in self.gpu))
        lines.append(f"  {'total':<20}" + "".join(_cell(self.gpu_total(ph)) for ph in self.gpu))
        cap = _gib(self.gpu_capacity) if self.gpu_capacity else "unknown (no GPU)"
        peak_phase, peak = self.gpu_peak
        lines.append(f"  peak {_gib(peak)} ({peak_phase}) vs device capacity {cap}")
        host = ", ".join(
            f"{ph}: " + " + ".join(f"{k} {v / GiB:.1f}" for k, v in parts.items() if v)
            for ph, parts in self.host.items()
        )
        host_cap = _gib(self.host_capacity) if self.host_capacity else "unknown"
        lines.append(f"  host GiB per rank: {host}")
        lines.append(
            f"  host per node: {p.ranks_per_node} x {_gib(self.host_per_rank)} = {_gib(self.host_per_node)} "
            f"vs RAM {host_cap}"
        )
        return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _gib(nbytes: Optional[float]) -> str:
    return f"{(nbytes or 0) / GiB:.1f} GiB"


def _cell(nbytes: float) -> str:
    return f"{nbytes / GiB:>9.1f}" if nbytes else f"{'-':>9}"


def estimate_memory(
    shape: ModelShape, plan: MemoryPlan, gpu_capacity: Optional[int] = None, host_capacity: Optional[int] = None
) -> MemoryEstimate:
    """Per-rank bytes of every component in every phase (see the module docstring for each formula)."""
    est = MemoryEstimate(shape, plan, gpu_capacity, host_capacity)
    p, n, S = plan, shape.num_params, max(1, plan.shard_size)
    nt = est.trainable_params
    params = 4.0 * n / S
    grads = 4.0 * nt / S
    adam = 8.0 * nt / S
    ref = params if p.use_ref else 0.0
    layer, root = shape.layer_params, shape.root_params

    def gathered_bytes(reshard_after_forward: bool) -> float:
        """bf16 all-gathered root unit + two decoder layers (the one computing, the prefetched one); without
        reshard_after_forward every layer stays gathered from its forward to its backward (or to the pass's end)."""
        return 2.0 * (root + (2 if reshard_after_forward else shape.num_layers) * layer)

    gathered, ref_gathered = gathered_bytes(p.reshard_after_forward), gathered_bytes(p.ref_reshard_after_forward)
    grad_buffers = 6.0 * max(root, layer) * (nt / n)  # one unit's unsharded bf16 gradient + fp32 reduce-scatter copy

    def logits(tokens: int, bytes_per_element: float) -> float:
        if p.fused_logits:  # one [chunk, vocab] block at a time
            return float(min(tokens, max(1, p.fused_chunk_size))) * shape.vocab_size * FUSED_CHUNK_BYTES
        return float(tokens) * shape.vocab_size * bytes_per_element

    # the rollout engine
    weights = float(p.rollout_dtype_bytes) * n / p.tensor_parallel_size
    kv_token = shape.kv_bytes_per_token(p.kv_cache_dtype_bytes or p.rollout_dtype_bytes) / p.tensor_parallel_size
    if p.rollout_name == "vllm":
        share = p.gpu_memory_utilization * gpu_capacity if gpu_capacity else weights
        kv = max(0.0, share - weights)
        if gpu_capacity and share < weights:
            est.notes.append(
                f"actor_rollout_ref.rollout.gpu_memory_utilization={p.gpu_memory_utilization} gives vLLM "
                f"{_gib(share)}, less than the rollout weights ({_gib(weights)}): raise it, or raise "
                "tensor_model_parallel_size"
            )
        elif gpu_capacity and kv < p.max_model_len * kv_token:
            est.notes.append(
                f"vLLM's KV cache ({_gib(kv)} = gpu_memory_utilization {p.gpu_memory_utilization} x {_gib(gpu_capacity)}"
                f" - weights {_gib(weights)}) cannot hold one sequence of max_model_len={p.max_model_len} tokens "
                f"({_gib(p.max_model_len * kv_token)}): raise actor_rollout_ref.rollout.gpu_memory_utilization or lower "
                "actor_rollout_ref.rollout.max_model_len"
            )
        asleep = p.free_cache_engine
    else:  # HF engine: weights + static KV cache for hf_max_batch_size rows, never asleep
        kv = float(p.hf_max_batch_size) * p.max_model_len * kv_token
        asleep = False
    engine = {"rollout weights": weights, "KV cache": kv}
    training_engine = {} if asleep else engine
    runtime = {"runtime (CUDA, NCCL)": float(RUNTIME_OVERHEAD_BYTES)}
    if p.engine_in_child:
        runtime["engine process runtime (CUDA)"] = float(CHILD_ENGINE_RUNTIME_BYTES)
    engine_process_host = float(p.host_baseline_bytes) if p.engine_in_child else 0.0

    resident_params = 0.0 if p.param_offload else params
    resident_adam = 0.0 if p.optimizer_offload else adam
    resident_ref = 0.0 if p.ref_param_offload else ref
    # streamed (OffloadedAdamW): three buckets on the GPU during the step (the bucket plan of the optimizer over this
    # rank's dim-0 shards), none outside it; the foreach temporary is that of the computing bucket only
    if p.optimizer_offload and p.lora_rank <= 0:
        sizes = [8 * math.ceil(d[0] / S) * math.prod(d[1:]) for d in shape.param_shapes()]
        with_temp = streamed_peak_bytes(sizes, p.offload_bucket_bytes, temp_fraction=p.adam_step_temp_bytes / 8.0)
        streamed = float(streamed_peak_bytes(sizes, p.offload_bucket_bytes, temp_fraction=0.0))
        step_temp = min(float(with_temp) - streamed, p.adam_step_temp_bytes * nt / S)
    elif p.optimizer_offload:  # LoRA: small adapters, at most three full buckets
        streamed = min(adam, 3.0 * p.offload_bucket_bytes)
        step_temp = p.adam_step_temp_bytes * min(nt / S, p.offload_bucket_bytes / 8.0)
    else:
        streamed, step_temp = adam, p.adam_step_temp_bytes * nt / S
    update_act = float(p.update_tokens) * shape.activation_bytes_per_token(
        p.gradient_checkpointing, p.gradient_checkpointing_every, p.liger
    )
    update_logits = logits(p.update_logit_tokens, TRAIN_LOGITS_BYTES)
    no_grad_act = float(p.log_prob_tokens) * (shape.activation_bytes_per_token(False, liger=p.liger) / shape.num_layers)
    lp_common = {
        "activations": no_grad_act,
        "logits": logits(p.log_prob_logit_tokens, NO_GRAD_LOGITS_BYTES),
        "optimizer": resident_adam,
    }
    actor_pass = {"actor params": params, "ref params": resident_ref, "fsdp buffers": gathered, **lp_common}
    ref_pass = {"actor params": resident_params, "ref params": ref, "fsdp buffers": ref_gathered, **lp_common}
    est.gpu = {
        "init": {"actor params": params, "ref params": ref, **engine, **runtime},
        "rollout": {"actor params": resident_params, "optimizer": resident_adam, "ref params": resident_ref, **engine},
        "log-prob": max(actor_pass, ref_pass, key=lambda d: sum(d.values())),
        "update": {
            "actor params": params,
            "grads": grads,
            "optimizer": resident_adam,
            # the root's reduce-scatter buffers exist at the end of backward, when activations and logits are
            # freed: only their excess over those counts
            "fsdp buffers": gathered + max(0.0, grad_buffers - update_act - update_logits),
            "activations": update_act,
            "logits": update_logits,
            "ref params": resident_ref,
        },
        "step": {
            "actor params": params,
            "grads": grads,
            "optimizer": streamed,
            "adam step temp": step_temp,
            "ref params": resident_ref,
        },
        "sync": {
            "actor params": params,
            "optimizer": resident_adam,
            "ref params": resident_ref,
            "fsdp buffers": 2.0 * root,
            "rollout weights": weights,
            "KV cache": 0.0 if asleep else kv,
        },
    }
    for phase in ("rollout", "log-prob", "update", "step", "sync"):
        if phase in ("log-prob", "update", "step"):
            est.gpu[phase].update(training_engine)
        est.gpu[phase].update(runtime)
    est.host = {
        "load": {
            "worker": float(p.host_baseline_bytes),
            "engine process": engine_process_host,
            "fp32 model while loading": p.load_host_bytes_per_param * n,
            # the reference model loads after the (host-resident) optimizer is built
            "optimizer (offloaded)": adam if (p.optimizer_offload and p.use_ref) else 0.0,
        },
        "steady": {
            "worker": float(p.host_baseline_bytes),
            "engine process": engine_process_host,
            "actor params (offloaded)": params if p.param_offload else 0.0,
            "optimizer (offloaded)": adam if p.optimizer_offload else 0.0,
            "ref params (offloaded)": ref if p.ref_param_offload else 0.0,
            "vLLM weight backup": weights if (asleep and p.rollout_name == "vllm" and p.sleep_level == 1) else 0.0,
        },
    }
    return est
