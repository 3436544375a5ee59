"""Start the ranks of a multi-process (gloo) test without paying a fresh interpreter's imports per rank.

``torch.multiprocessing.spawn`` starts every rank as a new interpreter that imports torch, transformers and verl
again (~3.5 s of one core each, for every spawned rank of every such test). :func:`spawn` starts them through
one forkserver per test session instead (``multiprocessing``'s ``forkserver`` start method): that server imports
:data:`PRELOAD` once, before any test code or thread runs in it, and forks each rank from there. A rank is still
its own process with its own torch.distributed state, started from the same function and arguments, with the
parent's environment and working directory of the moment of the call (as a spawned one would get them); only the
imports are already done.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

# What the ranks of the test modules import before they start (a module missing here is imported by the rank).
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "safetensors.torch",
    "hydra",
    "omegaconf",
    "pandas",
    "pytest",
    "verl.trainer.main_ppo",
    "verl.trainer.main_sft",
    "verl.workers.fsdp_workers",
    "verl.workers.actor",
    "verl.utils.model_loading",
]
_preload_set = False


def _run_rank(rank: int, fn: Callable[..., Any], env: dict[str, str], cwd: str, *args: Any) -> None:
    """In the rank: the caller's environment and working directory, then ``fn(rank, *args)``."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fn(rank, *args)


def spawn(fn: Callable[..., Any], args: tuple = (), nprocs: int = 1, join: bool = True) -> None:
    """Like ``torch.multiprocessing.spawn(fn, args, nprocs, join=True)``: ``fn(rank, *args)`` in ``nprocs``
    processes, waiting for all; a rank's exception is raised here (``ProcessRaisedException``)."""
    if not join:
        raise ValueError("spawn waits for its ranks (join=True)")
    global _preload_set
    if not _preload_set:  # the session's forkserver starts here, in the repository root (its imports resolve)
        multiprocessing.set_forkserver_preload(PRELOAD)
        cwd = os.getcwd()
        os.chdir(Path(__file__).resolve().parents[1])
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.chdir(cwd)
        _preload_set = True
    mp.start_processes(
        _run_rank,
        args=(fn, dict(os.environ), os.getcwd(), *args),
        nprocs=nprocs,
        join=True,
        start_method="forkserver",
    )


def spawn_with_data(fn: Callable[..., Any], nprocs: int, tmp_path: Path, model_path: Any, data: Any, *extra: Any):
    """Save ``data`` (a DataProto) to ``tmp_path``, run ``fn(rank, init_file, model_path, data_file, *extra,
    out_dir)`` in ``nprocs`` ranks (:func:`spawn`) and return what each rank saved as ``<out_dir>/rank<r>.pt``."""
    import torch

    data_file = tmp_path / "data.pt"
    torch.save(data, data_file)
    spawn(fn, nprocs=nprocs, args=(str(tmp_path / "init"), str(model_path), str(data_file), *extra, str(tmp_path)))
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]
