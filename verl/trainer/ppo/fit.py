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
from verl.trainer.ppo.signals import GracefulStop, StepAbandoned

logger = logging.getLogger(__name__)


class Trainer(Protocol):
    """What :func:`fit` needs of a trainer (both trainers get it from ``trainer_core.TrainerCore``)."""

    conf: Any  # the typed config (verl.trainer.config.PPOConfig); fit reads conf.trainer
    wg: Any
    tracker: Any
    global_step: int
    last_val_samples: list[dict]

    def train_step(self, batch: DataProto, next_batch=None, upcoming: DataProto | None = None) -> dict[str, float]: ...

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

    SIGTERM (:mod:`verl.trainer.ppo.signals`): the step in flight finishes, is logged and checkpointed, and
    ``fit`` returns; a second SIGTERM abandons the step (``StepAbandoned``, exit code 143) without saving.

    Each step's metrics are logged before its checkpoint is written, so a checkpoint never exists for a step
    whose metrics were lost. On start the tracker drops entries of steps after the resumed one
    (``Tracking.resume_at``): a resumed run logs every step once.
    """
    started = time.monotonic()
    history: list[dict] = []
    with GracefulStop() as stop:  # installed before the resume: a SIGTERM while loading is a stop, too
        try:
            stop.doing = "loading the checkpoint to resume from"
            upcoming = _resume(trainer, train_loader, ckpt_manager)
            _loop(trainer, train_loader, val_loader, ckpt_manager, total_steps, history, stop, started, upcoming)
        except BaseException as exc:
            if not (isinstance(exc, StepAbandoned) or stop.abandoned):
                raise
            latest = ckpt_manager.find_latest()
            print(
                f"[trainer] abandoned {stop.doing} on a second {stop.signal_name}; nothing new was saved. "
                f"Latest checkpoint: {latest or 'none'}. " + _resume_hint(latest, ckpt_manager),
                flush=True,
            )
            if isinstance(exc, StepAbandoned):
                raise
            raise StepAbandoned() from exc  # exit code 143 even when a library re-raised it as its own error
    return history


def _resume(trainer, train_loader, ckpt_manager) -> DataProto | None:
    """Load the latest checkpoint (per ``trainer.resume_mode``); returns the next step's batch when the checkpoint
    holds one (drawn ahead for ``trainer.rollout_overlap``; its rollout is generated again)."""
    tc = trainer.conf.trainer
    resume_dir = ckpt_manager.resolve_resume(tc.resume_mode, tc.resume_from_path)
    upcoming = None
    if resume_dir is not None:
        with open(os.path.join(resume_dir, "trainer_state.pkl"), "rb") as f:
            state = pickle.load(f)
        trainer.global_step = state["global_step"]
        train_loader.load_state_dict(state["dataloader"])
        _set_rng_state(state["rng"])
        upcoming = state.get("upcoming")
        for name, group in trainer.checkpoint_groups().items():
            group.load_checkpoint(os.path.join(resume_dir, name))
        trainer.wg.sync_rollout_weights()
        logger.info("resumed from %s at step %d", resume_dir, trainer.global_step)
        print(f"[trainer] resumed from {resume_dir} (step {trainer.global_step})", flush=True)
    resume_at = getattr(trainer.tracker, "resume_at", None)
    if callable(resume_at):  # drop logged lines of steps this run redoes (verl.utils.tracking)
        resume_at(trainer.global_step if resume_dir is not None else None)
    return upcoming


def _resume_hint(latest, ckpt_manager) -> str:
    if latest is None:
        return "Run the same command again to start over."
    return (
        f"Run the same command again (trainer.resume_mode=auto) to continue from step {ckpt_manager.step_of(latest)}."
    )


def _stop_on_signal(trainer, train_loader, ckpt_manager, stop, total_steps: int, saved_step: int, upcoming) -> None:
    """The loop got SIGTERM: checkpoint the last finished step unless it is already saved, say how to resume."""
    step = trainer.global_step
    if step > saved_step:
        stop.start(f"the checkpoint of step {step}")
        _save(trainer, train_loader, ckpt_manager, step, upcoming)
        print(
            f"[trainer] {stop.signal_name}: stopped after step {step}/{total_steps}; checkpoint written to "
            f"{ckpt_manager.find_latest()}. " + _resume_hint(ckpt_manager.find_latest(), ckpt_manager),
            flush=True,
        )
        return
    print(
        f"[trainer] {stop.signal_name}: stopping before step {step + 1}/{total_steps}; no step ran since the last "
        f"checkpoint, so none is written. " + _resume_hint(ckpt_manager.find_latest(), ckpt_manager),
        flush=True,
    )


def _loop(trainer, train_loader, val_loader, ckpt_manager, total_steps, history, stop, started, upcoming) -> None:
    """The steps. With ``trainer.rollout_overlap`` each step also gets the next step's batch (``upcoming``), drawn
    before the step so its rollout can run during the update; a checkpoint keeps it (the loader is past it)."""
    tc = trainer.conf.trainer
    max_wall = tc.max_wall_time_s
    test_freq, save_freq = tc.test_freq, tc.save_freq
    saved_step = trainer.global_step  # the resumed checkpoint's step (0: fresh, nothing to save yet)
    if val_loader is not None and tc.val_before_train and trainer.global_step == 0 and not stop.requested:
        stop.doing = "the validation before training"
        val = trainer.validate(val_loader)
        _log(trainer, val, 0)
        history.append({"step": 0, **val})

    bar = tqdm(total=total_steps, initial=trainer.global_step, desc="training", disable=not tc.progress_bar)
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
        # SIGTERM during the last step (or before the first): save it, then stop; one from here on finishes this one
        if stop.stop_before(f"step {trainer.global_step + 1}/{total_steps}"):
            _stop_on_signal(trainer, train_loader, ckpt_manager, stop, total_steps, saved_step, upcoming)
            break
        batch = upcoming if upcoming is not None else next_batch()
        trainer.global_step += 1
        step = trainer.global_step
        upcoming = next_batch() if tc.rollout_overlap and step < total_steps else None
        metrics = trainer.train_step(batch, next_batch=next_batch, upcoming=upcoming)
        metrics["training/global_step"] = step
        last = step == total_steps
        out_of_time = max_wall is not None and not last and time.monotonic() - started > float(max_wall)
        # the last step of a command validates too (what it checkpoints is what the curve ends on)
        if val_loader is not None and test_freq > 0 and (step % test_freq == 0 or last or out_of_time):
            metrics.update(trainer.validate(val_loader))
        _log(trainer, metrics, step)  # before the checkpoint: a kill after the save never loses the step's metrics
        history.append({"step": step, **metrics})
        if (save_freq > 0 and (step % save_freq == 0 or last)) or out_of_time:
            stop.start(f"the checkpoint of step {step}")
            _save(trainer, train_loader, ckpt_manager, step, upcoming)
            saved_step = step
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


def _save(trainer, train_loader, ckpt_manager, step: int, upcoming: DataProto | None = None) -> None:
    def write(tmp_dir: str) -> None:
        for name, group in trainer.checkpoint_groups().items():
            group.save_checkpoint(os.path.join(tmp_dir, name))
        state = {"global_step": step, "dataloader": train_loader.state_dict(), "rng": _rng_state()}
        if upcoming is not None:  # drawn ahead (trainer.rollout_overlap): the loader's state is already past it
            state["upcoming"] = upcoming
        with open(os.path.join(tmp_dir, "trainer_state.pkl"), "wb") as f:
            pickle.dump(state, f)

    ckpt_manager.save(step, write)


def _log(trainer, metrics: dict, step: int) -> None:
    if trainer.tracker is None:
        return
    trainer.tracker.log(data=metrics, step=step)
    samples = trainer.last_val_samples
    if samples and any(k.startswith("val-core/") for k in metrics):
        n = trainer.conf.trainer.log_val_generations
        if n > 0:
            trainer.tracker.log_generations(samples[:n], step=step)
