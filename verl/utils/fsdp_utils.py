"""FSDP2 helpers: sharding, CPU offload, full-weight iteration for weight sync, optimizer and LR schedule.

Sharding (``apply_fsdp2``): ``torch.distributed.fsdp.fully_shard`` on every decoder layer (the classes a
transformers model lists in ``_no_split_modules``) and then on the root module, over the mesh of
``init_fsdp_mesh``: 1-D (plain FSDP, every rank holds a shard) or, with ``fsdp_config.fsdp_size`` dividing the world
size, 2-D ``("ddp", "fsdp")`` = HSDP (parameters sharded within groups of ``fsdp_size`` ranks and replicated across
the groups; FSDP2 reduce-scatters gradients within a group and all-reduces them across groups).
On CUDA the default mixed precision is ``param_dtype=bf16, reduce_dtype=fp32`` (fp32 master weights, bf16
compute, fp32 gradient reduction). The same code path runs on CPU with the gloo backend (verified with torch
2.13: loss and grad norm equal the unsharded model's); there the default is full fp32 precision.

FSDP2 averages gradients over the data-parallel ranks (reduce-scatter with a mean). The actor therefore scales
each micro-batch loss by the DP world size after dividing by the *global* token count (see
``verl.workers.actor.dp_actor``).

Weight sync (``iter_full_params``): yields ``(name, full tensor)`` pairs in buckets of about ``bucket_bytes``,
gathering each DTensor shard with ``full_tensor()``; every rank must iterate (the gathers are collectives).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

__all__ = [
    "is_fsdp2_module",
    "get_decoder_layer_classes",
    "init_dp_mesh",
    "init_fsdp_mesh",
    "apply_fsdp2",
    "offload_fsdp_model_to_cpu",
    "load_fsdp_model_to_gpu",
    "offload_fsdp_optimizer",
    "load_fsdp_optimizer",
    "clean_param_name",
    "iter_full_params",
    "get_full_state_dict",
    "clip_grad_norm",
    "fused_adamw_devices",
    "resolve_fused_adamw",
    "build_optimizer",
    "warmup_lr_lambda",
    "build_lr_scheduler",
    "build_optim_and_scheduler",
]

logger = logging.getLogger(__name__)

# Prefixes added by wrappers (activation checkpointing, torch.compile) that HF / vLLM weight names do not have.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def is_fsdp2_module(module: nn.Module) -> bool:
    """True when ``module`` was wrapped with ``fully_shard`` (FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def get_decoder_layer_classes(model: nn.Module) -> set[str]:
    """Class names of the decoder layers of a transformers model (its ``_no_split_modules``), e.g.
    ``{"Qwen2DecoderLayer"}``; works through peft wrappers. Empty when the model declares none."""
    names: set[str] = set()
    for module in model.modules():
        no_split = getattr(module, "_no_split_modules", None)
        if no_split:
            names.update(no_split)
    return names


def init_dp_mesh(device_type: Optional[str] = None, world_size: Optional[int] = None):
    """1-D device mesh over all ranks of the default process group (``"dp"``); needs ``torch.distributed``."""
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("init_dp_mesh needs torch.distributed to be initialised (dist.init_process_group)")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(device_type, (world_size or dist.get_world_size(),), mesh_dim_names=("dp",))


def init_fsdp_mesh(
    fsdp_size: Optional[int] = -1,
    device_type: Optional[str] = None,
    world_size: Optional[int] = None,
    key: str = "fsdp_config.fsdp_size",
):
    """The sharding mesh for ``fsdp_config.fsdp_size`` (verl's ``create_device_mesh``).

    ``fsdp_size`` < 1 (verl: -1), None or >= the world size: the 1-D mesh of ``init_dp_mesh`` (plain FSDP).
    Otherwise a 2-D mesh ``(world // fsdp_size, fsdp_size)`` named ``("ddp", "fsdp")``: ``fully_shard`` on it
    shards within each row of ``fsdp_size`` consecutive ranks and replicates across rows (HSDP). ``ValueError``
    naming ``key`` when ``fsdp_size`` does not divide the world size.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("init_fsdp_mesh needs torch.distributed to be initialised (dist.init_process_group)")
    world = int(world_size or dist.get_world_size())
    size = int(fsdp_size) if fsdp_size is not None else -1
    if size < 1 or size >= world:
        return init_dp_mesh(device_type, world)
    if world % size != 0:
        raise ValueError(
            f"{key}={size} must divide the number of ranks ({world}): HSDP shards within groups of {key} ranks "
            "and replicates across world/fsdp_size groups; use -1 for plain FSDP over all ranks"
        )
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(device_type, (world // size, size), mesh_dim_names=("ddp", "fsdp"))


def apply_fsdp2(
    model: nn.Module,
    mesh: Any = None,
    param_dtype: Union[torch.dtype, str, None] = "auto",
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    offload_params: bool = False,
    layer_classes: Optional[Iterable[str]] = None,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2: each decoder layer, then the root (embeddings, final norm, lm_head).

    Args:
        model: the (maybe peft-wrapped) transformers model, with parameters on CPU or on the target device.
        mesh: a 1-D ``DeviceMesh`` (FSDP) or a 2-D one (HSDP: replicate over dim 0, shard over dim 1), see
            ``init_fsdp_mesh``; default ``init_dp_mesh()``.
        param_dtype: compute dtype of the gathered parameters; ``"auto"`` = bf16 on CUDA, unchanged on CPU;
            ``None`` = unchanged.
        reduce_dtype: gradient reduction dtype (when ``param_dtype`` is set).
        reshard_after_forward: free the gathered layer parameters after forward (ZeRO-3 style).
        offload_params: keep sharded parameters and gradients on CPU (``CPUOffloadPolicy``; CUDA only).
        layer_classes: class names to shard individually; default ``get_decoder_layer_classes(model)``.
    Returns the same (now sharded) module.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = mesh if mesh is not None else init_dp_mesh()
    on_cuda = mesh.device_type == "cuda"
    if param_dtype == "auto":
        param_dtype = torch.bfloat16 if on_cuda else None
    if isinstance(param_dtype, str):
        from verl.utils.model_loading import resolve_dtype

        param_dtype = resolve_dtype(param_dtype)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype if param_dtype else None)
    if offload_params and not on_cuda:
        logger.warning("offload_params ignored: parameters already live on CPU")
    offload_policy = CPUOffloadPolicy() if offload_params and on_cuda else OffloadPolicy()
    kwargs = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    classes = set(layer_classes) if layer_classes is not None else get_decoder_layer_classes(model)
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    if not layers:
        logger.warning("apply_fsdp2: no decoder layers of classes %s found; sharding only the root", sorted(classes))
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    return model


def reshard_fsdp(module: nn.Module) -> None:
    """Free the gathered (unsharded) parameters every FSDP2 unit of ``module`` still holds: with
    ``reshard_after_forward=False`` a forward-only pass leaves them allocated (a backward reshards them); a no-op for
    units already resharded and for modules without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def offload_fsdp_model_to_cpu(model: nn.Module, empty_cache: bool = True) -> None:
    """Move the (sharded) parameters and gradients of ``model`` to CPU, e.g. while the rollout engine runs."""
    model.cpu()
    if empty_cache and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def load_fsdp_model_to_gpu(model: nn.Module, device: Union[str, torch.device, None] = None) -> None:
    """Move the (sharded) parameters of ``model`` back to ``device`` (default: the current CUDA device)."""
    model.to(device or _default_device())


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: Union[str, torch.device]) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)


