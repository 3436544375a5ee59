"""The rollout engine's weights and memory must not change under a generation in flight.

With ``trainer.rollout_overlap`` a worker runs its ``generate`` calls in one thread and its training calls in
another (Ray concurrency groups, ``verl/workers/fsdp_workers.py``). The driver waits for the rollout running ahead
before it syncs the weights, and does not sleep the engine while one runs; :class:`RolloutGuard` checks it on the
worker: a weight sync, sleep or wake-up that starts while a generation is in flight (or a generation that starts
during one of them) raises at once instead of silently mixing two policies in one rollout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["RolloutGuard"]


class RolloutGuard:
    """Counts generations in flight and refuses engine changes (weight sync, sleep, wake-up) during them.

    ``with guard.generating("generate"):`` around a generation, ``with guard.changing("sync_rollout_weights"):``
    around a change; the two exclude each other (the second to start raises ``RuntimeError``), generations
    may run concurrently with each other, changes may not. :meth:`busy_seconds` adds up the wall time during which
    at least one generation was in flight, so a training call can report how much of it ran alongside generation.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generating = 0
        self._changing: str | None = None
        self._busy = 0.0  # seconds with a generation in flight, up to _since
        self._since: float | None = None  # start of the current busy period (perf_counter), None when idle

    def busy_seconds(self) -> float:
        """Wall seconds so far with at least one generation in flight (a running clock)."""
        with self._lock:
            return self._busy + (time.perf_counter() - self._since if self._since is not None else 0.0)

    @property
    def in_flight(self) -> int:
        """Generations running now."""
        return self._generating

    @contextmanager
    def generating(self, what: str = "generate") -> Iterator[None]:
        with self._lock:
            if self._changing is not None:
                raise RuntimeError(
                    f"{what} refused: {self._changing} is changing the rollout engine on this worker; a rollout must "
                    "run entirely on one set of weights (the driver must not generate during a weight sync)"
                )
            self._generating += 1
            if self._generating == 1:
                self._since = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self._generating -= 1
                if self._generating == 0:
                    self._busy += time.perf_counter() - self._since
                    self._since = None

    @contextmanager
    def changing(self, what: str) -> Iterator[None]:
        with self._lock:
            if self._generating:
                raise RuntimeError(
                    f"{what} refused: {self._generating} generate call(s) in flight on this worker; the rollout "
                    "engine's weights and memory must not change under a running generation (with "
                    "trainer.rollout_overlap the driver waits for the rollout running ahead before the weight sync "
                    "and keeps the engine awake while it runs)"
                )
            if self._changing is not None:
                raise RuntimeError(f"{what} refused: {self._changing} is already changing the rollout engine")
            self._changing = what
        try:
            yield
        finally:
            with self._lock:
                self._changing = None
