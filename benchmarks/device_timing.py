"""Wall-clock timing of device work, importable without this repository's ``verl`` (``bench_vs_verl.py`` runs
upstream verl's actor in a process where ``verl`` is the upstream package)."""

from __future__ import annotations

import argparse
import time

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_warmup_calls_argument(parser: argparse.ArgumentParser) -> None:
    """``--warmup-calls`` (default 2, at least 1): untimed calls before a phase's timed ones, each on a fresh batch.
    Two, because torch.compile makes a static graph for the first shape and a dynamic one at the first new shape
    (automatic dynamic shapes): the second warm-up call compiles flex_attention's dynamic graph, which one warm-up
    call left to the first timed call when every micro-batch of the warm-up batch padded to the same length."""

    def at_least_one(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
        return value

    parser.add_argument(
        "--warmup-calls",
        type=at_least_one,
        default=2,
        help="untimed calls per phase before the timed ones, each on a fresh batch (2: the second one compiles "
        "flex_attention's dynamic-shape graph; device_timing.add_warmup_calls_argument)",
    )


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