def offload_fsdp_optimizer(optimizer: Optional[torch.optim.Optimizer]) -> None:
    """Move the optimizer state (Adam moments) to CPU, tensor by tensor.

    From CUDA each ``to("cpu", non_blocking=True)`` allocates pinned memory through torch's caching host allocator,
    which rounds every allocation up to a power of two: up to twice the state in host memory (nearly 2x at the
    Qwen2.5-7B shape). The actor's ``optimizer_offload`` therefore uses ``OffloadedAdamW``
    (``verl/utils/offload_optim.py``), whose state never leaves the host; this function is for other optimizers."""
    if optimizer is None or not optimizer.state:
        return
    _move_optimizer_state(optimizer, "cpu")
    if torch.cuda.is_initialized():  # the non-blocking copies must land before the GPU memory is reused
        torch.cuda.synchronize()


def load_fsdp_optimizer(
    optimizer: Optional[torch.optim.Optimizer], device: Union[str, torch.device, None] = None
) -> None:
    """Move the optimizer state back to ``device`` (default: the current CUDA device)."""
    if optimizer is None or not optimizer.state:
        return
    _move_optimizer_state(optimizer, device or _default_device())


def clean_param_name(name: str) -> str:
    """Strip wrapper prefixes (activation checkpointing, torch.compile) from a parameter name."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def iter_full_params(
    model: nn.Module,
    bucket_bytes: int = 512 << 20,
    dtype: Optional[torch.dtype] = None,
    device: Union[str, torch.device] = "cpu",
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets (lists) of ``(name, full tensor)`` covering ``model.state_dict()``.

    Sharded tensors are all-gathered one at a time (every rank must run the loop), cast to ``dtype`` if given,
    moved to ``device`` and grouped until a bucket reaches ``bucket_bytes``. Names are cleaned with
    ``clean_param_name``; peft-wrapped models keep their peft names (merge adapters before syncing them into a
    rollout engine).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in model.state_dict().items():
        full = _full_tensor(tensor).detach()
        if dtype is not None and full.is_floating_point():
            full = full.to(dtype)
        full = full.to(device)
        bucket.append((clean_param_name(name), full))
        size += full.numel() * full.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def get_full_state_dict(
    model: nn.Module, dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cpu"
) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on every rank, as plain tensors (a collective under FSDP)."""
    state: dict[str, torch.Tensor] = {}
    for bucket in iter_full_params(model, dtype=dtype, device=device):
        state.update(bucket)
    return state


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: Optional[float]) -> float:
    """Total L2 norm of the gradients (over all shards and ranks under FSDP2), clipping to ``max_norm`` when
    it is set and > 0. Returns the norm before clipping as a float (``inf``/``nan`` when not finite)."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    clip_to = float(max_norm) if max_norm is not None and max_norm > 0 else float("inf")
    total = torch.nn.utils.clip_grad_norm_(params, clip_to)
    return float(_full_tensor(total).item())


def fused_adamw_devices() -> list[str]:
    """Device types on which the installed torch has a fused AdamW kernel (torch 2.13: cuda, cpu, mps, xpu, ...)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return list(_get_fused_kernels_supported_devices())


