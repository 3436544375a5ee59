"""The actor/rollout/reference worker: one process per GPU (or per CPU slot) holding all three roles.

* **actor**: the trained policy (FSDP2-sharded when there is more than one rank or a GPU),
  AdamW + warm-up scheduler, :class:`DataParallelPPOActor` for log-probs and updates;
* **ref**: a frozen copy of the initial policy for the KL loss (only when ``use_kl_loss``);
* **rollout**: a token-in/token-out engine (``vllm`` or ``hf``) that receives the actor's
  weights after every update (``sync_rollout_weights``), in buckets. With vLLM and
  ``rollout.tensor_model_parallel_size = tp > 1`` the ranks form TP groups of ``tp`` consecutive ranks, each group
  sharing one engine sharded across its ranks (``verl/workers/rollout/tp_layout.py``); every rank still loads the
  full weights and vLLM keeps its shard.

The driver talks to a group of these through ``verl.single_controller`` (see ``ray_trainer``).

**Two threads with ``trainer.rollout_overlap``.** The Ray group is then created with the concurrency groups
:data:`OVERLAP_CONCURRENCY_GROUPS` (``verl/trainer/ppo/ray_worker_group.py``): ``generate``, ``sleep_rollout`` and
``wake_up_rollout`` run in the ``rollout`` thread, the FSDP calls (log-probs, update, weight sync, checkpoints) in
the ``train`` thread, so the next step's generation and this step's update run at the same time in one process.
The engine is only driven from the rollout thread (its own scheduler thread does the work), the FSDP model and its
collectives only from the train thread; :class:`~verl.workers.rollout.guard.RolloutGuard` refuses a weight sync,
sleep or wake-up while a generation is in flight. In async mode with ``rollout.async_free_running_calls = k > 0``
the ``rollout`` group has ``k`` threads: ``k`` single-request ``generate`` calls at once, which the engine batches.
Without either the worker runs one call at a time.
"""

from __future__ import annotations

import functools
import logging
import sys
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Optional

import torch

from verl.protocol import DataProto
from verl.single_controller import Dispatch, register
from verl.utils.flops import peak_flops_per_gpu, update_mfu
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.actor.settings import plain_values
from verl.workers.config import ActorRolloutRefConfig, RefConfig, RolloutConfig
from verl.workers.memory_peaks import PhasePeaks, memory_metrics
from verl.workers.rollout.guard import RolloutGuard
from verl.workers.rollout.tp_layout import ROLLOUT_MESH, RolloutLayout, outputs_digest
from verl.workers.training_sms import TrainingSMs
from verl.workers.training_worker import TrainingWorker

logger = logging.getLogger(__name__)

# Ray concurrency groups of the worker with trainer.rollout_overlap: one thread each (see the module docstring)
ROLLOUT_GROUP, TRAIN_GROUP = "rollout", "train"
OVERLAP_CONCURRENCY_GROUPS = {ROLLOUT_GROUP: 1, TRAIN_GROUP: 1}


def vllm_extra_options(rc: Any) -> dict[str, Any]:
    """``cudagraph_max_tokens`` and ``engine_kwargs`` of ``actor_rollout_ref.rollout`` as
    :class:`~verl.workers.rollout.vllm_engine.VLLMRolloutEngine` arguments (null entries dropped;
    ``swap_space``, which vLLM no longer has, dropped with a warning). ``rc``: a RolloutConfig or a mapping."""
    rc = RolloutConfig.from_config(rc)  # validates sleep_level (1 or 2)
    extra = {k: v for k, v in rc.engine_kwargs.items() if v is not None}
    if extra.pop("swap_space", None) is not None:
        logger.warning(
            "actor_rollout_ref.rollout.engine_kwargs.swap_space is ignored: vLLM has no swap space since 0.11"
        )
    options: dict[str, Any] = {"engine_kwargs": extra} if extra else {}
    options["sleep_level"] = rc.sleep_level
    options["engine_stream"] = rc.engine_stream or "shared"  # null is resolved at launch (main_ppo); else shared
    if rc.cudagraph_max_tokens:
        options["cudagraph_max_tokens"] = rc.cudagraph_max_tokens
    return options


