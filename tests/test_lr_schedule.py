"""The LR schedule: ``optim.warmup_style`` (constant / cosine), ``min_lr_ratio``, ``lr_warmup_steps(_ratio)``.

Cosine is verl's ``get_cosine_schedule_with_warmup`` (half a cycle, ``min_lr_ratio`` floor) after our linear
warm-up ``(s + 1) / W``; the values below are computed by hand. The actor and the critic workers build their
schedules from the config (``build_optim_and_scheduler``), so every key reaches both.
"""

from __future__ import annotations

import math

import pytest
import torch

from verl.utils.fsdp_utils import build_lr_scheduler, build_optimizer

# W = 2 warm-up steps, 6 total steps, floor 0.1 (lr 1.0): 1/2, 2/2, then 0.1 + 0.45 * (1 + cos(pi * (s - 2) / 4))
COSINE = [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + math.sqrt(0.5)), 0.55, 0.1 + 0.45 * (1 - math.sqrt(0.5)), 0.1, 0.1]


def lr_sequence(optimizer, scheduler, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def make_optimizer(lr: float = 1.0):
    return build_optimizer([torch.nn.Parameter(torch.zeros(1))], lr=lr, weight_decay=0.0)


def test_cosine_with_min_lr_ratio_matches_hand_computed_values():
    assert COSINE[3] == pytest.approx(0.868198, abs=1e-6) and COSINE[5] == pytest.approx(0.231802, abs=1e-6)
    opt = make_optimizer()
    sched = build_lr_scheduler(opt, 6, lr_warmup_steps=2, warmup_style="cosine", min_lr_ratio=0.1)
    assert lr_sequence(opt, sched, 8) == pytest.approx(COSINE, abs=1e-9)
    # no floor: decays to 0; no warm-up: starts at the full lr
    opt = make_optimizer(2.0)
    sched = build_lr_scheduler(opt, 4, lr_warmup_steps=0, warmup_style="cosine", min_lr_ratio=None)
    assert lr_sequence(opt, sched, 5) == pytest.approx([2.0, 1.0 + math.sqrt(0.5), 1.0, 1.0 - math.sqrt(0.5), 0.0])


def test_constant_and_warmup_step_keys():
    opt = make_optimizer()  # constant: min_lr_ratio does not apply (as in verl)
    sched = build_lr_scheduler(opt, 6, lr_warmup_steps=4, warmup_style="constant", min_lr_ratio=0.5)
    assert lr_sequence(opt, sched, 6) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    opt = make_optimizer()  # lr_warmup_steps=0 is no warm-up even with a ratio; a negative one defers to the ratio
    assert lr_sequence(opt, build_lr_scheduler(opt, 10, 0, lr_warmup_steps_ratio=0.5), 2) == [1.0, 1.0]
    opt = make_optimizer()
    assert lr_sequence(opt, build_lr_scheduler(opt, 10, -1, lr_warmup_steps_ratio=0.2), 3) == pytest.approx(
        [0.5, 1.0, 1.0]
    )


def test_bad_schedule_keys_are_named():
    with pytest.raises(ValueError, match=r"optim.min_lr_ratio must be in \[0, 1\], got 1.5"):
        build_lr_scheduler(make_optimizer(), 10, warmup_style="cosine", min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="optim.warmup_style=cosine needs optim.total_training_steps >= 1"):
        build_lr_scheduler(make_optimizer(), -1, warmup_style="cosine")
    with pytest.raises(ValueError, match="unknown optim.warmup_style 'linear'"):
        build_lr_scheduler(make_optimizer(), 10, warmup_style="linear")


def test_workers_build_the_configured_schedule(monkeypatch, tiny_model_path):
    from tests.cpu_workers import build_cpu_workers

    actor, critic = build_cpu_workers(
        monkeypatch,
        tiny_model_path,
        [
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "critic.model.enable_gradient_checkpointing=False",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "critic.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.optim.lr=1.0",
            "actor_rollout_ref.actor.optim.total_training_steps=6",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
            "actor_rollout_ref.actor.optim.warmup_style=cosine",
            "actor_rollout_ref.actor.optim.min_lr_ratio=0.1",
            "critic.optim.lr=1.0",
            "critic.optim.total_training_steps=6",
            "critic.optim.lr_warmup_steps_ratio=0.34",  # int(0.34 * 6) = 2 warm-up steps
            "critic.optim.warmup_style=cosine",
            "critic.optim.min_lr_ratio=0.1",
        ],
    )
    assert lr_sequence(actor.optimizer, actor.lr_scheduler, 8) == pytest.approx(COSINE, abs=1e-9)
    assert lr_sequence(critic.optimizer, critic.lr_scheduler, 8) == pytest.approx(COSINE, abs=1e-9)
