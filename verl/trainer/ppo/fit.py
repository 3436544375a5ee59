"""The outer training loop: steps, validation, checkpoints, resume, logging, progress bar."""

from __future__ import annotations

import logging
import os
import pickle
import random
import time
from typing import Any, Protocol

import numpy as np
import torch
from tqdm import tqdm

from verl.protocol import DataProto

logger = logging.getLogger(__name__)


class Trainer(Protocol):
    """What :func:`fit` needs of a trainer (both trainers get it from ``trainer_core.TrainerCore``)."""

    config: Any
    wg: Any
    tracker: Any
    global_step: int
    last_val_samples: list[dict]

    def train_step(self, batch: DataProto, next_batch=None) -> dict[str, float]: ...

    def validate(self, val_loader) -> dict[str, float]: ...

    def checkpoint_groups(self) -> dict[str, Any]: ...


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def fit(trainer: Trainer, train_loader, val_loader, ckpt_manager, total_steps: int) -> list[dict]:
    """Run ``total_steps`` training steps (resuming from the latest checkpoint if configured).

    With ``trainer.max_wall_time_s`` set, the loop stops after the first step that ends past that
    many seconds, validates (when ``test_freq`` > 0) and writes a checkpoint, so a run can span
    several time-limited commands.
    """
    tc = trainer.config.trainer
    started = time.monotonic()
    max_wall = tc.get("max_wall_time_s")
    history: list[dict] = []
    resume_dir = ckpt_manager.resolve_resume(tc.get("resume_mode", "auto"), tc.get("resume_from_path"))
    if resume_dir is not None:
        with open(os.path.join(resume_dir, "trainer_state.pkl"), "rb") as f:
            state = pickle.load(f)
        trainer.global_step = state["global_step"]
        train_loader.load_state_dict(state["dataloader"])
        _set_rng_state(state["rng"])
        for name, group in trainer.checkpoint_groups().items():
            group.load_checkpoint(os.path.join(resume_dir, name))
        trainer.wg.sync_rollout_weights()
        logger.info("resumed from %s at step %d", resume_dir, trainer.global_step)
        print(f"[trainer] resumed from {resume_dir} (step {trainer.global_step})")

    test_freq, save_freq = int(tc.get("test_freq", -1) or -1), int(tc.get("save_freq", -1) or -1)
    if val_loader is not None and tc.get("val_before_train", True) and trainer.global_step == 0:
        val = trainer.validate(val_loader)
        _log(trainer, val, 0)
        history.append({"step": 0, **val})

    bar = tqdm(
        total=total_steps, initial=trainer.global_step, desc="training", disable=not tc.get("progress_bar", True)
    )
    epoch_iter = iter(train_loader)

    def next_batch() -> DataProto:
        nonlocal epoch_iter
        try:
            batch_dict = next(epoch_iter)
        except StopIteration:  # next epoch
            epoch_iter = iter(train_loader)
            batch_dict = next(epoch_iter)
        return DataProto.from_single_dict(batch_dict)

    while trainer.global_step < total_steps:
        batch = next_batch()
        trainer.global_step += 1
        step = trainer.global_step
        metrics = trainer.train_step(batch, next_batch=next_batch)
        metrics["training/global_step"] = step
        last = step == total_steps
        out_of_time = max_wall is not None and not last and time.monotonic() - started > float(max_wall)
        # the last step of a command validates too (what it checkpoints is what the curve ends on)
        if val_loader is not None and test_freq > 0 and (step % test_freq == 0 or last or out_of_time):
            metrics.update(trainer.validate(val_loader))
        if (save_freq > 0 and (step % save_freq == 0 or last)) or out_of_time:
            _save(trainer, train_loader, ckpt_manager, step)
        _log(trainer, metrics, step)
        history.append({"step": step, **metrics})
        bar.update(1)
        bar.set_postfix(score=f"{metrics.get('critic/score/mean', float('nan')):.3f}")
        if out_of_time:
            print(
                f"[trainer] stopping at step {step}/{total_steps} after {time.monotonic() - started:.0f} s "
                f"(trainer.max_wall_time_s={max_wall}); checkpoint written: run the same command again "
                "with trainer.resume_mode=auto to continue"
            )
            break
    bar.close()
    return history


def _save(trainer, train_loader, ckpt_manager, step: int) -> None:
    def write(tmp_dir: str) -> None:
        for name, group in trainer.checkpoint_groups().items():
            group.save_checkpoint(os.path.join(tmp_dir, name))
        state = {"global_step": step, "dataloader": train_loader.state_dict(), "rng": _rng_state()}
        with open(os.path.join(tmp_dir, "trainer_state.pkl"), "wb") as f:
            pickle.dump(state, f)

    ckpt_manager.save(step, write)


def _log(trainer, metrics: dict, step: int) -> None:
    if trainer.tracker is None:
        return
    trainer.tracker.log(data=metrics, step=step)
    samples = trainer.last_val_samples
    if samples and any(k.startswith("val-core/") for k in metrics):
        n = int(trainer.config.trainer.get("log_val_generations", 0) or 0)
        if n > 0:
            trainer.tracker.log_generations(samples[:n], step=step)
