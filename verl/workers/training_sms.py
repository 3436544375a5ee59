"""SMs kept free of the training passes for the rollout engine (``actor_rollout_ref.rollout.engine_reserved_sms``).

With ``trainer.rollout_overlap`` the next step's generation (vLLM's engine thread) runs on the GPU while this step's
log-prob passes and update run (the training thread). Both issue kernels to one GPU: the update's GEMMs fill every
SM, and the engine's decode kernels, even on a high-priority stream (``rollout.engine_stream``), wait for SMs to free
up; at 1.5B on one H200 a decode step beside the update took twice its time alone.

With ``engine_reserved_sms = k > 0`` the training thread's kernels run in a CUDA green context holding the device's
other SMs (``torch.cuda.green_contexts``, torch >= 2.11): the update can no longer occupy the ``k`` reserved SMs, which the engine
(in the device's primary context, free to use every SM) therefore always finds free. The training passes run on
``total - k`` SMs (rounded down to the partition granularity, 8 SMs on Hopper) and are slower by about that share;
generation beside them keeps its reserved SMs. The partition applies micro-batch by micro-batch, and only while a
generation is in flight (``busy``): once the rollout running ahead is done, the rest of the pass has the whole GPU
again. Inside :meth:`TrainingSMs.scope` the training thread's current stream is the green context's stream, ordered
after the caller's stream on entry and before it on exit (each side waits for the other's queued work, so memory
the caching allocator hands out again on either stream is never still in use on the other).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

__all__ = ["SM_GRANULARITY", "TrainingSMs", "training_sm_count"]

# CUDA partitions SMs for green contexts in groups of this many (compute capability 9.x: 8; smaller on older
# devices, where rounding to 8 only gives the training passes a few SMs fewer than asked)
SM_GRANULARITY = 8


def training_sm_count(total: int, reserved: int, granularity: int = SM_GRANULARITY) -> int:
    """SMs the training passes keep on a device of ``total`` SMs with ``reserved`` of them kept for the engine:
    ``total - reserved`` rounded down to a multiple of ``granularity``. Raises ``ValueError`` naming the key when
    fewer than one group would be left."""
    if reserved < 0:
        raise ValueError(f"actor_rollout_ref.rollout.engine_reserved_sms must be >= 0, got {reserved}")
    count = (total - reserved) // granularity * granularity
    if count < granularity:
        raise ValueError(
            f"actor_rollout_ref.rollout.engine_reserved_sms={reserved} leaves the training passes {total - reserved} "
            f"of the device's {total} SMs; at least {granularity} must be left (set it to at most "
            f"{total - granularity})"
        )
    return count


def _green_context_class() -> Any:
    """torch's ``GreenContext``, with the per-context stream the partition runs on (torch >= 2.11); a
    ``RuntimeError`` naming the key otherwise."""
    try:
        from torch.cuda.green_contexts import GreenContext
    except ImportError:
        GreenContext = None
    if GreenContext is None or not hasattr(GreenContext, "Stream"):
        raise RuntimeError(
            f"actor_rollout_ref.rollout.engine_reserved_sms needs CUDA green contexts with their own stream "
            f"(torch.cuda.green_contexts.GreenContext.Stream, torch >= 2.11; this is torch {torch.__version__}): "
            "set it to 0"
        )
    return GreenContext


class TrainingSMs:
    """The training thread's SM partition on CUDA device ``device`` with ``reserved`` SMs kept for the engine
    while ``busy()`` (a generation in flight; always, by default). ``reserved = 0`` or ``device = None`` (e.g. on
    CPU): :meth:`scope` does nothing. The green context is built on the first :meth:`scope` that applies (the CUDA
    context must exist by then)."""

    def __init__(self, reserved: int, device: Optional[int], busy: Callable[[], bool] = lambda: True):
        if reserved < 0:
            raise ValueError(f"actor_rollout_ref.rollout.engine_reserved_sms must be >= 0, got {reserved}")
        self.reserved = reserved
        self.device = device
        self.busy = busy
        self.partitioned_passes = 0  # scopes that ran on the partition (the others: on the whole device)
        self.num_sms: Optional[int] = None  # SMs of the training passes, once built
        self._context: Any = None
        self._stream: Optional[torch.cuda.Stream] = None

    @property
    def enabled(self) -> bool:
        return self.reserved > 0 and self.device is not None

    def _build(self) -> None:
        GreenContext = _green_context_class()
        # the caching allocator keeps a pool per stream: what the caller's stream has cached but not in use would
        # otherwise stay out of reach of the training passes from here on
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.num_sms = training_sm_count(total, self.reserved)
        self._context = GreenContext.create(num_sms=self.num_sms, device_id=self.device)
        self._stream = self._context.Stream()
        logger.info(
            "training passes run on %d of the device's %d SMs; %d kept for the rollout engine "
            "(actor_rollout_ref.rollout.engine_reserved_sms=%d)",
            self.num_sms,
            total,
            total - self.num_sms,
            self.reserved,
        )

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Around a training pass (a micro-batch's forward and backward), in the thread that runs it: while
        ``busy()``, its kernels go to the training SMs; otherwise it runs as it is, on the whole device."""
        if not (self.enabled and self.busy()):
            yield
            return
        self.partitioned_passes += 1
        if self._stream is None:
            self._build()
        caller = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:
            caller.wait_stream(self._stream)
