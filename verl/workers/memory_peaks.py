"""GPU memory per phase of a worker: its peak ``perf/max_memory_allocated_gb/<phase>`` and its growth
``perf/phase_growth_gb/<phase>`` (GiB).

The start-up estimate (``verl/utils/memory_estimate.py``) predicts each phase's GPU need; the process-wide peak
(``perf/max_memory_allocated_gb``) alone cannot say which phase was under-estimated. :class:`PhasePeaks` resets
torch's peak counter as a phase starts, notes what torch counts as allocated at that moment
(``torch.cuda.memory_allocated()``), and reads the peak as the phase ends, keeping per phase name the call with the
largest peak until the next :meth:`PhasePeaks.report` (the actor worker reports with its update's metrics, so a step's
metrics carry that step's rollout, log-prob and update phases and the previous step's weight sync).

The peaks count everything torch's allocator holds, including memory the rollout engine allocates through it:
vLLM's sleep-mode pool (its weights and KV cache) counts as allocated from the engine's start on, also while vLLM
sleeps and has released its physical memory. With vLLM colocated every phase's peak therefore reads about the pool's
size plus the rest, and a phase's own need is lost in it. The growth is that need: the phase's peak minus what was
allocated when that same call started (the call with the largest peak; on equal peaks the one with the larger
growth), i.e. the most the phase added on top of what was already held (the pool, the resident model, optimizer
states). It is not the phase's whole footprint: memory allocated before the phase started (with ``param_offload``,
the parameters brought back onto the GPU just before a log-prob or update phase) is in its start, not its growth.

The engine can say how much of that pool it has released (``released``: bytes the sleeping engine gave back to the
device, measured by the engine around its sleep and wake-up, ``VLLMRolloutEngine.released_bytes``). With such a
source every phase also reports ``perf/max_memory_in_use_gb/<phase>``: its peak minus what was released at both its
start and its end (the smaller of the two; the peak itself for a phase that started or ended awake), an estimate of
the device memory its allocations really held (one H200, 7B shape: the update's peak read 167.6 GiB on a 140 GiB GPU,
69.4 GiB of it vLLM's released pool).

With ``trainer.rollout_overlap`` the rollout thread's generation and the train thread's passes run at the same time;
one device counter cannot tell them apart, so a report whose phases overlapped is empty. The process-wide peaks
stay exact either way: torch's reset clears the allocated and the reserved peak, and :meth:`PhasePeaks.lifetime_peaks`
keeps the maximum of each across the resets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from verl.utils.host_memory import peak_rss_bytes

__all__ = ["PhasePeaks", "memory_metrics", "METRIC_PREFIX", "GROWTH_PREFIX", "IN_USE_PREFIX"]

METRIC_PREFIX = "perf/max_memory_allocated_gb/"
GROWTH_PREFIX = "perf/phase_growth_gb/"
IN_USE_PREFIX = "perf/max_memory_in_use_gb/"


class PhasePeaks:
    """Per-phase peaks of ``torch.cuda.max_memory_allocated()`` and their growth over ``torch.cuda.memory_allocated()``
    at the phase's start; a no-op when ``enabled`` is False (CPU)."""

    def __init__(self, enabled: bool, released: Callable[[], int] | None = None):
        """``released``: bytes of the allocated count that the rollout engine has released while asleep (None: no
        such engine, no ``perf/max_memory_in_use_gb/<phase>``)."""
        self.enabled = enabled
        self.released = released
        self._lock = threading.Lock()
        self._active = 0
        self._concurrent = False
        # phase -> (peak, allocated at the start of that call, bytes released at both its start and its end)
        self._peaks: dict[str, tuple[int, int, int]] = {}
        self._lifetime = 0
        self._lifetime_reserved = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the peak of the code inside, and the allocated bytes at its start, under ``name`` (of repeated
        calls until the report, the one with the largest peak)."""
        if not self.enabled:
            yield
            return
        start = 0
        released = self._released_now()
        with self._lock:
            if self._active:  # another phase is running in another thread: their peaks mix (the report is empty)
                self._concurrent = True
            else:
                self._fold_lifetime()
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
            self._active += 1
        try:
            yield
        finally:
            released = min(released, self._released_now())
            with self._lock:
                self._active -= 1
                self._fold_lifetime()
                peak, kept = torch.cuda.max_memory_allocated(), self._peaks.get(name)
                # the call with the largest peak; on equal peaks the one with the smaller start (the larger growth)
                if kept is None or (peak, -start) > (kept[0], -kept[1]):
                    self._peaks[name] = (peak, start, released)

    def _released_now(self) -> int:
        return max(int(self.released()), 0) if self.released is not None else 0

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
        """``{perf/max_memory_allocated_gb/<phase>: GiB, perf/phase_growth_gb/<phase>: GiB}`` of the phases since the
        last report (with a ``released`` source also ``perf/max_memory_in_use_gb/<phase>``), then forgotten; empty
        when phases ran at the same time (or when disabled)."""
        with self._lock:
            peaks, concurrent = self._peaks, self._concurrent
            self._peaks, self._concurrent = {}, self._active > 0
        if concurrent:
            return {}
        out = {METRIC_PREFIX + name: peak / 2**30 for name, (peak, _, _) in peaks.items()}
        out.update({GROWTH_PREFIX + name: (peak - start) / 2**30 for name, (peak, start, _) in peaks.items()})
        if self.released is not None:
            out.update({IN_USE_PREFIX + name: (peak - rel) / 2**30 for name, (peak, _, rel) in peaks.items()})
        return out


def memory_metrics(device: str, peaks: PhasePeaks | None = None) -> dict[str, float]:
    """Peak accelerator memory (GiB) and this process's resident host memory (GiB); with ``peaks``, the
    allocated and reserved peaks across its per-phase resets, the peaks per phase
    (``perf/max_memory_allocated_gb/<phase>``) and each phase's growth over its start
    (``perf/phase_growth_gb/<phase>``)."""
    out = {"perf/cpu_memory_peak_rss_gb": peak_rss_bytes() / 2**30}
    if device == "cuda":
        if peaks is not None:  # torch's counters restart at every phase; the process-wide peaks are kept there
            allocated, reserved = peaks.lifetime_peaks()
        else:
            allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        out["perf/max_memory_allocated_gb"] = allocated / 2**30
        out["perf/max_memory_reserved_gb"] = reserved / 2**30
    if peaks is not None:
        out.update(peaks.report())
    return out
