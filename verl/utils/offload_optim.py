"""AdamW whose moments live in host memory and stream through the device one bucket at a time (optimizer offload).

``actor_rollout_ref.actor.fsdp_config.optimizer_offload=True`` builds :class:`OffloadedAdamW` instead of
``torch.optim.AdamW``. Between steps every state tensor (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with
amsgrad, and ``step``) is on the host: one flat buffer per moment and dtype of exactly the state's size (this rank's
shards under FSDP2), page-locked where CUDA exists, allocated once when the optimizer is built and written in place
ever after. ``step()`` walks the parameters in buckets of about ``bucket_bytes`` of state: it copies a bucket's
slice of the flat buffers to the parameters' device (a side CUDA stream, ``non_blocking``, prefetching bucket
``k + 1`` while bucket ``k`` computes), runs torch's own AdamW step (``torch.optim.AdamW.step``: foreach or fused as
configured) on the bucket's parameters only, and copies the updated moments back. Device memory at the step is the
parameters and gradients plus at most three buckets (one computing, one arriving, one leaving; a bucket is at most
``max(bucket_bytes, the largest tensor's state)``, ``streamed_peak_bytes``); host memory is the state. The numbers are those of ``torch.optim.AdamW`` on the same gradients (AdamW is element-wise; the bucket only
decides which tensors one foreach call sees). On a CPU-only machine the "device" is the host and the copies are
plain copies, so the code path is the one a GPU run takes.

Why not ``tensor.to("cpu", non_blocking=True)`` per state tensor (what ``offload_fsdp_optimizer`` does): from CUDA
that allocates the destination through torch's caching pinned-host allocator, which rounds each allocation up to the
next power of two and keeps it cached (``CachingHostAllocator``; ``pinned_max_round_threshold_mb`` unset). For the
Qwen2.5-7B shape the MLP weights are 18944 x 3584 fp32 = 271.6 MB, just over 2**28, so their moments take 537 MB each
and the whole Adam state (60.9 GB) takes 115.8 GB (1.9x) of pinned host memory (``pinned_bytes_of_per_tensor_offload``),
and the update still brings all of it back to the GPU at once. Here the flat buffers are allocated pageable with
their exact size and page-locked with ``cudaHostRegister`` (unregistered when the optimizer is collected).

Checkpoints: ``state_dict()`` returns the host tensors (DTensors over host shards under FSDP2, as ``torch.distributed
.checkpoint`` expects); ``load_state_dict`` copies values into the host buffers instead of moving them to the
parameters' device.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any, Optional

import torch
from torch import nn

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "OffloadedAdamW",
    "plan_buckets",
    "streamed_peak_bytes",
    "pinned_bytes_of_per_tensor_offload",
    "host_state_bytes",
]

logger = logging.getLogger(__name__)

# State bytes (all moments together) per bucket streamed through the device; the device holds up to three.
DEFAULT_BUCKET_BYTES = 256 << 20


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """Index ranges ``[start, end)`` of consecutive tensors (state bytes ``sizes``) that form the buckets: a bucket
    closes before a tensor that would take it past ``bucket_bytes``, so each is at most ``max(bucket_bytes, the
    largest single tensor)``. Shared by :class:`OffloadedAdamW` and the memory estimate."""
    out: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        if i > start and acc + size > bucket_bytes:
            out.append((start, i))
            start, acc = i, 0
        acc += size
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


def streamed_peak_bytes(sizes: list[int], bucket_bytes: int, temp_fraction: float = 0.5) -> int:
    """The most device bytes the step holds for the state: a bucket computing, the next one arriving and the previous
    one leaving, plus ``temp_fraction`` of the computing bucket (AdamW's foreach ``sqrt(exp_avg_sq)``: half of a
    two-moment bucket)."""
    buckets = [sum(sizes[a:b]) for a, b in plan_buckets(sizes, bucket_bytes)]
    peak = 0.0
    for k, size in enumerate(buckets):
        around = (buckets[k - 1] if k > 0 else 0) + (buckets[k + 1] if k + 1 < len(buckets) else 0)
        peak = max(peak, size * (1 + temp_fraction) + around)
    return int(peak)


def pinned_bytes_of_per_tensor_offload(numels: Iterable[int], bytes_per_element: int = 4, moments: int = 2) -> int:
    """Pinned host bytes that ``tensor.to("cpu", non_blocking=True)`` of every moment of every parameter takes under
    torch's default caching host allocator (each allocation rounded up to a power of two)."""
    total = 0
    for n in numels:
        nbytes = int(n) * bytes_per_element
        total += moments * (1 << (nbytes - 1).bit_length() if nbytes > 0 else 0)
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's shard) as the same kind of tensor as ``param``: a DTensor with the parameter's spec
    (mesh, placements, global shape) when the parameter is one, as ``torch.zeros_like(param)`` gives, else ``local``.

    Built with the DTensor constructor as FSDP2 builds its sharded parameters (``_from_local_no_grad``), not with
    ``DTensor.from_local``, which moves a CPU local tensor to the mesh's device (a CUDA copy of the host state)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return DTensor(local, param._spec, requires_grad=False)
    return local


