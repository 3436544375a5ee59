"""Wall-clock timing of device work, importable without this repository's ``verl`` (``bench_vs_verl.py`` runs
upstream verl's actor in a process where ``verl`` is the upstream package)."""

from __future__ import annotations

import time

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, steps: int, device: torch.device, warmup: int = 1) -> float:
    """Seconds per call of ``fn(i)``: the mean over the timed calls ``i = warmup .. warmup + steps - 1``, after the
    untimed warm-up calls ``fn(0) .. fn(warmup - 1)``."""
    for i in range(warmup):
        fn(i)
    sync(device)
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        fn(i)
    sync(device)
    return (time.perf_counter() - start) / steps


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` has made in this process so far (Dynamo's ``unique_graphs`` counter): a difference
    across timed calls says whether a compile was timed."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def timed_with_graphs(fn, steps: int, device: torch.device, warmup: int = 1) -> tuple[float, int]:
    """``timed`` and the graphs ``torch.compile`` made during the timed calls (``compiled_graphs``)."""
    graphs = []

    def call(i: int):
        if i == warmup:
            graphs.append(compiled_graphs())
        fn(i)

    seconds = timed(call, steps, device, warmup=warmup)
    return seconds, compiled_graphs() - graphs[0]