def apply_gil_switch_interval(milliseconds: Optional[float]) -> None:
    """``actor_rollout_ref.rollout.gil_switch_interval_ms``: Python's thread switch interval for this worker process
    (null leaves Python's default, 5 ms)."""
    if milliseconds is None:
        return
    sys.setswitchinterval(float(milliseconds) / 1000.0)
    logger.info("thread switch interval %.3g ms (actor_rollout_ref.rollout.gil_switch_interval_ms)", milliseconds)


# Micro-batching of a log-prob-only pass; verl reads them from ``rollout`` for the actor's old log-probs and from
# ``ref`` for the reference log-probs (the actor's own ppo_* budgets are for its update).
LOG_PROB_KEYS = (
    "log_prob_micro_batch_size",
    "log_prob_micro_batch_size_per_gpu",
    "log_prob_max_token_len_per_gpu",
    "log_prob_use_dynamic_bsz",
)


def log_prob_settings(actor_settings: dict, section: RolloutConfig | RefConfig) -> dict:
    """``actor_settings`` with the ``LOG_PROB_KEYS`` of ``section`` (``actor_rollout_ref.rollout`` or ``.ref``)
    laid over it; a key the section leaves null keeps the actor's fallback (``ppo_micro_batch_size_per_gpu``,
    ``use_dynamic_bsz``, ``ppo_max_token_len_per_gpu``, see ``ActorSettings``)."""
    return {**actor_settings, **{key: getattr(section, key) for key in LOG_PROB_KEYS}}


