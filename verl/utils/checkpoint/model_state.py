"""Sharded model / optimizer / LR-scheduler checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of one model checkpoint folder (e.g. ``global_step_N/actor``)::

    model/                 DCP: get_model_state_dict(model)            (__<rank>_0.distcp + .metadata)
    optim/                 DCP: get_optimizer_state_dict(model, optim) (only when an optimizer is given)
    lr_scheduler.pt        lr_scheduler.state_dict()                    (rank 0)
    rng_rank<r>.pt         RNG state of rank r                          (every rank)
    checkpoint_meta.json   format, world size, contents                 (rank 0)
    huggingface/           config.json, generation_config.json, tokenizer files (rank 0; for the merger);
                           adapter_config.json for a peft LoRA model (its state in model/ is the peft model's:
                           frozen base weights and adapters, so a resume restores both exactly)

With a process group (FSDP2 ``fully_shard`` models) every rank calls ``save_model_shards`` /
``load_model_shards`` together and writes / reads its own shards; DCP reshards on load, so a checkpoint written
by W ranks loads on any number of ranks, and into a plain single-process model (that is what
``scripts/model_merger.py`` does). Without a process group the same functions run DCP in single-process mode
(verified with torch 2.13), so there is one on-disk format for both cases.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from verl.utils.checkpoint.manager import CheckpointError
from verl.utils.checkpoint.rng_state import load_rng_state, save_rng_state

__all__ = [
    "MODEL_SUBDIR",
    "OPTIM_SUBDIR",
    "HF_SUBDIR",
    "ADAPTER_CONFIG_FILE",
    "LR_SCHEDULER_FILE",
    "MODEL_META_FILE",
    "TOKENIZER_FILES",
    "is_model_checkpoint_dir",
    "save_hf_assets",
    "save_model_shards",
    "load_model_shards",
    "read_model_checkpoint_meta",
]

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
MODEL_SUBDIR = "model"
OPTIM_SUBDIR = "optim"
HF_SUBDIR = "huggingface"
LR_SCHEDULER_FILE = "lr_scheduler.pt"
MODEL_META_FILE = "checkpoint_meta.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"  # peft's LoraConfig of a LoRA model (lora_alpha, r, target_modules)
DCP_METADATA_FILE = ".metadata"
FORMAT_NAME = "dcp-v1"
# Files a tokenizer / generation setup may consist of (copied from a base model folder when no tokenizer object).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_and_world(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    if _dist_on():
        actual = (dist.get_rank(), dist.get_world_size())
        if (rank is not None and rank != actual[0]) or (world_size is not None and world_size != actual[1]):
            raise ValueError(f"rank/world_size ({rank}, {world_size}) disagree with the process group {actual}")
        return actual
    rank, world_size = rank or 0, world_size or 1
    if world_size != 1 or rank != 0:
        raise ValueError(
            f"rank={rank}, world_size={world_size} needs torch.distributed to be initialised "
            "(dist.init_process_group); without a process group use rank=0, world_size=1"
        )
    return rank, world_size


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # single-process mode warns that it assumes a single process: it is meant
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(state, checkpoint_id=str(path), no_dist=not _dist_on())


def _dcp_load(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, checkpoint_id=str(path), no_dist=not _dist_on())


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


def is_model_checkpoint_dir(path: PathLike) -> bool:
    """True when ``path`` holds a model checkpoint written by ``save_model_shards``."""
    return (Path(path) / MODEL_SUBDIR / DCP_METADATA_FILE).is_file()


def _hf_config_of(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    base = getattr(model, "get_base_model", None)  # peft
    if base is not None:
        config = getattr(base(), "config", config)
    return config


def save_hf_assets(
    target_dir: PathLike,
    hf_config: Any = None,
    tokenizer: Any = None,
    generation_config: Any = None,
    source_path: Optional[PathLike] = None,
) -> Path:
    """Write what a Hugging Face folder needs besides the weights: ``config.json``, the generation config and
    the tokenizer files (``tokenizer.save_pretrained`` or, without a tokenizer object, the files named in
    ``TOKENIZER_FILES`` copied from ``source_path``)."""
    import shutil

    target = Path(target_dir)
    target.mkdir(parents=True, exist_ok=True)
    if hf_config is not None:
        hf_config.save_pretrained(str(target))
    if source_path is not None:
        for name in TOKENIZER_FILES:
            src = Path(source_path) / name
            if src.is_file() and (tokenizer is None or name == "generation_config.json"):
                shutil.copy2(src, target / name)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(target))
    if generation_config is not None:
        generation_config.save_pretrained(str(target))
    return target


def _save_adapter_config(model: nn.Module, target: Path) -> None:
    """``adapter_config.json`` of a peft model's (single, ``default``) adapter; nothing for other models."""
    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return
    if set(peft_config) != {"default"}:
        raise ValueError(f"save_model_shards: one peft adapter named 'default' expected, got {sorted(peft_config)}")
    peft_config["default"].save_pretrained(str(target))