def resolve_fused_adamw(
    fused: Optional[bool], device_types: Iterable[str], offload: bool = False, key: str = "optim.fused"
) -> bool:
    """Whether AdamW runs torch's fused kernel (``optim.fused``; the worker and the driver's memory estimate both
    decide with this). ``None``: fused when every trainable parameter is on CUDA, torch's default (foreach on CUDA)
    otherwise; ``True``: fused, an error naming ``key`` when a parameter's device has no fused kernel; ``False``:
    torch's default. With ``offload`` (``fsdp_config.optimizer_offload``) the optimizer is ``OffloadedAdamW`` with its
    own streamed step: ``None`` resolves to False and ``True`` is an error.

    Fused instead of foreach: no full-size fp32 temporary in the step (foreach's ``torch._foreach_sqrt(exp_avg_sqs)``,
    4 bytes per trainable parameter) and a few kernels instead of many foreach launches."""
    if fused is not None and not isinstance(fused, bool):
        raise ValueError(f"{key} must be True, False or null (got {fused!r})")
    if offload:
        if fused:
            raise ValueError(
                f"{key}=True does not apply with fsdp_config.optimizer_offload=True (OffloadedAdamW streams the state "
                f"through its own step); set {key}=null or False"
            )
        return False
    types = set(device_types)
    if fused is None:
        return types == {"cuda"}
    if fused:
        unsupported = sorted(types - set(fused_adamw_devices()))
        if unsupported:
            raise ValueError(
                f"{key}=True but torch {torch.__version__} has no fused AdamW for parameters on {unsupported} "
                f"(fused devices: {fused_adamw_devices()}); set {key}=null or False"
            )
    return fused


