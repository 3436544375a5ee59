"""Start-up memory check of the trainer (``trainer.memory_check``): read the model's ``config.json``, print the
per-rank estimate of ``verl/utils/memory_estimate.py``, refuse (or warn about) a GPU run that cannot fit, and hint at
less gradient checkpointing (``checkpointing_hint``) or, for a small model, larger micro-batches
(``micro_batch_hint``) when more memory is free."""

from __future__ import annotations

import copy
import logging
import math
import os
from dataclasses import replace
from typing import Any, Optional

from omegaconf import OmegaConf

from verl.utils.memory_estimate import (
    MemoryCheckError,
    MemoryEstimate,
    MemoryPlan,
    ModelShape,
    _gib,
    estimate_memory,
    plan_from_config,
)

logger = logging.getLogger(__name__)

__all__ = [
    "MEMORY_CHECK_MODES",
    "CHECKPOINTING_HINT_SHARE",
    "MICRO_BATCH_HINT_WORK",
    "estimate_with_budgets",
    "startup_memory_check",
    "device_capacities",
]

MEMORY_CHECK_MODES = ("error", "warn", "off")
MODEL = "actor_rollout_ref.model"


def _hf_config(model_cfg: Any) -> Any:
    """The actor model's transformers config as the workers load it (``model_loading.load_model_config``)."""
    from verl.utils.model_loading import load_model_config

    return load_model_config(
        os.path.expanduser(str(model_cfg.get("path"))),
        bool(model_cfg.get("trust_remote_code", False)),
        dict(model_cfg.get("override_config") or {}),
    )