def save_model_shards(
    ckpt_dir: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    lr_scheduler: Any = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    *,
    tokenizer: Any = None,
    hf_config: Any = None,
    hf_source_path: Optional[PathLike] = None,
    save_rng: bool = True,
    extra_meta: Optional[dict[str, Any]] = None,
) -> Path:
    """Save ``model`` (and ``optimizer``, ``lr_scheduler``, this rank's RNG state) into ``ckpt_dir``.

    Collective under a process group: every rank must call it. ``rank``/``world_size`` default to the process
    group's (or 0/1 without one) and are checked against it. ``hf_config`` defaults to ``model.config``; the
    generation config comes from ``model.generation_config`` when present; tokenizer files come from
    ``tokenizer`` or are copied from ``hf_source_path`` (the base model folder). Returns ``ckpt_dir``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    rank, world_size = _rank_and_world(rank, world_size)
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    options = StateDictOptions(full_state_dict=False)  # sharded (DTensor) under FSDP2, plain tensors otherwise
    _dcp_save(get_model_state_dict(model, options=options), ckpt_dir / MODEL_SUBDIR)
    contents = ["model"]
    if optimizer is not None:
        _dcp_save(get_optimizer_state_dict(model, optimizer, options=options), ckpt_dir / OPTIM_SUBDIR)
        contents.append("optimizer")
    if lr_scheduler is not None:
        contents.append("lr_scheduler")
        if rank == 0:
            torch.save(lr_scheduler.state_dict(), ckpt_dir / LR_SCHEDULER_FILE)
    if save_rng:
        save_rng_state(ckpt_dir, rank)
        contents.append("rng")
    if rank == 0:
        config = hf_config if hf_config is not None else _hf_config_of(model)
        generation_config = getattr(model, "generation_config", None)
        if config is not None or tokenizer is not None or hf_source_path is not None:
            save_hf_assets(ckpt_dir / HF_SUBDIR, config, tokenizer, generation_config, hf_source_path)
        _save_adapter_config(model, ckpt_dir / HF_SUBDIR)
        meta = {
            "format": FORMAT_NAME,
            "world_size": world_size,
            "contents": contents,
            "torch_version": torch.__version__,
            **(extra_meta or {}),
        }
        (ckpt_dir / MODEL_META_FILE).write_text(json.dumps(meta, indent=2))
    _barrier()
    return ckpt_dir


def read_model_checkpoint_meta(ckpt_dir: PathLike) -> dict[str, Any]:
    """``checkpoint_meta.json`` of a model checkpoint folder; ``CheckpointError`` if it is not one."""
    ckpt_dir = Path(ckpt_dir)
    if not is_model_checkpoint_dir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir} is not a model checkpoint: {MODEL_SUBDIR}/{DCP_METADATA_FILE} is missing")
    meta_file = ckpt_dir / MODEL_META_FILE
    return json.loads(meta_file.read_text()) if meta_file.exists() else {}


def load_model_shards(
    ckpt_dir: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    lr_scheduler: Any = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    *,
    load_rng: bool = True,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a ``save_model_shards`` folder into ``model`` (and ``optimizer``, ``lr_scheduler``, RNG state).

    Collective under a process group. The objects must be built the same way as when saving (same model
    class/config, FSDP2 sharding applied, optimizer over the same parameters); the world size may differ (DCP
    reshards; ranks without a saved RNG state keep theirs). Returns the checkpoint's ``checkpoint_meta.json``.
    Raises ``CheckpointError`` when ``ckpt_dir`` lacks something that was asked for.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    rank, world_size = _rank_and_world(rank, world_size)
    ckpt_dir = Path(ckpt_dir)
    meta = read_model_checkpoint_meta(ckpt_dir)
    if optimizer is not None and not (ckpt_dir / OPTIM_SUBDIR / DCP_METADATA_FILE).is_file():
        raise CheckpointError(
            f"{ckpt_dir} has no optimizer state ({OPTIM_SUBDIR}/ is missing); "
            "pass optimizer=None to load the model only"
        )
    if lr_scheduler is not None and not (ckpt_dir / LR_SCHEDULER_FILE).is_file():
        raise CheckpointError(f"{ckpt_dir} has no {LR_SCHEDULER_FILE}; pass lr_scheduler=None to skip it")
    saved_world = meta.get("world_size")
    if saved_world is not None and saved_world != world_size:
        logger.warning(
            "checkpoint %s was written by %s ranks, loading on %d (resharding)", ckpt_dir, saved_world, world_size
        )

    options = StateDictOptions(full_state_dict=False, strict=strict)
    model_state = get_model_state_dict(model, options=options)
    _dcp_load(model_state, ckpt_dir / MODEL_SUBDIR)
    set_model_state_dict(model, model_state, options=options)
    if optimizer is not None:
        optim_state = get_optimizer_state_dict(model, optimizer, options=options)
        _dcp_load(optim_state, ckpt_dir / OPTIM_SUBDIR)
        set_optimizer_state_dict(model, optimizer, optim_state, options=options)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(torch.load(ckpt_dir / LR_SCHEDULER_FILE, weights_only=True))
    if load_rng:
        load_rng_state(ckpt_dir, rank)
    _barrier()
    return meta
