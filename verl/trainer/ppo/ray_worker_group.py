"""Build the actor/rollout/ref worker group on Ray: ``trainer.nnodes x trainer.n_gpus_per_node`` ranks.

On CPU (``trainer.device=cpu``) ``n_gpus_per_node`` means processes per node, so the same launch
command runs on a CPU box (gloo) and on GPU nodes (NCCL, FSDP2).

With ``trainer.rollout_overlap`` every worker process gets two Ray concurrency groups, ``rollout`` and ``train``
(one thread each, ``OVERLAP_CONCURRENCY_GROUPS``): the next step's generation runs in one while this step's
log-probs and update run in the other. Without it a worker runs one call at a time.
"""

from __future__ import annotations

from omegaconf import DictConfig

from verl.single_controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool
from verl.trainer.config import TrainerConfig
from verl.workers.fsdp_workers import OVERLAP_CONCURRENCY_GROUPS, ActorRolloutRefWorker


def actor_rollout_ref_class(cfg: DictConfig, device: str) -> RayClassWithInitArgs:
    """The actor/rollout/ref worker of ``cfg``, with the rollout and train threads when ``trainer.rollout_overlap``."""
    worker = RayClassWithInitArgs(ActorRolloutRefWorker, cfg.actor_rollout_ref, device=device)
    if TrainerConfig.from_config(cfg.trainer).rollout_overlap:
        worker.update_options({"concurrency_groups": dict(OVERLAP_CONCURRENCY_GROUPS)})
    return worker


def build_ray_worker_group(cfg: DictConfig, device: str) -> RayWorkerGroup:
    pool = ResourcePool.from_trainer(
        int(cfg.trainer.nnodes),
        int(cfg.trainer.n_gpus_per_node),
        use_gpu=device == "cuda",
        name_prefix="actor_rollout_ref",
    )
    return RayWorkerGroup(pool, actor_rollout_ref_class(cfg, device), name_prefix="actor_rollout_ref", device=device)
