"""Wall-clock timing of device work, importable without this repository's ``verl`` (``bench_vs_verl.py`` runs
upstream verl's actor in a process where ``verl`` is the upstream package)."""

from __future__ import annotations

import time

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, steps: int, device: torch.device) -> float:
    """Seconds per call of ``fn(i)`` (mean over calls ``i = 1..steps`` after the warm-up call ``fn(0)``)."""
    fn(0)
    sync(device)
    start = time.perf_counter()
    for i in range(1, steps + 1):
        fn(i)
    sync(device)
    return (time.perf_counter() - start) / steps
