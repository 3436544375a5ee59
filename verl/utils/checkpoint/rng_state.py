"""Random-number-generator state (python ``random``, numpy, torch CPU, CUDA) and the trainer's own state file.

Files are written with ``torch.save`` using only tensors and plain Python values, so they load with
``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

__all__ = [
    "get_rng_state",
    "set_rng_state",
    "rng_state_file",
    "save_rng_state",
    "load_rng_state",
    "TRAINER_STATE_FILE",
    "save_trainer_state",
    "load_trainer_state",
]

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
TRAINER_STATE_FILE = "data.pt"  # verl keeps the dataloader state in <global_step_N>/data.pt


def get_rng_state() -> dict[str, Any]:
    """A snapshot of every RNG this process uses (CUDA: all visible devices, when CUDA is available)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a ``get_rng_state()`` snapshot (the CUDA part only when CUDA is available here)."""
    python_state = state["python"]
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    cuda_state = state.get("cuda")
    if cuda_state is not None and torch.cuda.is_available():
        if len(cuda_state) != torch.cuda.device_count():
            logger.warning(
                "RNG state has %d CUDA devices, this process sees %d; restoring the common ones",
                len(cuda_state),
                torch.cuda.device_count(),
            )
        for device, device_state in enumerate(cuda_state[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, device)


def rng_state_file(ckpt_dir: PathLike, rank: int) -> Path:
    """``<ckpt_dir>/rng_rank<rank>.pt``."""
    return Path(ckpt_dir) / f"rng_rank{int(rank)}.pt"


def save_rng_state(ckpt_dir: PathLike, rank: int) -> Path:
    """Write this process's RNG state to ``rng_rank<rank>.pt`` and return the file."""
    path = rng_state_file(ckpt_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(get_rng_state(), path)
    return path


def load_rng_state(ckpt_dir: PathLike, rank: int) -> bool:
    """Restore ``rng_rank<rank>.pt`` if it exists; returns whether it did (a rank that did not exist when the
    checkpoint was written keeps its current RNG state, with a warning)."""
    path = rng_state_file(ckpt_dir, rank)
    if not path.exists():
        logger.warning("no RNG state for rank %d in %s; keeping the current RNG state", rank, ckpt_dir)
        return False
    set_rng_state(torch.load(path, weights_only=True))
    return True


def save_trainer_state(
    ckpt_dir: PathLike,
    global_step: int,
    dataloader_state: Optional[dict[str, Any]] = None,
    extra: Optional[dict[str, Any]] = None,
    include_rng: bool = True,
) -> Path:
    """Write the driver's state to ``<ckpt_dir>/data.pt``: ``global_step``, the dataloader state
    (``ResumableDataLoader.state_dict()``), ``extra`` (plain values/tensors) and the driver's RNG state."""
    path = Path(ckpt_dir) / TRAINER_STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"global_step": int(global_step), "dataloader": dataloader_state, "extra": extra or {}}
    if include_rng:
        state["rng"] = get_rng_state()
    torch.save(state, path)
    return path


def load_trainer_state(ckpt_dir: PathLike, restore_rng: bool = True) -> dict[str, Any]:
    """Read ``<ckpt_dir>/data.pt`` (restoring the driver's RNG state when ``restore_rng``); returns the dict
    with ``global_step``, ``dataloader`` and ``extra``."""
    path = Path(ckpt_dir) / TRAINER_STATE_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"trainer state file {path} does not exist (was the checkpoint saved with save_trainer_state?)"
        )
    state = torch.load(path, weights_only=True)
    if restore_rng and state.get("rng") is not None:
        set_rng_state(state["rng"])
    return state
