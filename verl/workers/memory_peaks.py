"""Peak GPU memory per phase of a worker: ``perf/max_memory_allocated_gb/<phase>`` (GiB).

The start-up estimate (``verl/utils/memory_estimate.py``) predicts each phase's GPU need; the process-wide peak
(``perf/max_memory_allocated_gb``) alone cannot say which phase was under-estimated. :class:`PhasePeaks` resets
torch's peak counter as a phase starts and reads it as the phase ends, keeping the largest value per phase name
until the next :meth:`PhasePeaks.report` (the actor worker reports with its update's metrics, so a step's metrics
carry that step's rollout, log-prob and update peaks and the previous step's weight sync). Memory the rollout engine
allocates through torch's allocator counts (vLLM's sleep-mode pool does).

With ``trainer.rollout_overlap`` the rollout thread's generation and the train thread's passes run at the same time;
one device counter cannot tell them apart, so a report whose phases overlapped is empty. The process-wide peaks
stay exact either way: torch's reset clears the allocated and the reserved peak, and :meth:`PhasePeaks.lifetime_peaks`
keeps the maximum of each across the resets.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["PhasePeaks", "METRIC_PREFIX"]

METRIC_PREFIX = "perf/max_memory_allocated_gb/"


class PhasePeaks:
    """Per-phase peaks of ``torch.cuda.max_memory_allocated()``; a no-op when ``enabled`` is False (CPU)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._lock = threading.Lock()
        self._active = 0
        self._concurrent = False
        self._peaks: dict[str, int] = {}
        self._lifetime = 0
        self._lifetime_reserved = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the peak of the code inside under ``name`` (the largest over repeated calls until the report)."""
        if not self.enabled:
            yield
            return
        with self._lock:
            if self._active:  # another phase is running in another thread: their peaks mix
                self._concurrent = True
            else:
                self._fold_lifetime()
                torch.cuda.reset_peak_memory_stats()
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                self._fold_lifetime()
                self._peaks[name] = max(self._peaks.get(name, 0), torch.cuda.max_memory_allocated())

    def _fold_lifetime(self) -> None:
        """Fold torch's peaks since its last reset into the process-wide ones (with the lock held)."""
        self._lifetime = max(self._lifetime, torch.cuda.max_memory_allocated())
        self._lifetime_reserved = max(self._lifetime_reserved, torch.cuda.max_memory_reserved())

    def lifetime_peaks(self) -> tuple[int, int]:
        """The process's peak bytes allocated and reserved (torch's caching allocator) since it started, across the
        per-phase resets; ``(0, 0)`` when disabled."""
        if not self.enabled:
            return 0, 0
        with self._lock:
            self._fold_lifetime()
            return self._lifetime, self._lifetime_reserved

    def report(self) -> dict[str, float]:
        """``{perf/max_memory_allocated_gb/<phase>: GiB}`` of the phases since the last report, then forgotten;
        empty when phases ran at the same time (or when disabled)."""
        with self._lock:
            peaks, concurrent = self._peaks, self._concurrent
            self._peaks, self._concurrent = {}, self._active > 0
        if concurrent:
            return {}
        return {METRIC_PREFIX + name: value / 2**30 for name, value in peaks.items()}
