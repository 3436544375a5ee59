"""Build the actor/rollout/ref worker group on Ray: ``trainer.nnodes x trainer.n_gpus_per_node`` ranks.

On CPU (``trainer.device=cpu``) ``n_gpus_per_node`` means processes per node, so the same launch
command runs on a CPU box (gloo) and on GPU nodes (NCCL, FSDP2).
"""

from __future__ import annotations

from omegaconf import DictConfig

from verl.single_controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool
from verl.workers.fsdp_workers import ActorRolloutRefWorker


def build_ray_worker_group(cfg: DictConfig, device: str) -> RayWorkerGroup:
    pool = ResourcePool.from_trainer(
        int(cfg.trainer.nnodes),
        int(cfg.trainer.n_gpus_per_node),
        use_gpu=device == "cuda",
        name_prefix="actor_rollout_ref",
    )
    worker = RayClassWithInitArgs(ActorRolloutRefWorker, cfg.actor_rollout_ref, device=device)
    return RayWorkerGroup(pool, worker, name_prefix="actor_rollout_ref", device=device)
