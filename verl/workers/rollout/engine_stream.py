"""The CUDA stream the in-process vLLM engine thread runs on (``actor_rollout_ref.rollout.engine_stream``).

With ``trainer.rollout_overlap`` the next step's generation runs in the worker process while this step trains: vLLM's
engine thread steps the engine while the training thread runs the log-prob passes and the update. Kernels issued
on one stream run in order, so where both threads issue on the same stream, generation kernels wait behind the
trainer's queue (and the other way round); where they issue on different streams the GPU may run them side by side,
and a high-priority stream's kernels are scheduled first as the trainer's blocks finish.

``"shared"`` (default): the engine thread keeps the stream it has (as before).
``"high_priority"``: the engine thread runs on its own stream at high priority; the engine is built with that
stream current (:meth:`EngineStream.building`), so vLLM keeps it as the stream it returns to and orders its
copies after.

On CUDA, in both modes, ordering against the other threads is explicit: a call handed to the engine thread (weight
loading, sleep, wake-up, prefix-cache reset) starts after the engine's own queued work and after the work its
caller had queued on the caller's stream (:meth:`EngineStream.mark` / :meth:`EngineStream.wait`), and the engine
thread finishes the call's GPU work before the caller continues (:meth:`EngineStream.finish`); weight buckets are
marked in use on the engine's stream (``record_stream``) so the caching allocator does not hand their memory to the
caller's next allocation while the engine still reads it. On CPU every method is a no-op.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any, Optional

import torch

from verl.workers.config.rollout import ENGINE_STREAMS

logger = logging.getLogger(__name__)

__all__ = ["ENGINE_STREAMS", "EngineStream"]

# torch maps priorities outside the device's range to its nearest end; -1 is "high" on every CUDA device
HIGH_PRIORITY = -1


class EngineStream:
    """The engine thread's stream under ``mode`` (:data:`ENGINE_STREAMS`) on ``device`` (a CUDA device index or
    None on CPU). Built in any thread; :meth:`enter` makes the high-priority stream current in the engine thread.

    The ordering methods (:meth:`mark`, :meth:`wait`, :meth:`hold`, :meth:`finish`) act on CUDA in both modes: even
    ``shared`` does not guarantee one stream for both threads (vLLM's ``current_stream()`` gives a thread that calls
    it a new non-blocking stream of its own, e.g. through its NCCL communicator with tensor parallelism), and an
    event, a ``record_stream`` and a synchronize per call cost next to nothing."""

    def __init__(self, mode: str = "shared", device: Optional[int] = None):
        if mode not in ENGINE_STREAMS:
            raise ValueError(
                f"actor_rollout_ref.rollout.engine_stream must be one of {list(ENGINE_STREAMS)}, got {mode!r}"
            )
        self.device = device
        self.stream: Optional[torch.cuda.Stream] = None
        self.switches = 0  # times :meth:`check` found the engine thread off its stream
        if mode == "high_priority" and device is not None:
            self.stream = torch.cuda.Stream(device=device, priority=HIGH_PRIORITY)

    @property
    def active(self) -> bool:
        """The engine thread runs on a stream of its own."""
        return self.stream is not None

    def enter(self) -> None:
        """In the engine thread: make the engine stream current there (vLLM patches ``torch.cuda.set_stream``
        to remember it, so vLLM's own ``current_stream()`` sees it too), after all work queued so far on the device
        (the engine's creation ran in another thread, on other streams)."""
        if self.stream is None:
            return
        torch.cuda.synchronize(self.device)
        torch.cuda.set_stream(self.stream)
        logger.info("vLLM engine thread runs on its own high-priority CUDA stream (rollout.engine_stream)")

    def building(self) -> contextlib.AbstractContextManager:
        """Around the engine's construction (in whichever thread builds it): the engine stream is current there.

        vLLM's model runner caches the stream current while the engine warms up as its ``main_stream``, ends every
        step by making ``main_stream`` current again, and orders its copy of the sampled tokens to the host after
        ``main_stream`` only (vLLM 0.26-0.34's V2 runner). Built on another stream, the engine thread would be
        moved back to that stream after every step (the GPU test saw it), and an engine thread put back on its
        own stream would sample on a stream the copy does not wait for."""
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def check(self) -> None:
        """In the engine thread, before each engine step and each call: count (and warn once) when the thread is
        not on the engine stream. It is left where vLLM put it: vLLM orders its copies after the stream it chose,
        and moving the thread back could let such a copy overtake the kernels it reads; left there, the engine only
        loses the priority. With the engine built under :meth:`building` this does not happen."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        if current == self.stream:
            return
        self.switches += 1
        if self.switches == 1:
            logger.warning(
                "vLLM moved its engine thread off the rollout.engine_stream stream (to a stream of priority %d): "
                "its kernels run at that priority from here on",
                current.priority,
            )

    def mark(self) -> Optional[torch.cuda.Event]:
        """In a calling thread: an event after the work queued so far on the caller's current stream."""
        if self.device is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _current(self) -> torch.cuda.Stream:
        """The engine thread's current stream (the methods below act on whatever stream its kernels go to)."""
        return torch.cuda.current_stream(self.device)

    def wait(self, event: Optional[torch.cuda.Event]) -> None:
        """In the engine thread: its stream waits for ``event`` (from :meth:`mark`) before what follows."""
        if self.device is not None and event is not None:
            self._current().wait_event(event)

    def hold(self, tensors: Iterable[Any]) -> None:
        """In the engine thread: the caching allocator keeps these CUDA tensors' memory until the engine stream's
        work queued so far is done, even if the caller frees them first."""
        if self.device is None:
            return
        stream = self._current()
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                tensor.record_stream(stream)

    def finish(self) -> None:
        """In the engine thread: block until its stream's queued work is done (before a call starts, so e.g. a
        sleep never unmaps memory under a pending step, and before a call's result goes back, so the caller's
        later work follows it)."""
        if self.device is not None:
            self._current().synchronize()
