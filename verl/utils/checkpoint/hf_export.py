"""Merge a sharded model checkpoint (``save_model_shards``) into a Hugging Face folder.

The merged folder holds ``model.safetensors`` (or sharded safetensors + index), ``config.json``,
``generation_config.json`` and the tokenizer files, so ``AutoModelForCausalLM.from_pretrained`` and vLLM load
it by path. The checkpoint's shards are read with DCP in single-process mode (no process group, no GPU needed)
into full tensors, whatever the number of ranks that wrote them; the model skeleton is built on the meta device
from ``huggingface/config.json`` (no random initialisation, no second copy of the weights) and saved with
``save_pretrained`` (which writes tied weights once).

A LoRA checkpoint (``actor_rollout_ref.model.lora_rank > 0``: the peft model's state, base weights and adapters,
plus ``huggingface/adapter_config.json``) is exported **merged**: each adapted weight becomes ``W + scaling * B @ A``
under the base model's name and the folder is a plain model of the base architecture (no adapter files), exactly
the weights the rollout engine ran with.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch

from verl.utils.checkpoint.manager import CheckpointError
from verl.utils.checkpoint.model_state import (
    ADAPTER_CONFIG_FILE,
    DCP_METADATA_FILE,
    HF_SUBDIR,
    MODEL_SUBDIR,
    TOKENIZER_FILES,
    is_model_checkpoint_dir,
)
from verl.utils.lora import is_adapter_weight

__all__ = ["find_model_checkpoint_dir", "load_full_model_state_dict", "merge_checkpoint_to_hf"]

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]


def find_model_checkpoint_dir(local_dir: PathLike) -> Path:
    """The model checkpoint folder for ``local_dir``: the folder itself (``.../global_step_N/actor``) or its
    ``actor`` subfolder when given a ``global_step_N`` folder. ``CheckpointError`` when neither is one."""
    path = Path(local_dir).expanduser().absolute()
    if not path.exists():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    if is_model_checkpoint_dir(path):
        return path
    if is_model_checkpoint_dir(path / "actor"):
        return path / "actor"
    raise CheckpointError(
        f"{path} is not a model checkpoint: expected {MODEL_SUBDIR}/{DCP_METADATA_FILE} (written by "
        "verl.utils.checkpoint.save_model_shards) in it or in its actor/ subfolder"
    )


def load_full_model_state_dict(ckpt_dir: PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the model checkpoint in ``ckpt_dir`` as a full CPU tensor, in the stored dtype."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model_dir = find_model_checkpoint_dir(ckpt_dir) / MODEL_SUBDIR
    metadata = FileSystemReader(str(model_dir)).read_metadata()
    state = {
        name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for name, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        raise CheckpointError(f"{model_dir} holds no tensors")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, checkpoint_id=str(model_dir), no_dist=True)
    return state


def _resolve_target_dtype(dtype: Union[str, torch.dtype, None], config: Any) -> torch.dtype:
    from verl.utils.model_loading import resolve_dtype

    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return resolve_dtype(dtype)


def _copy_tokenizer_files(sources: list[Path], target: Path) -> None:
    """Copy tokenizer files + generation config from the first source folder that has a tokenizer."""
    for source in sources:
        if any((source / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            for name in TOKENIZER_FILES:
                src = source / name
                if src.is_file() and src.absolute() != (target / name).absolute():
                    shutil.copy2(src, target / name)
            return
    logger.warning(
        "no tokenizer files in %s; %s has weights and config only (pass --hf_model_path to add them)",
        [str(s) for s in sources],
        target,
    )


def _merge_lora(
    state: dict[str, torch.Tensor], config: Any, hf_dir: Path, ckpt_dir: Path, trust_remote_code: bool
) -> dict[str, torch.Tensor]:
    """The base model's state of a peft LoRA checkpoint: ``W + scaling * B @ A`` for every adapted weight under the
    base model's names, adapters dropped; the same computation as the rollout weight sync
    (``verl.utils.rollout_weights.iter_rollout_weights``), on a peft skeleton built on the meta device from the
    checkpoint's ``huggingface/adapter_config.json``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from verl.utils.rollout_weights import iter_rollout_weights

    if not (hf_dir / ADAPTER_CONFIG_FILE).is_file():
        raise CheckpointError(
            f"{ckpt_dir} holds LoRA adapter weights but {hf_dir}/{ADAPTER_CONFIG_FILE} is missing: the adapters' "
            "scaling (lora_alpha / r) is unknown, so they cannot be merged"
        )
    lora_config = LoraConfig.from_pretrained(str(hf_dir))
    lora_config.base_model_name_or_path = None  # the folder it trained from; the skeleton below has no name
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        model = get_peft_model(base, lora_config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise CheckpointError(
            f"{ckpt_dir}: the LoRA checkpoint does not match {hf_dir}/{ADAPTER_CONFIG_FILE} "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.tie_weights()
    return {name: tensor for bucket in iter_rollout_weights(model) for name, tensor in bucket}


def merge_checkpoint_to_hf(
    local_dir: PathLike,
    target_dir: PathLike,
    dtype: Union[str, torch.dtype, None] = "auto",
    hf_model_path: Optional[PathLike] = None,
    trust_remote_code: bool = False,
) -> Path:
    """Write the model of checkpoint ``local_dir`` as a Hugging Face folder ``target_dir`` and return it.

    Args:
        local_dir: ``global_step_N/actor`` (or ``global_step_N``, whose ``actor/`` is used).
        target_dir: output folder (created; existing files with the same names are overwritten).
        dtype: weight dtype of the output; ``"auto"`` = the config's ``dtype`` (float32 when unset).
        hf_model_path: base model folder for config/tokenizer when the checkpoint has no ``huggingface/``.
        trust_remote_code: passed to transformers for custom architectures.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl.utils.fsdp_utils import clean_param_name

    ckpt_dir = find_model_checkpoint_dir(local_dir)
    hf_dir = ckpt_dir / HF_SUBDIR
    if not (hf_dir / "config.json").is_file():
        if hf_model_path is None:
            raise CheckpointError(f"{hf_dir}/config.json is missing; pass --hf_model_path (the base model folder)")
        hf_dir = Path(hf_model_path)
        if not (hf_dir / "config.json").is_file():
            raise CheckpointError(f"hf_model_path {hf_dir} has no config.json")
    target = Path(target_dir).expanduser().absolute()
    if target in (ckpt_dir, ckpt_dir / MODEL_SUBDIR, ckpt_dir / "optim"):
        raise CheckpointError(f"target_dir {target} must not be the checkpoint folder itself")

    config = AutoConfig.from_pretrained(str(hf_dir), trust_remote_code=trust_remote_code)
    target_dtype = _resolve_target_dtype(dtype, config)
    state = {clean_param_name(k): v for k, v in load_full_model_state_dict(ckpt_dir).items()}
    if any(is_adapter_weight(k) for k in state):
        state = _merge_lora(state, config, hf_dir, ckpt_dir, trust_remote_code)
    state = {k: v.to(target_dtype) if v.is_floating_point() else v for k, v in state.items()}

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=target_dtype, trust_remote_code=trust_remote_code)
    expected = set(model.state_dict().keys())
    unexpected = sorted(set(state) - expected)
    if unexpected:
        raise CheckpointError(
            f"{ckpt_dir}: {len(unexpected)} tensors do not belong to {type(model).__name__}, e.g. {unexpected[:5]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    still_meta = [name for name, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    if still_meta:
        raise CheckpointError(
            f"{ckpt_dir}: checkpoint lacks {len(still_meta)} weights of {type(model).__name__}, e.g. {still_meta[:5]}"
        )

    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(target))
    _copy_tokenizer_files([hf_dir] + ([Path(hf_model_path)] if hf_model_path is not None else []), target)
    trained_generation_config = hf_dir / "generation_config.json"  # the trained model's, saved with the shards
    if trained_generation_config.is_file() and hf_dir.absolute() != target:
        shutil.copy2(trained_generation_config, target / "generation_config.json")
    logger.info("merged %s (%d tensors, %s) into %s", ckpt_dir, len(state), target_dtype, target)
    return target