def _unhooked_adamw_step():
    """``torch.optim.AdamW.step`` without the profiling/hook wrapper ``Optimizer._patch_step_function`` may have put
    around it: the per-bucket calls must not run the optimizer's step hooks once per bucket."""
    fn = torch.optim.AdamW.step
    while getattr(fn, "hooked", False):
        fn = fn.__wrapped__
    return fn


class _HostBuffers:
    """Flat host tensors of exact size, page-locked with ``cudaHostRegister`` when CUDA is available (kept alive
    until unregistered, so registered memory is never freed)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.registered: list[torch.Tensor] = []
        self._finalizer = weakref.finalize(self, _unregister, self.registered)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(numel, dtype=dtype)
        self.tensors.append(t)
        if torch.cuda.is_available() and numel > 0:
            err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            if int(err) == 0:
                self.registered.append(t)
            else:  # still correct, only the copies are synchronous
                logger.warning(
                    "cudaHostRegister of %d bytes failed (%s): optimizer state stays pageable", t.nbytes, err
                )
        return t


def _unregister(tensors: list[torch.Tensor]) -> None:
    try:
        cudart = torch.cuda.cudart()
        for t in tensors:
            cudart.cudaHostUnregister(t.data_ptr())
    except Exception:  # interpreter shutdown: the process frees everything anyway
        pass
    tensors.clear()


@dataclass
class _Bucket:
    dtype: torch.dtype
    start: int
    end: int
    params: list[nn.Parameter]


class _Stager:
    """Copies bucket slices host -> device and back: a side stream with events on CUDA, plain copies elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def fetch(self, host: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        if self.stream is None:
            return [h.clone() for h in host], None
        with torch.cuda.stream(self.stream):  # after this stream's earlier write-backs
            staged = [h.to(self.device, non_blocking=True) for h in host]
        return staged, self.stream.record_event()

    def ready(self, staged: list[torch.Tensor], event: Any) -> None:
        if self.stream is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            for t in staged:  # allocated on the side stream, used on the compute stream
                t.record_stream(compute)

    def store(self, host: list[torch.Tensor], staged: list[torch.Tensor]) -> None:
        if self.stream is None:
            for h, s in zip(host, staged):
                h.copy_(s)
            return
        self.stream.wait_event(torch.cuda.current_stream(self.device).record_event())
        with torch.cuda.stream(self.stream):
            for h, s in zip(host, staged):
                h.copy_(s, non_blocking=True)

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # the host buffers hold the new state when step() returns


class OffloadedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with host-resident state streamed through the device per bucket (module docstring).

    Takes AdamW's arguments plus ``bucket_bytes`` (state bytes per bucket, all moments together). ``differentiable``
    is not supported.
    """

    def __init__(self, params: Any, *args: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **kwargs: Any):
        super().__init__(params, *args, **kwargs)
        if bucket_bytes <= 0:
            raise ValueError(f"OffloadedAdamW: bucket_bytes must be > 0, got {bucket_bytes}")
        if any(g["differentiable"] for g in self.param_groups):
            raise ValueError("OffloadedAdamW does not support differentiable=True")
        self.bucket_bytes = int(bucket_bytes)
        self._keys = ("exp_avg", "exp_avg_sq") + (
            ("max_exp_avg_sq",) if any(g["amsgrad"] for g in self.param_groups) else ()
        )
        self._host_buffers = _HostBuffers()
        self._flat: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._offset: dict[int, tuple[torch.dtype, int, int]] = {}  # id(param) -> (dtype, start, end)
        self._buckets: list[_Bucket] = []
        self._stagers: dict[torch.device, _Stager] = {}
        self._layout()
        self._install_host_state()

    # ---------------------------------------------------------------------------------------------- layout
    def _params(self) -> list[nn.Parameter]:
        return list(chain.from_iterable(g["params"] for g in self.param_groups))

    def _layout(self) -> None:
        params = self._params()
        dtypes = list(dict.fromkeys(_local(p).dtype for p in params))
        for dtype in dtypes:
            members = [p for p in params if _local(p).dtype == dtype]
            element = torch.empty((), dtype=dtype).element_size() * len(self._keys)
            offsets = [0]
            for p in members:
                n = _local(p).numel()
                self._offset[id(p)] = (dtype, offsets[-1], offsets[-1] + n)
                offsets.append(offsets[-1] + n)
            sizes = [(offsets[i + 1] - offsets[i]) * element for i in range(len(members))]
            for a, b in plan_buckets(sizes, self.bucket_bytes):
                self._buckets.append(_Bucket(dtype, offsets[a], offsets[b], members[a:b]))
            for key in self._keys:
                self._flat[(key, dtype)] = self._host_buffers.zeros(offsets[-1], dtype)

    def _views(self, flats: dict[str, torch.Tensor], base: int, p: nn.Parameter) -> dict[str, torch.Tensor]:
        """The state tensors of ``p`` as views of ``flats`` (one flat tensor per key starting at offset ``base``)."""
        _, start, end = self._offset[id(p)]
        shape = _local(p).shape
        return {key: _like_param(flat[start - base : end - base].view(shape), p) for key, flat in flats.items()}

    def _install_host_state(self) -> None:
        """``self.state[p]`` = host views (and a host ``step`` that is 0 until the first step: AdamW's lazy
        initialisation, done eagerly so that the host memory is taken once, when the optimizer is built)."""
        for p in self._params():
            dtype = self._offset[id(p)][0]
            state = self.state[p]
            step = state.get("step")
            state.update(self._views({k: self._flat[(k, dtype)] for k in self._keys}, 0, p))
            state["step"] = step if step is not None else torch.zeros((), dtype=_step_dtype())

    def host_state_bytes(self) -> int:
        """Bytes of the host buffers (the whole optimizer state but the scalar steps)."""
        return sum(t.numel() * t.element_size() for t in self._flat.values())

    def is_pinned(self) -> bool:
        """True when every host buffer is page-locked (False on a machine without CUDA)."""
        return torch.cuda.is_available() and all(t.is_pinned() for t in self._flat.values() if t.numel())

    # ---------------------------------------------------------------------------------------------- the step
    def _stage_step(self, group: dict) -> bool:
        """Whether AdamW keeps ``step`` on the parameter's device (fused or capturable) rather than on the host."""
        return bool(group.get("fused") or group.get("capturable"))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        group_of = {id(p): g for g in groups for p in g["params"]}
        buckets = [b for b in self._buckets if any(p.grad is not None for p in b.params)]
        if not buckets:
            return loss
        adamw_step = _unhooked_adamw_step()
        device = buckets[0].params[0].device
        stager = self._stagers.get(device)
        if stager is None:  # one side stream per device for the optimizer's life
            stager = self._stagers[device] = _Stager(device)
        pending = self._fetch(stager, buckets[0])
        try:
            for index, bucket in enumerate(buckets):
                staged, event = pending
                stager.ready(list(staged.values()), event)
                if index + 1 < len(buckets):  # prefetch the next bucket while this one computes
                    pending = self._fetch(stager, buckets[index + 1])
                host_state = {}
                for p in bucket.params:
                    state = self.state[p]
                    host_state[id(p)] = dict(state)
                    state.update(self._views(staged, bucket.start, p))
                    if self._stage_step(group_of[id(p)]):
                        state["step"] = state["step"].to(p.device, torch.float32)
                live = {id(p) for p in bucket.params if p.grad is not None}
                self.param_groups = [
                    {**g, "params": [p for p in g["params"] if id(p) in live]}
                    for g in groups
                    if any(id(p) in live for p in g["params"])
                ]
                try:
                    adamw_step(self)
                finally:
                    self.param_groups = groups
                for p in bucket.params:
                    state, host = self.state[p], host_state[id(p)]
                    step = state["step"]
                    state.update(host)
                    state["step"] = step.to("cpu") if step.device.type != "cpu" else step
                stager.store(
                    [self._flat[(k, bucket.dtype)][bucket.start : bucket.end] for k in self._keys],
                    list(staged.values()),
                )
        finally:
            self.param_groups = groups
            stager.finish()
        return loss

    def _fetch(self, stager: _Stager, bucket: _Bucket) -> tuple[dict[str, torch.Tensor], Any]:
        host = [self._flat[(k, bucket.dtype)][bucket.start : bucket.end] for k in self._keys]
        staged, event = stager.fetch(host)
        return dict(zip(self._keys, staged)), event

    # ---------------------------------------------------------------------------------------------- checkpoints
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hyper-parameters as ``torch.optim.AdamW`` loads them; the state copied into the host buffers (never moved
        to the parameters' device)."""
        saved_state = state_dict["state"]
        saved_groups = state_dict["param_groups"]
        super().load_state_dict({**state_dict, "state": {}})  # checks the groups, resets self.state
        self._install_host_state()
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in self.param_groups),
            )
        )
        for saved_id, values in saved_state.items():
            p = id_map[saved_id]
            state = self.state[p]
            for key, value in values.items():
                if key == "step":
                    step = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
                    state["step"] = step.detach().to("cpu", _step_dtype()).clone()
                elif key in state:
                    _local(state[key]).copy_(_local(value))
                else:
                    raise KeyError(f"OffloadedAdamW.load_state_dict: unexpected state '{key}' (amsgrad mismatch?)")


def _step_dtype() -> torch.dtype:
    # what torch.optim.Adam uses for a host ``step`` (``_get_scalar_dtype``)
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def host_state_bytes(optimizer: Optional[torch.optim.Optimizer]) -> int:
    """Host bytes an optimizer keeps between steps: its host buffers for :class:`OffloadedAdamW`, else the bytes of
    the state tensors that are on the CPU."""
    if optimizer is None:
        return 0
    if isinstance(optimizer, OffloadedAdamW):
        return optimizer.host_state_bytes()
    return sum(
        _local(v).numel() * _local(v).element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.device.type == "cpu"
    )


def iter_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor of ``optimizer.state`` (local shards for DTensors)."""
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield _local(value)
