"""Checkpointing: crash-safe ``global_step_N`` folders, sharded model/optimizer state, RNG and trainer state,
and export of a checkpoint's model as a Hugging Face folder.

Layout under ``trainer.default_local_dir``::

    latest_checkpointed_iteration.txt       step of the last save (informative; resume trusts COMPLETE markers)
    global_step_N/
        COMPLETE                            JSON: step, time, world_size, ... (written last, before the rename)
        actor/                              save_model_shards: model/, optim/ (DCP), lr_scheduler.pt,
                                            rng_rank<r>.pt, checkpoint_meta.json, huggingface/
        data.pt                             save_trainer_state: global_step, dataloader state, driver RNG

Saving from the trainer (driver process)::

    manager = CheckpointManager(cfg.trainer.default_local_dir, cfg.trainer.max_actor_ckpt_to_keep)
    def write(tmp_dir):
        actor_wg.save_checkpoint(str(tmp_dir / "actor"))     # every rank: save_model_shards(...)
        save_trainer_state(tmp_dir, global_step, train_dataloader.state_dict())
    manager.save(global_step, write, world_size=actor_wg.world_size)

Resuming: ``path = manager.resolve_resume(cfg.trainer.resume_mode, cfg.trainer.resume_from_path)``; when not
``None``, every rank calls ``load_model_shards(path / "actor", ...)`` and the driver
``load_trainer_state(path)`` (then ``train_dataloader.load_state_dict(state["dataloader"])``).
"""

from verl.utils.checkpoint.hf_export import (
    find_model_checkpoint_dir,
    load_full_model_state_dict,
    merge_checkpoint_to_hf,
)
from verl.utils.checkpoint.manager import (
    COMPLETE_MARKER,
    LATEST_ITERATION_FILE,
    CheckpointError,
    CheckpointManager,
    atomic_write_text,
    is_complete_checkpoint,
    read_checkpoint_meta,
    validate_checkpoint_dir,
)
from verl.utils.checkpoint.model_state import (
    HF_SUBDIR,
    is_model_checkpoint_dir,
    load_model_shards,
    read_model_checkpoint_meta,
    save_hf_assets,
    save_model_shards,
)
from verl.utils.checkpoint.rng_state import (
    get_rng_state,
    load_rng_state,
    load_trainer_state,
    save_rng_state,
    save_trainer_state,
    set_rng_state,
)

__all__ = [
    "COMPLETE_MARKER",
    "LATEST_ITERATION_FILE",
    "HF_SUBDIR",
    "CheckpointError",
    "CheckpointManager",
    "atomic_write_text",
    "is_complete_checkpoint",
    "read_checkpoint_meta",
    "validate_checkpoint_dir",
    "is_model_checkpoint_dir",
    "save_hf_assets",
    "save_model_shards",
    "load_model_shards",
    "read_model_checkpoint_meta",
    "get_rng_state",
    "set_rng_state",
    "save_rng_state",
    "load_rng_state",
    "save_trainer_state",
    "load_trainer_state",
    "find_model_checkpoint_dir",
    "load_full_model_state_dict",
    "merge_checkpoint_to_hf",
]
