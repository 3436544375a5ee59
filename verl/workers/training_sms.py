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

With ``rollout.balance_reserved_sms`` the trainer moves the split between steps (:func:`balance_shift`,
:meth:`TrainingSMs.shift`): by one partition group towards the side that finished last, so the rollout running ahead
and the training passes of a step end together.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

__all__ = ["BALANCE_TOLERANCE", "SM_GRANULARITY", "TrainingSMs", "balance_shift", "training_sm_count"]

# CUDA partitions SMs for green contexts in groups of this many (compute capability 9.x: 8; smaller on older
# devices, where rounding to 8 only gives the training passes a few SMs fewer than asked)
SM_GRANULARITY = 8
# balance_shift leaves the split alone while the side that finished first waited at most this share of the step
BALANCE_TOLERANCE = 0.05


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


def balance_shift(
    waited_for_rollout_s: float,
    rollout_idle_s: float,
    step_s: float,
    tolerance: float = BALANCE_TOLERANCE,
    granularity: int = SM_GRANULARITY,
) -> int:
    """How to move ``engine_reserved_sms`` after a step whose next rollout ran beside its training passes.

    ``waited_for_rollout_s``: how long the step, its training done, waited for the rollout running ahead (the engine
    was the slower side); ``rollout_idle_s``: how long that rollout had been finished when the training passes were
    done (the training was the slower side, on its share of the SMs until then). Returns ``+granularity`` (keep one
    group more for the engine) when the first exceeds ``tolerance * step_s``, ``-granularity`` when the second does,
    else 0.

    Example: 5.9 s waited in a 36.9 s step -> +8; 3 s idle in a 37 s step -> -8; 1 s either way -> 0.
    """
    if waited_for_rollout_s < 0 or rollout_idle_s < 0 or step_s < 0:
        raise ValueError(
            f"balance_shift takes seconds >= 0, got waited {waited_for_rollout_s}, idle {rollout_idle_s}, step {step_s}"
        )
    limit = tolerance * step_s
    if waited_for_rollout_s > limit and waited_for_rollout_s >= rollout_idle_s:
        return granularity
    if rollout_idle_s > limit:
        return -granularity
    return 0


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

    def shift(self, delta: int) -> int:
        """Keep ``delta`` SMs more (or fewer, ``delta < 0``) for the engine from the next pass on; returns the new
        ``reserved``, clamped to ``[0, total - SM_GRANULARITY]`` (the device's SM count, where known). A change drops
        the green context: the next partitioned pass builds one of the new size (and empties the caching allocator's
        unused blocks, the old stream's among them)."""
        new = max(0, self.reserved + int(delta))
        if self.device is not None:
            total = torch.cuda.get_device_properties(self.device).multi_processor_count
            new = min(new, total - SM_GRANULARITY)
        if new != self.reserved:
            if self._stream is not None:
                self._stream.synchronize()  # nothing left queued in the context about to be dropped
            self.reserved = new
            self._context, self._stream, self.num_sms = None, None, None
        return self.reserved

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