def device_capacities(device: str) -> tuple[Optional[int], Optional[int]]:
    """``(GPU bytes or None, host RAM bytes)``. The GPU's total memory (what vLLM's ``gpu_memory_utilization`` is a
    fraction of; the smallest GPU when they differ) comes from ``nvidia-smi`` so that the driver process creates no
    CUDA context on a GPU its workers need; without it, from ``torch.cuda.get_device_properties(0)``."""
    import shutil
    import subprocess

    import psutil

    gpu = None
    if device == "cuda":
        smi = shutil.which("nvidia-smi")
        if smi:
            try:
                out = subprocess.run(
                    [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=True,
                ).stdout
                gpu = min(int(float(line)) for line in out.split() if line.strip()) * 2**20  # MiB
            except (subprocess.SubprocessError, OSError, ValueError):
                gpu = None
        if gpu is None:
            import torch

            gpu = int(torch.cuda.get_device_properties(0).total_memory)
    return gpu, int(psutil.virtual_memory().total)


def startup_memory_check(cfg: Any, device: str, capacities: Optional[tuple[Optional[int], Optional[int]]] = None):
    """Print the per-rank estimate and, on a GPU with ``trainer.memory_check=error``, raise
    :class:`MemoryCheckError` when the config cannot fit (``warn``: log the reasons; ``off``: do nothing).
    On a CPU run the table is printed and nothing is checked. Returns the estimate (None when off)."""
    mode = cfg.trainer.get("memory_check", "error")
    mode = "off" if mode is False else str(mode)  # YAML reads a bare `off` as False
    if mode not in MEMORY_CHECK_MODES:
        raise ValueError(f"trainer.memory_check must be one of {list(MEMORY_CHECK_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    try:
        hf_config = _hf_config(cfg.actor_rollout_ref.model)
        shape = ModelShape.from_hf_config(hf_config)
    except Exception as exc:  # the model loader reports a bad path properly; the estimate is advisory here
        logger.warning("memory estimate skipped: cannot read the model config (%s)", exc)
        return None
    gpu, host = capacities if capacities is not None else device_capacities(device)
    plan = replace(
        plan_from_config(cfg, device), liger=liger_in_workers(cfg.actor_rollout_ref.model, device, hf_config)
    )
    est = estimate_memory(shape, plan, gpu if device == "cuda" else None, host)
    print(est.format_table(f"trainer.memory_check={mode}" + ("" if device == "cuda" else ", CPU run: not checked")))
    problems = est.problems() if device == "cuda" else []
    if problems and mode == "error":
        raise MemoryCheckError("the config does not fit in memory:\n- " + "\n- ".join(problems))
    for problem in problems:
        logger.warning("memory check: %s", problem)
    if device == "cuda" and not problems:
        for hint in (checkpointing_hint(est), micro_batch_hint(cfg, est)):
            if hint:
                print(hint)
    return est


def liger_in_workers(model_cfg: Any, device: str, hf_config: Any) -> bool:
    """Whether the actor's workers will run liger-kernel's kernels (``model.use_liger``): what
    ``verl.utils.liger.resolve_use_liger`` decides for them (null: CUDA, liger importable, no compile_layers, a model
    type liger patches), and an explicit True only where ``apply_liger_kernel`` does not skip it. Nothing is logged
    (the workers log their choice)."""
    from verl.utils.liger import unsupported

    if model_cfg.get("use_liger") is False:
        return False
    return not unsupported(device, hf_config, bool(model_cfg.get("compile_layers", False)))


# Largest share of the device the estimated peak with less checkpointing may take for that to be suggested: the
# estimate ran ~10% under the measured peak of the 1.5B step (benchmarks/RESULTS.md, 2026-12-03)
CHECKPOINTING_HINT_SHARE = 0.8


def checkpointing_hint(est: MemoryEstimate) -> str:
    """A line suggesting less gradient checkpointing when the config has it on, or ``""``. Checkpointing recomputes
    each checkpointed layer's forward in the backward: the 1.5B update did 19% (liger) to 31% more tokens/s without it
    (RESULTS.md). A variant "fits" when it is estimated to peak under ``CHECKPOINTING_HINT_SHARE`` of the GPU:

    * ``enable_gradient_checkpointing=False`` when that fits;
    * else ``gradient_checkpointing_every=N`` for the largest N that fits (fewest layers checkpointed), written as
      the smallest N that checkpoints as many layers (the same memory, spread evenly: ``ceil(L / ceil(L / N))``),
      when it checkpoints fewer layers than the config's N."""
    p, cap = est.plan, est.gpu_capacity
    if not p.gradient_checkpointing or not cap:
        return ""

    def peak_if_it_fits(plan: MemoryPlan) -> Optional[tuple[str, float]]:
        variant = estimate_memory(est.shape, plan, cap)
        phase, peak = variant.gpu_peak
        return None if variant.problems() or peak > CHECKPOINTING_HINT_SHARE * cap else (phase, peak)

    fit = peak_if_it_fits(replace(p, gradient_checkpointing=False))
    if fit:
        return (
            f"  hint: {MODEL}.enable_gradient_checkpointing=False is estimated to fit (peak {_gib(fit[1])} "
            f"({fit[0]}), {fit[1] / cap:.0%} of the device): the update skips the recomputed forward (19-31% more "
            "update tokens/s at 1.5B, benchmarks/RESULTS.md)"
        )
    layers, now = est.shape.num_layers, max(1, p.gradient_checkpointing_every)
    for every in range(layers, now, -1):
        fit = peak_if_it_fits(replace(p, gradient_checkpointing_every=every))
        if fit:
            checkpointed = math.ceil(layers / every)
            if checkpointed >= math.ceil(layers / now):
                return ""
            return (
                f"  hint: {MODEL}.gradient_checkpointing_every={math.ceil(layers / checkpointed)} is estimated to fit "
                f"(peak {_gib(fit[1])} ({fit[0]}), {fit[1] / cap:.0%} of the device; {checkpointed} of {layers} "
                "decoder layers checkpointed, the others skip the recomputed forward; without checkpointing it would "
                f"pass {CHECKPOINTING_HINT_SHARE:.0%} of the device)"
            )
    return ""


# Work of one update micro-batch (parameters x ``actor.ppo_max_token_len_per_gpu`` tokens) under which the passes are
# bound by per-call and per-layer overheads rather than their matmuls (benchmarks/RESULTS.md, 2026-12-03): the 135M
# update at 64K tokens (8.8e12) ran at 16.8% MFU, 2.8x its tokens/s at 16K; the 1.5B at 16K (2.5e13) at 35.6%
MICRO_BATCH_HINT_WORK = 10**13
BUDGET_KEY = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
LOG_PROB_BUDGET_KEYS = (
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
)


def estimate_with_budgets(cfg: Any, est: MemoryEstimate, budget: int, log_prob: int, **plan: Any) -> MemoryEstimate:
    """The estimate of ``cfg`` (whose start-up estimate is ``est``) with ``budget`` tokens per update micro-batch
    and ``log_prob`` per log-prob micro-batch (both passes), liger as resolved for ``est``, and ``plan``'s
    :class:`~verl.utils.memory_estimate.MemoryPlan` fields replaced."""
    variant = copy.deepcopy(cfg)
    for key, value in ((BUDGET_KEY, budget), *((k, log_prob) for k in LOG_PROB_BUDGET_KEYS)):
        OmegaConf.update(variant, key, value, merge=False)
    return estimate_memory(
        est.shape, replace(plan_from_config(variant), liger=est.plan.liger, **plan), est.gpu_capacity
    )


def micro_batch_hint(cfg: Any, est: MemoryEstimate) -> str:
    """A line suggesting a larger token budget per micro-batch for a small model, or ``""``. At small micro-batches
    a small model's passes are bound by per-call overheads (the 135M update: 2.8x the tokens/s at 64K tokens per
    micro-batch than at 16K, its log-prob pass 2.1x at 128K than at 32K; RESULTS.md). Suggested when all hold:

    * ``actor.use_dynamic_bsz`` is on and the GPU's size is known (a CUDA run);
    * the model is small for its budget: ``num_params x ppo_max_token_len_per_gpu < MICRO_BATCH_HINT_WORK`` (the
      135M up to 64K tokens, not the 1.5B at 16K). Not a share of the estimate: without checkpointing the 135M's
      activations are a larger part of its estimate than the 1.5B's with it;
    * the largest of 8x, 4x, 2x the budget, with both log-prob budgets at twice it (as the launch scripts set them;
      never lowered), is estimated with checkpointing as configured to peak under ``CHECKPOINTING_HINT_SHARE`` of the
      GPU. Each hint is estimated alone: with the checkpointing hint as well, the start-up check re-estimates."""
    actor, cap = cfg.actor_rollout_ref.actor, est.gpu_capacity
    now = int(actor.get("ppo_max_token_len_per_gpu") or 16384)
    if not actor.get("use_dynamic_bsz") or not cap or est.shape.num_params * now >= MICRO_BATCH_HINT_WORK:
        return ""
    log_prob_now = int(cfg.actor_rollout_ref.rollout.get("log_prob_max_token_len_per_gpu") or now)
    for factor in (8, 4, 2):
        budget, log_prob = factor * now, max(2 * factor * now, log_prob_now)
        phase, peak = estimate_with_budgets(cfg, est, budget, log_prob).gpu_peak
        if peak <= CHECKPOINTING_HINT_SHARE * cap:  # then nothing overflows (no host capacity given)
            keys = " ".join(f"{k}={log_prob}" for k in LOG_PROB_BUDGET_KEYS)
            ckpt = ", with gradient checkpointing on as configured" if est.plan.gradient_checkpointing else ""
            return (
                f"  hint: {BUDGET_KEY}={budget} {keys} is estimated to fit (peak {_gib(peak)} ({phase}), {peak / cap:.0%} "
                f"of the device; now {now}{ckpt}): small models run faster with larger micro-batches (the 135M update "
                "2.8x the tokens/s at 64K tokens than at 16K, benchmarks/RESULTS.md)"
            )
    return ""
