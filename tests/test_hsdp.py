"""HSDP: ``fsdp_config.fsdp_size`` shards within groups of that many ranks and replicates across the groups.

Four CPU ranks (gloo, ``tests.rank_processes.spawn``), the tiny Qwen2 model:
* ``init_fsdp_mesh(2)`` over 4 ranks is the 2-D mesh ``(ddp=2, fsdp=2)``; parameters are ``(Replicate, Shard(0))``
  DTensors; ``-1`` and ``>= world`` give the 1-D mesh (plain FSDP); a size that does not divide the world is an
  error naming the key;
* one actor update (one optimizer step over 8 rows, 2 per rank) under 2x2 HSDP gives the same parameters as plain
  FSDP over 4 ranks and as one process on all 8 rows;
* the key reaches the workers: ``ActorRolloutRefWorker`` shards actor and ref over the 2-D mesh when
  ``actor_rollout_ref.actor.fsdp_config.fsdp_size=2`` (and its checkpoint saves and loads back), and
  ``CriticWorker`` does for ``critic.model.fsdp_config.fsdp_size=2``.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from omegaconf import OmegaConf

from tests.rank_processes import spawn_with_data
from tests.test_config import worker_config
from tests.test_dp_actor import actor_config, make_update_data
from verl.utils.model_loading import load_causal_lm
from verl.workers.actor import DataParallelPPOActor

WORLD = 4
ROWS_PER_RANK = 2
# one optimizer step whose mini-batch is the union of every rank's rows
UPDATE_CONFIG = dict(train_batch_size=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, use_kl_loss=False)


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Plain SGD with lr 1: the step is the (clipped) gradient itself, so the comparison is not blurred by Adam's
    normalisation, which turns ~1e-9 rounding differences of near-zero gradients into lr-sized steps."""
    return torch.optim.SGD(model.parameters(), lr=1.0)


def _mesh_of(module: torch.nn.Module):
    param = next(module.parameters())
    return param.device_mesh, param.placements


def _update_with_mesh(model_path: str, data, mesh) -> dict[str, torch.Tensor]:
    from verl.utils.fsdp_utils import apply_fsdp2, get_full_state_dict

    model = load_causal_lm(model_path, dtype="float32", attn_implementation="sdpa")
    apply_fsdp2(model, mesh=mesh)
    actor = DataParallelPPOActor(actor_config(**UPDATE_CONFIG), model, _sgd(model))
    actor.update_policy(data)
    return get_full_state_dict(model)


def _rank_main(rank: int, init_file: str, model_path: str, data_file: str, configs: dict, out_dir: str):
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    import verl.workers.rollout.base as rollout_base
    from verl.utils.fsdp_utils import init_fsdp_mesh

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", VERL_SC_DEVICE="cpu")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        out: dict = {}
        hsdp = init_fsdp_mesh(2, "cpu")
        out["hsdp_mesh"] = (tuple(hsdp.shape), hsdp.mesh_dim_names)
        out["plain_meshes"] = [tuple(init_fsdp_mesh(size, "cpu").shape) for size in (-1, None, 4, 8)]
        try:
            init_fsdp_mesh(3, "cpu", key="actor_rollout_ref.actor.fsdp_config.fsdp_size")
        except ValueError as err:
            out["bad_size_error"] = str(err)

        rows = list(range(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK))
        data = torch.load(data_file, weights_only=False)[rows]
        hsdp_state = _update_with_mesh(model_path, data, hsdp)
        plain_state = _update_with_mesh(model_path, data, init_fsdp_mesh(-1, "cpu"))

        # the key reaches the workers (the rollout engine is not what is tested here)
        rollout_base.get_rollout_engine = lambda name, **kwargs: None
        from verl.workers.critic.critic_worker import CriticWorker
        from verl.workers.fsdp_workers import ActorRolloutRefWorker

        worker = ActorRolloutRefWorker(configs["actor_rollout_ref"], "cpu")
        worker.init_model()
        mesh, placements = _mesh_of(worker.actor_module)
        ref_mesh, _ = _mesh_of(worker.ref.actor_module)
        out["worker_mesh"] = (tuple(mesh.shape), mesh.mesh_dim_names, placements == (Replicate(), Shard(0)))
        out["ref_mesh"] = (tuple(ref_mesh.shape), ref_mesh.mesh_dim_names)
        # a checkpoint of the HSDP-sharded actor loads back (DCP with 2-D DTensors)
        from verl.utils.fsdp_utils import get_full_state_dict

        before = get_full_state_dict(worker.actor_module)
        worker.save_checkpoint(os.path.join(out_dir, "ckpt"))
        with torch.no_grad():
            for param in worker.actor_module.parameters():
                param.zero_()
        worker.load_checkpoint(os.path.join(out_dir, "ckpt"))
        after = get_full_state_dict(worker.actor_module)
        out["checkpoint_round_trip"] = all(torch.equal(before[k], after[k]) for k in before)
        critic = CriticWorker(configs["critic"], "cpu")
        critic.init_model()
        critic_mesh, _ = _mesh_of(critic.critic_module)
        out["critic_mesh"] = (tuple(critic_mesh.shape), critic_mesh.mesh_dim_names)
        if rank == 0:
            out["hsdp_state"], out["plain_state"] = hsdp_state, plain_state
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _worker_configs(model_path: str) -> dict:
    cfg = worker_config(
        model_path,
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.train_batch_size=1",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=2",
        "critic.model.fsdp_config.fsdp_size=2",
    )
    return {
        "actor_rollout_ref": OmegaConf.to_container(cfg.actor_rollout_ref, resolve=True),
        "critic": OmegaConf.to_container(cfg.critic, resolve=True),
    }


def test_hsdp_2x2_matches_plain_fsdp_and_one_process(tiny_model_path, tmp_path):
    base = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa")
    data = make_update_data(base, num_conv=WORLD * ROWS_PER_RANK, seed=3)
    results = spawn_with_data(_rank_main, WORLD, tmp_path, tiny_model_path, data, _worker_configs(tiny_model_path))

    for out in results:
        assert out["hsdp_mesh"] == ((2, 2), ("ddp", "fsdp"))
        assert out["plain_meshes"] == [(4,)] * 4
        assert (
            "actor_rollout_ref.actor.fsdp_config.fsdp_size=3 must divide the number of ranks (4)"
            in (out["bad_size_error"])
        )
        assert out["worker_mesh"] == ((2, 2), ("ddp", "fsdp"), True)
        assert out["ref_mesh"] == ((2, 2), ("ddp", "fsdp"))
        assert out["checkpoint_round_trip"]
        assert out["critic_mesh"] == ((2, 2), ("ddp", "fsdp"))

    model = copy.deepcopy(base)
    actor = DataParallelPPOActor(actor_config(**UPDATE_CONFIG), model, _sgd(model))
    actor.update_policy(data)
    single = model.state_dict()
    hsdp, plain = results[0]["hsdp_state"], results[0]["plain_state"]
    assert set(hsdp) == set(plain) == set(single)
    for name, value in single.items():
        torch.testing.assert_close(hsdp[name], value, atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(hsdp[name], plain[name], atol=1e-6, rtol=0, msg=name)
    moved = [name for name in single if not torch.equal(single[name], base.state_dict()[name])]
    assert len(moved) == len(single)  # the step changed every parameter: the comparison is not vacuous


@pytest.mark.parametrize("size", [-1, 1])
def test_fsdp_size_without_process_group_is_a_clear_error(size):
    from verl.utils.fsdp_utils import init_fsdp_mesh

    with pytest.raises(RuntimeError, match="torch.distributed"):
        init_fsdp_mesh(size, "cpu")
