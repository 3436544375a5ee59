"""A toy worker for tests/test_rollout_overlap_threads.py's concurrency-group test, in a module of its own: Ray imports
the module that defines a worker class in each of its processes, and this one imports no torch (the test module
imports the trainer: ~3.5 s a process here)."""

from __future__ import annotations

import threading

from verl.single_controller import Dispatch, Worker, register


class MeetingWorker(Worker):
    """Two calls that wait for each other at a barrier: they return only if they run at the same time."""

    def __init__(self) -> None:
        super().__init__()
        self.barrier = threading.Barrier(2)

    def _meet(self, timeout: float) -> str:
        try:
            self.barrier.wait(timeout)
        except threading.BrokenBarrierError:
            self.barrier.reset()
            return "alone"
        return threading.current_thread().name

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False, concurrency_group="rollout")
    def meet_from_rollout(self, timeout: float) -> str:
        return self._meet(timeout)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False, concurrency_group="train")
    def meet_from_train(self, timeout: float) -> str:
        return self._meet(timeout)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def plain(self) -> str:
        return threading.current_thread().name