def build_optimizer(
    params: Union[nn.Module, Iterable[nn.Parameter]],
    lr: float,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    offload: bool = False,
    fused: Optional[bool] = None,
    key: str = "optim.fused",
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of a module (or over the given parameters); with ``offload`` the
    :class:`~verl.utils.offload_optim.OffloadedAdamW` whose state stays in host memory and streams through the
    device bucket by bucket during the step (``fsdp_config.optimizer_offload``). ``fused`` (the config key ``key``):
    torch's fused AdamW, resolved by :func:`resolve_fused_adamw` from the parameters' devices; otherwise torch's
    default implementation (``fused=None``: foreach on CUDA; passing ``fused=False`` would force the slower
    per-tensor loop). The implementation chosen here survives ``load_state_dict`` (a checkpoint's param groups
    carry the ``fused``/``foreach`` flags of the run that wrote it)."""
    if isinstance(params, nn.Module):
        params = [p for p in params.parameters() if p.requires_grad]
    params = list(params)
    if not params:
        raise ValueError("build_optimizer: no trainable parameters")
    use_fused = resolve_fused_adamw(fused, _device_types(params), offload=offload, key=key)
    if offload:
        from verl.utils.offload_optim import OffloadedAdamW

        optimizer = OffloadedAdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)
    else:
        optimizer = torch.optim.AdamW(
            params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps, fused=True if use_fused else None
        )
    optimizer.register_load_state_dict_post_hook(_keep_implementation(optimizer))
    return optimizer


def _device_types(params: list[nn.Parameter]) -> set[str]:
    """Device types of the parameters (under FSDP2 those of their local shards: a DTensor's device)."""
    return {p.device.type for p in params}


def _keep_implementation(optimizer: torch.optim.Optimizer):
    """A ``load_state_dict`` post-hook restoring each group's ``fused``/``foreach`` as built (a loaded state dict
    replaces the groups' hyper-parameters with the saved ones) and placing a plain AdamW's ``step`` where that
    implementation keeps it: float32 on the parameter's device for fused, on the host otherwise."""
    built = [(group.get("fused"), group.get("foreach")) for group in optimizer.param_groups]
    plain = type(optimizer) is torch.optim.AdamW

    def restore(opt: torch.optim.Optimizer) -> None:
        for group, (fused, foreach) in zip(opt.param_groups, built):
            group["fused"], group["foreach"] = fused, foreach
            if not plain or group.get("capturable"):
                continue
            for p in group["params"]:
                step = opt.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    opt.state[p]["step"] = step.to(device=p.device, dtype=torch.float32) if fused else step.to("cpu")

    return restore


def warmup_lr_lambda(
    num_warmup_steps: int, warmup_style: str = "constant", total_training_steps: int = 0, min_lr_ratio: float = 0.0
):
    """LR multiplier for scheduler step ``s`` (0-based; step ``s`` is the ``s``-th ``scheduler.step()``).

    Warm-up: ``(s + 1) / W`` for ``s < W`` (the first update already uses ``lr / W``; verl's ``s / W`` spends the
    first training step at lr 0), then 1.0 (``constant``; ``min_lr_ratio`` unused, as in verl) or verl's
    ``get_cosine_schedule_with_warmup`` with half a cycle (``cosine``):
    ``min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + cos(pi * p))`` with ``p = (s - W) / (total_training_steps - W)``,
    i.e. 1.0 right after warm-up down to the floor ``min_lr_ratio`` at ``total_training_steps``, where it stays.

    Example: ``W = 4`` -> multipliers ``0.25, 0.5, 0.75, 1.0, 1.0, ...``; ``cosine``, ``W = 0``, 4 total steps,
    ``min_lr_ratio = 0.2`` -> ``1.0, 0.8828, 0.6, 0.3172, 0.2, 0.2, ...``.
    """
    if warmup_style not in ("constant", "cosine"):
        raise ValueError(f"unknown optim.warmup_style '{warmup_style}'; valid: constant, cosine")
    min_lr_ratio = float(min_lr_ratio or 0.0)
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    warmup = max(0, int(num_warmup_steps))
    if warmup_style == "cosine" and int(total_training_steps) < 1:
        raise ValueError(
            f"optim.warmup_style=cosine needs optim.total_training_steps >= 1 (got {total_training_steps}); "
            "the trainer sets it from the dataloader length x trainer.total_epochs or trainer.total_training_steps"
        )

    def lr_lambda(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if warmup_style == "constant":
            return 1.0
        decay_steps = max(1, total_training_steps - warmup)
        progress = min(1.0, (step - warmup) / decay_steps)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return lr_lambda


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    total_training_steps: int = 0,
    lr_warmup_steps: Optional[int] = -1,
    lr_warmup_steps_ratio: float = 0.0,
    warmup_style: str = "constant",
    min_lr_ratio: Optional[float] = 0.0,
) -> LambdaLR:
    """LambdaLR with linear warm-up (verl keys): ``lr_warmup_steps >= 0`` wins (0 = no warm-up), a negative
    value (or None) means ``int(lr_warmup_steps_ratio * total_training_steps)``. Call ``scheduler.step()`` once
    per training step."""
    if lr_warmup_steps is not None and int(lr_warmup_steps) >= 0:
        num_warmup = int(lr_warmup_steps)
    else:
        num_warmup = int(float(lr_warmup_steps_ratio or 0.0) * total_training_steps)
    return LambdaLR(optimizer, warmup_lr_lambda(num_warmup, warmup_style, total_training_steps, min_lr_ratio or 0.0))


def build_optim_and_scheduler(module: nn.Module, optim: Any, offload: bool = False):
    """AdamW and its LR schedule from an ``optim`` section (:class:`~verl.workers.config.OptimizerConfig`: ``lr``,
    ``weight_decay``, ``betas``, ``total_training_steps``, ``lr_warmup_steps``, ``lr_warmup_steps_ratio``,
    ``warmup_style``, ``min_lr_ratio``, ``fused``; a mapping is read as the actor's section), shared by the actor and
    the critic workers so that every key reaches both. ``offload``: host-resident AdamW state (``build_optimizer``)."""
    from verl.workers.config.optimizer import OptimizerConfig

    optim = OptimizerConfig.from_config(optim)
    optimizer = build_optimizer(
        module,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=tuple(optim.betas),
        offload=offload,
        fused=optim.fused,
        key=f"{optim.SECTION}.fused",
    )
    scheduler = build_lr_scheduler(
        optimizer,
        total_training_steps=optim.total_training_steps,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_warmup_steps_ratio=optim.lr_warmup_steps_ratio,
        warmup_style=optim.warmup_style,
        min_lr_ratio=optim.min_lr_ratio,
    )
    return optimizer, scheduler
