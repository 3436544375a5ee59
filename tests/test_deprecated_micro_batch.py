"""Deprecated global micro-batch keys keep upstream verl's meaning: a size summed over the data-parallel ranks.

``ppo_micro_batch_size`` / ``log_prob_micro_batch_size`` (actor, rollout, ref) and ``critic.ppo_micro_batch_size``
/ ``forward_micro_batch_size`` are divided by the data-parallel size to give the per-GPU value, with a deprecation
warning; setting a key together with its ``_per_gpu`` twin, or less than one row per GPU, is an error naming both.
The call site check runs 2 gloo ranks: the actor and the critic divide by the real world size, and the
old-log-prob pass then runs micro-batches of ``global / 2`` rows.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tests.rank_processes import spawn
from tests.test_dp_actor import make_update_data
from verl.utils.model_loading import load_causal_lm
from verl.workers.actor.settings import ActorSettings, per_gpu_from_global
from verl.workers.critic.dp_critic import CriticSettings


def test_global_sizes_are_divided_by_the_data_parallel_size(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        actor = ActorSettings.from_config({"ppo_micro_batch_size": 8, "log_prob_micro_batch_size": 4}, dp_size=2)
    assert actor.ppo_micro_batch_size_per_gpu == 4
    assert actor.log_prob_micro_batch_size_per_gpu == 2 and actor.log_prob_micro_batch_size == 2
    assert "actor.ppo_micro_batch_size=8 is deprecated" in caplog.text
    assert "ppo_micro_batch_size_per_gpu=4 per GPU" in caplog.text

    critic = CriticSettings.from_config({"ppo_micro_batch_size": 6, "forward_micro_batch_size": 10}, dp_size=2)
    assert critic.ppo_micro_batch_size_per_gpu == 3 and critic.forward_micro_batch_size_per_gpu == 5

    # one rank: the global size is the per-GPU size; per-GPU keys are never divided
    assert ActorSettings.from_config({"ppo_micro_batch_size": 8}).ppo_micro_batch_size_per_gpu == 8
    assert ActorSettings.from_config({"ppo_micro_batch_size_per_gpu": 8}, dp_size=2).ppo_micro_batch_size_per_gpu == 8

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert per_gpu_from_global(5, 2, "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu") == 2
    assert "1 rows rounded away" in caplog.text
    assert per_gpu_from_global(None, 4, "a", "a_per_gpu", per_gpu=3) == 3


def test_bad_global_sizes_name_the_keys() -> None:
    with pytest.raises(ValueError, match=r"actor.ppo_micro_batch_size=4 and actor.ppo_micro_batch_size_per_gpu=2"):
        ActorSettings.from_config({"ppo_micro_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2}, dp_size=2)
    with pytest.raises(ValueError, match=r"critic.ppo_micro_batch_size=2 is a global .* must be >= 4"):
        CriticSettings.from_config({"ppo_micro_batch_size": 2}, dp_size=4)


ROWS_PER_RANK = 4


def _rank_main(rank: int, init_file: str, model_path: str, data_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from verl.workers.actor import DataParallelPPOActor
    from verl.workers.critic.dp_critic import DataParallelPPOCritic

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = load_causal_lm(model_path, dtype="float32", attn_implementation="sdpa")
        actor = DataParallelPPOActor({"ppo_micro_batch_size": 8, "log_prob_micro_batch_size": 4}, model)
        critic = DataParallelPPOCritic({"ppo_micro_batch_size": 6}, torch.nn.Linear(2, 1))
        rows: list[int] = []
        handle = model.register_forward_pre_hook(
            lambda _m, _a, kwargs: rows.append(int(kwargs["input_ids"].shape[0])), with_kwargs=True
        )
        data = torch.load(data_file, weights_only=False)[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]
        actor.compute_log_prob(data)
        handle.remove()
        torch.save(
            {
                "actor": (actor.settings.ppo_micro_batch_size_per_gpu, actor.settings.log_prob_micro_batch_size),
                "critic": critic.settings.ppo_micro_batch_size_per_gpu,
                "log_prob_rows": rows,
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_actor_and_critic_divide_by_the_world_size(tiny_model_path, tmp_path) -> None:
    model = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa")
    torch.save(make_update_data(model, num_conv=2 * ROWS_PER_RANK, seed=2), tmp_path / "data.pt")
    spawn(
        _rank_main,
        nprocs=2,
        join=True,
        args=(str(tmp_path / "init"), str(tiny_model_path), str(tmp_path / "data.pt"), str(tmp_path)),
    )
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert out["actor"] == (4, 2)
        assert out["critic"] == 3
        assert out["log_prob_rows"] == [2, 2]  # log_prob_micro_batch_size=4 over 2 ranks: 2 rows per forward