class ActorRolloutRefWorker(TrainingWorker):
    """All roles of one rank. ``config`` is ``actor_rollout_ref`` (read through the typed ``self.conf``);
    ``device`` is ``cpu`` or ``cuda``."""

    CONFIG_CLS = ActorRolloutRefConfig

    def __init__(self, config: Any, device: str = "cpu"):
        super().__init__(config, device)
        self.rollout = None
        self.ref = None
        self.rollout_guard = RolloutGuard()  # no weight sync / sleep / wake-up under a generation in flight
        self._rollout_time_seen = (0.0, 0, 0.0)  # generate seconds, engine steps, engine step seconds (last report)
        self._partitioned_seen = 0  # training_sms.partitioned_passes at the last update's report
        # perf/{max_memory_allocated,phase_growth,max_memory_in_use}_gb/<phase>; in use: less what the rollout engine
        # released while asleep (vLLM's sleep-mode pool counts as allocated also then)
        self.phase_peaks = PhasePeaks(enabled=device == "cuda", released=self._rollout_released_bytes)

    @functools.cached_property
    def actor_parameters(self) -> int:
        """The actor's parameters (all ranks' shards: FSDP2's DTensors count their global size)."""
        from verl.utils.model_loading import count_parameters

        return count_parameters(self.actor_module)

    @functools.cached_property
    def peak_flops(self) -> float | None:
        """This GPU's dense bf16 peak for ``perf/mfu/actor`` (None on CPU or an unknown GPU)."""
        return peak_flops_per_gpu(self.device_name)

    @functools.cached_property
    def training_sms(self) -> TrainingSMs:
        """The training passes' SMs (``rollout.engine_reserved_sms`` kept for the engine thread while a generation
        runs on this worker; the key is 0 unless main_ppo found generation running beside training in this process on
        a GPU). The actor and the reference model enter its scope around each micro-batch."""
        device = torch.cuda.current_device() if self.device_name == "cuda" else None  # None: no partition
        return TrainingSMs(self.conf.rollout.engine_reserved_sms, device, busy=lambda: self.rollout_guard.in_flight > 0)

    def _rollout_released_bytes(self) -> int:
        return int(getattr(self.rollout, "released_bytes", 0))

    # ------------------------------------------------------------------ setup
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from verl.utils.fsdp_utils import apply_fsdp2, init_fsdp_mesh
        from verl.utils.import_utils import import_external_libs
        from verl.utils.liger import resolve_use_liger
        from verl.utils.model_loading import load_causal_lm, load_model_config

        self._init_distributed()
        cfg = self.conf
        model_cfg, actor_cfg = cfg.model, cfg.actor
        torch.manual_seed(actor_cfg.seed)  # the same initialisation (LoRA adapters) on every rank
        device = torch.device("cuda" if self.device_name == "cuda" else "cpu")
        train_dtype = "float32"  # master weights; bf16 compute comes from FSDP2 mixed precision on GPU
        self.model_path = str(model_cfg.path)
        import_external_libs(model_cfg.external_lib)  # model.external_lib: before actor, ref and rollout engine load
        use_liger = model_cfg.use_liger  # null: resolved once, for this worker's device (the ref follows the actor)
        if use_liger is None:
            model_config = load_model_config(
                self.model_path, model_cfg.trust_remote_code, model_cfg.override_config or None
            )
            use_liger = resolve_use_liger(
                None, device, model_config=model_config, compile_layers=model_cfg.compile_layers
            )
        actor_module = load_causal_lm(
            self.model_path,
            dtype=train_dtype,
            attn_implementation=model_cfg.attn_implementation,
            remove_padding=model_cfg.use_remove_padding,
            share_prompts=model_cfg.share_prompts,
            override_config=model_cfg.override_config or None,
            gradient_checkpointing=model_cfg.enable_gradient_checkpointing,
            gradient_checkpointing_every=model_cfg.gradient_checkpointing_every,
            lora=model_cfg.lora,
            use_liger=use_liger,
            compile_layers=model_cfg.compile_layers,
            trust_remote_code=model_cfg.trust_remote_code,
            device=device,  # the automatic attention is the worker device's (not whether the host has a GPU)
        )
        if model_cfg.lora is not None:
            self._check_lora(actor_module)
        self.sharded = self.world_size > 1 or self.device_name == "cuda"
        self.fsdp_mesh = None
        if self.sharded:  # HSDP when fsdp_size divides the world size (the ref model shares the mesh, as in verl)
            self.fsdp_mesh = init_fsdp_mesh(
                actor_cfg.fsdp_config.fsdp_size,
                device_type=self.device_name,
                world_size=self.world_size,
                key="actor_rollout_ref.actor.fsdp_config.fsdp_size",
            )
            param_dtype = "bfloat16" if self.device_name == "cuda" else None
            actor_module = apply_fsdp2(
                actor_module,
                mesh=self.fsdp_mesh,
                param_dtype=param_dtype,
                reshard_after_forward=actor_cfg.fsdp_config.reshard_after_forward,
            )
        optimizer, self.lr_scheduler = self._build_optimizer(actor_module)
        actor_settings = {
            **plain_values(actor_cfg),
            "use_remove_padding": model_cfg.use_remove_padding,
            "share_prompts": model_cfg.share_prompts,
            # the fused log-prob head acts in the actor, ref and old-log-prob passes (settings copied from here)
            "use_fused_kernels": model_cfg.use_fused_kernels,
            "fused_kernel_options": plain_values(model_cfg.fused_kernel_options),
        }
        self.actor_module, self.optimizer = actor_module, optimizer
        # old log-probs are micro-batched with the rollout's log_prob_* budgets (verl), updates with the actor's
        self.actor = DataParallelPPOActor(log_prob_settings(actor_settings, cfg.rollout), actor_module, optimizer)
        self.actor.micro_batch_scope = self.training_sms.scope
        if actor_cfg.use_kl_loss:
            ref_module = load_causal_lm(
                self.model_path,
                dtype=train_dtype,
                attn_implementation=model_cfg.attn_implementation,
                remove_padding=model_cfg.use_remove_padding,
                share_prompts=model_cfg.share_prompts,
                override_config=model_cfg.override_config or None,
                use_liger=use_liger,  # the ref model runs the actor's kernels (as verl's does)
                compile_layers=model_cfg.compile_layers,
                trust_remote_code=model_cfg.trust_remote_code,
                device=device,
            )
            ref_module.requires_grad_(False)
            if self.sharded:
                ref_module = apply_fsdp2(
                    ref_module,
                    mesh=self.fsdp_mesh,
                    param_dtype="bfloat16" if self.device_name == "cuda" else None,
                    reshard_after_forward=cfg.ref.fsdp_config.reshard_after_forward,
                )
            # the ref's own log_prob_* budgets over the actor's
            self.ref = DataParallelPPOActor(log_prob_settings(actor_settings, cfg.ref), ref_module, None)
            self.ref.micro_batch_scope = self.training_sms.scope
        self._init_rollout()
        self._offload_idle_models()

    def _check_lora(self, actor_module: torch.nn.Module) -> None:
        """LoRA (``model.lora_rank > 0``): only the adapters train, and every adapter merges into a linear weight
        the rollout engine has (the weight sync hands over ``W + scaling * B @ A``, ``verl/utils/lora.py``);
        refused at load time otherwise, naming ``actor_rollout_ref.model.target_modules``."""
        from verl.utils.lora import lora_merges

        merges = lora_merges(actor_module)  # peft itself refuses target_modules that match nothing
        trainable, total = actor_module.get_nb_trainable_parameters()
        logger.info("LoRA: %d adapted linears, %d of %d parameters trainable", len(merges), trainable, total)

    def _init_rollout(self) -> None:
        from verl.workers.rollout.base import get_rollout_engine

        rc, model_cfg = self.conf.rollout, self.conf.model
        # the engine builds the same model as the actor: the same config overrides and remote-code permission
        overrides = model_cfg.override_config or None
        max_len = rc.engine_max_len
        if max_len is None:
            raise ValueError(
                "actor_rollout_ref.rollout.max_model_len or prompt_length and response_length must be set "
                f"(got {rc.max_model_len}, {rc.prompt_length}, {rc.response_length})"
            )
        apply_gil_switch_interval(rc.gil_switch_interval_ms)
        if rc.engine_stream not in (None, "shared") and (rc.name != "vllm" or self.device_name != "cuda"):
            logger.warning(
                "actor_rollout_ref.rollout.engine_stream=%s has no effect here: it applies to vLLM on CUDA "
                "(rollout.name=%s, device %s)",
                rc.engine_stream,
                rc.name,
                self.device_name,
            )
        tp = rc.tensor_model_parallel_size if rc.name == "vllm" else 1  # the HF engine runs one process per rank
        self.rollout_layout = RolloutLayout(self.world_size, tp)
        layout, rank = self.rollout_layout, self.rank
        self.set_dispatch_info(ROLLOUT_MESH, dp_rank=layout.dp_rank(rank), is_collect=layout.is_collect(rank))
        if rc.name == "hf":
            # The HF engine preallocates its KV cache for max_batch_size rows (vLLM's max_num_seqs is
            # a scheduler limit, far too large to preallocate): cap it. bf16 is slow on CPUs without
            # AVX512-BF16, so CPU runs use float32.
            cap = 64 if self.device_name == "cpu" else 256
            engine_kwargs = dict(
                model=self.model_path,
                device="cuda:0" if self.device_name == "cuda" else "cpu",
                dtype="float32" if self.device_name == "cpu" else rc.dtype,
                max_batch_size=rc.hf_max_batch_size or min(rc.max_num_seqs, cap),
                max_model_len=max_len,
                trust_remote_code=model_cfg.trust_remote_code,
                override_config=overrides,
            )
        else:
            engine_kwargs = dict(
                model_path=self.model_path,
                dtype="float32" if self.device_name == "cpu" else rc.dtype,
                gpu_memory_utilization=rc.gpu_memory_utilization,
                enforce_eager=rc.enforce_eager if rc.enforce_eager is not None else self.device_name != "cuda",
                max_model_len=max_len,
                tensor_parallel_size=rc.tensor_model_parallel_size,
                max_num_batched_tokens=rc.max_num_batched_tokens,
                max_num_seqs=rc.max_num_seqs,
                enable_sleep_mode=rc.free_cache_engine if self.device_name == "cuda" else None,
                seed=rc.seed or 0,
                trust_remote_code=model_cfg.trust_remote_code,
                hf_overrides=overrides,
                distributed_executor_backend="external_launcher" if tp > 1 else None,
                **vllm_extra_options(rc),
            )
        if rc.engine_process == "child":  # its own process on this device (verl/workers/rollout/child_process.py)
            from verl.workers.rollout.child_process import ChildProcessEngine

            self.rollout = ChildProcessEngine(rc.name, engine_kwargs)
        else:
            self.rollout = get_rollout_engine(rc.name, **engine_kwargs)
        if tp > 1 and self.rollout.tp_group_ranks != layout.group(layout.dp_rank(rank)):
            raise RuntimeError(
                f"vLLM formed the tensor-parallel group {self.rollout.tp_group_ranks} for rank {rank}, expected "
                f"{layout.group(layout.dp_rank(rank))} (groups of {tp} consecutive ranks)"
            )

    # ------------------------------------------------------------------ CPU offload
    def _build_optimizer(self, module: torch.nn.Module):
        """AdamW and its LR schedule for the actor; ``actor.fsdp_config.optimizer_offload`` makes it
        :class:`~verl.utils.offload_optim.OffloadedAdamW`: the Adam state lives in host memory from here on and
        streams through the device bucket by bucket inside ``optimizer.step()`` (nothing to load or offload)."""
        from verl.utils.fsdp_utils import build_optim_and_scheduler

        actor_cfg = self.conf.actor
        return build_optim_and_scheduler(module, actor_cfg.optim, offload=actor_cfg.fsdp_config.optimizer_offload)

    @contextmanager
    def _resident(self, role: str = "actor"):
        """Bring offloaded parameters onto the worker's device for the block, then back.

        ``actor_rollout_ref.{actor,ref}.fsdp_config.param_offload``; a no-op when offload is off. On CPU runs the
        moves are CPU to CPU (nothing moves; the code path is the one GPU runs take). The optimizer state of
        ``optimizer_offload`` is not moved here: it stays on the host (``_build_optimizer``).
        """
        from verl.utils.fsdp_utils import load_fsdp_model_to_gpu, offload_fsdp_model_to_cpu, reshard_fsdp

        fsdp = self.conf.actor.fsdp_config if role == "actor" else self.conf.ref.fsdp_config
        module = self.actor_module if role == "actor" else self.ref.actor_module
        device = (
            torch.device("cuda", torch.cuda.current_device()) if self.device_name == "cuda" else torch.device("cpu")
        )
        params = fsdp.param_offload
        if params:
            load_fsdp_model_to_gpu(module, device)
        try:
            yield
        finally:
            if not fsdp.reshard_after_forward:  # a forward-only pass leaves them gathered
                reshard_fsdp(module)
            if params:
                offload_fsdp_model_to_cpu(module)

    def _offload_idle_models(self) -> None:
        """After init: park offloaded models on the CPU until a computation needs them."""
        with self._resident("actor"):
            pass
        if self.ref is not None:
            with self._resident("ref"):
                pass

    # ------------------------------------------------------------------ rollout
    @register(dispatch_mode=Dispatch.ALL_TO_ALL, concurrency_group=ROLLOUT_GROUP)
    def generate(self, prompts: list[list[int]], params: dict, seeds: list[int] | None = None):
        """Generate for this rank's prompts; ``seeds`` gives each request its own seed.

        With a tensor-parallel engine every rank of a TP group gets the same prompts and seeds; TP rank 0 returns
        the outputs, the others a :class:`GroupDigest` of theirs (``RolloutClient`` checks that they agree)."""
        with self.rollout_guard.generating("generate"), self.phase_peaks.phase("rollout"):
            return self._generate(prompts, params, seeds)

    def _generate(self, prompts: list[list[int]], params: dict, seeds: list[int] | None):
        from verl.workers.rollout.base import SamplingParams

        sp = SamplingParams.from_dict(params)
        per_request = [sp] * len(prompts) if seeds is None else [replace(sp, seed=s) for s in seeds]
        # the whole batch in one go: the engine's first step sees every request
        outputs = self.rollout.generate_requests(prompts, per_request)
        layout = getattr(self, "rollout_layout", None)
        if layout is not None and layout.tp_size > 1 and not layout.is_collect(self.rank):
            return outputs_digest(outputs)
        return outputs

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group=TRAIN_GROUP)
    def sync_rollout_weights(self) -> float:
        """Push the actor's weights into the rollout engine; return seconds.

        The engine's weights wake first, the tensors go in buckets in the engine's dtype straight from the GPU
        (cast before the FSDP all-gather, tied weights once: ``verl/utils/rollout_weights.py``), then the KV
        cache wakes, so the peak memory is weights + training state, never weights + KV cache + a host copy.
        Refused (RuntimeError) while a generation is in flight on this worker (:class:`RolloutGuard`).
        """
        with self.rollout_guard.changing("sync_rollout_weights"), self.phase_peaks.phase("sync"):
            return self._sync_weights()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group=TRAIN_GROUP)
    def shift_engine_reserved_sms(self, delta: int) -> int:
        """``rollout.balance_reserved_sms``: keep ``delta`` SMs more (fewer, when negative) for the engine from the
        next training pass on; returns the count now kept (:meth:`TrainingSMs.shift`)."""
        return self.training_sms.shift(delta)

    def _sync_weights(self) -> float:
        import time

        from verl.utils.rollout_weights import iter_rollout_weights

        t0 = time.perf_counter()
        self.rollout.wake_up(tags=["weights"])
        with self._resident("actor"):
            for bucket in iter_rollout_weights(self.actor_module, dtype=self.rollout_dtype):
                self.rollout.update_weights(bucket)
        self.rollout.wake_up(tags=["kv_cache"])
        return time.perf_counter() - t0

    @property
    def rollout_dtype(self) -> torch.dtype:
        """The dtype of the rollout engine's weights (float32 on CPU, ``rollout.dtype`` on a GPU)."""
        if self.device_name == "cpu":
            return torch.float32
        return getattr(torch, self.conf.rollout.dtype)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group=ROLLOUT_GROUP)
    def wake_up_rollout(self) -> None:
        """Wake the engine with the weights it had; after a sleep that dropped them, sync them again."""
        with self.rollout_guard.changing("wake_up_rollout"):
            if self.rollout.weights_discarded:
                self._sync_weights()
            else:
                self.rollout.wake_up()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group=ROLLOUT_GROUP)
    def sleep_rollout(self) -> None:
        """Free the engine's KV cache while training (vLLM on GPU; a no-op elsewhere)."""
        if self.conf.rollout.free_cache_engine:
            with self.rollout_guard.changing("sleep_rollout"):
                self.rollout.sleep()

    # ------------------------------------------------------------------ training
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, concurrency_group=TRAIN_GROUP)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        with self._resident("actor"), self.phase_peaks.phase("log-prob"):
            # no entropies: nothing reads them, and they cost a pass over [tokens, vocab] logits (and rule out
            # liger-kernel's fused log-prob kernel on GPU)
            log_probs, _ = self.actor.compute_log_prob(data, calculate_entropy=False)
        return DataProto.from_dict(tensors={"old_log_probs": log_probs})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, concurrency_group=TRAIN_GROUP)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        if self.ref is None:
            raise RuntimeError("compute_ref_log_prob needs actor_rollout_ref.actor.use_kl_loss=True")
        with self._resident("ref"), self.phase_peaks.phase("ref"):
            log_probs, _ = self.ref.compute_log_prob(data, calculate_entropy=False)
        return DataProto.from_dict(tensors={"ref_log_prob": log_probs})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRICS, concurrency_group=TRAIN_GROUP)
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """The PPO update; with ``perf/update_generation_overlap_{s,frac}``: how long (and which fraction of it) a
        generation ran on this worker at the same time (``trainer.rollout_overlap``; 0 otherwise)."""
        import time

        t0, busy0 = time.perf_counter(), self.rollout_guard.busy_seconds()
        with self._resident("actor"), self.phase_peaks.phase("update"):
            metrics = self.actor.update_policy(data)
        overlap, seconds = self.rollout_guard.busy_seconds() - busy0, time.perf_counter() - t0
        mfu = update_mfu(self.actor_parameters, int(data.batch["attention_mask"].sum()), seconds, self.peak_flops)
        if mfu is not None:  # this rank's tokens over its update's seconds (verl/utils/flops.py)
            metrics["perf/mfu/actor"] = mfu
        passes = self.training_sms.partitioned_passes  # micro-batches run on the training SMs since the last update
        metrics["perf/micro_batches_on_training_sms"] = float(passes - self._partitioned_seen)
        self._partitioned_seen = passes
        metrics["perf/update_generation_overlap_s"] = overlap
        metrics["perf/update_generation_overlap_frac"] = overlap / seconds if seconds > 0 else 0.0
        metrics.update(self._rollout_time_metrics())
        metrics["actor/lr"] = self.lr_scheduler.get_last_lr()[0]
        metrics.update(memory_metrics(self.device_name, self.phase_peaks))
        if self.conf.rollout.engine_process == "child":  # the engine process's own peaks (not in the above)
            metrics.update(self.rollout.memory_metrics())
        if self.device_name == "cuda":  # activations and the optimizer's staged buckets: free for the rollout engine
            torch.cuda.empty_cache()
        self.lr_scheduler.step()
        return metrics

    def _rollout_time_metrics(self) -> dict[str, float]:
        """Where this worker's generation time went since the previous update: ``perf/rollout/generate_s`` (wall
        seconds with a ``generate`` call in flight here), ``perf/rollout/engine_steps`` and
        ``perf/rollout/engine_step_s`` (the engine's own steps and the seconds inside them, where the engine counts
        them: vLLM in-process, the hf engine). The driver's ``timing_s/gen`` less ``generate_s`` is the driver's
        side (prompts, Ray); ``generate_s`` less ``engine_step_s`` is the engine thread's loop (adding requests,
        collecting outputs, waiting for commands)."""
        busy = self.rollout_guard.busy_seconds()
        counters = self.rollout.step_counters() if self.rollout is not None else None
        steps, step_s = counters if counters is not None else (0, 0.0)
        seen_busy, seen_steps, seen_step_s = self._rollout_time_seen
        self._rollout_time_seen = (busy, steps, step_s)
        metrics = {"perf/rollout/generate_s": busy - seen_busy}
        if counters is not None:
            metrics["perf/rollout/engine_steps"] = float(steps - seen_steps)
            metrics["perf/rollout/engine_step_s"] = step_s - seen_step_s
        return metrics

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group=TRAIN_GROUP)
    def save_checkpoint(self, path: str) -> None:
        from verl.utils.checkpoint import save_model_shards

        with self._resident("actor"):
            save_model_shards(
                path,
                self.actor_module,
                self.optimizer,
                self.lr_scheduler,
                rank=self.rank,
                world_size=self.world_size,
                hf_source_path=self.model_path,
            )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group=TRAIN_GROUP)
    def load_checkpoint(self, path: str) -> None:
        from verl.utils.checkpoint import load_model_shards

        with self._resident("actor"):
            load_model_shards(
                path, self.actor_module, self.optimizer, self.lr_scheduler, rank=self.rank, world_size=self.world_size
            )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shutdown_engines(self) -> None:
        if self.rollout is not None:
            self.rollout.shutdown()
