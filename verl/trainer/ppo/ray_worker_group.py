"""Build the actor/rollout/ref worker group on Ray: ``trainer.nnodes x trainer.n_gpus_per_node`` ranks.

On CPU (``trainer.device=cpu``) ``n_gpus_per_node`` means processes per node, so the same launch
command runs on a CPU box (gloo) and on GPU nodes (NCCL, FSDP2).

With ``trainer.rollout_overlap`` every worker process gets two Ray concurrency groups, ``rollout`` and ``train``
(one thread each, ``OVERLAP_CONCURRENCY_GROUPS``): the next step's generation runs in one while this step's
log-probs and update run in the other. With ``actor_rollout_ref.rollout.mode=async`` and
``rollout.async_free_running_calls = k > 0`` the ``rollout`` group has ``k`` threads, so that ``k`` single-request
``generate`` calls run at once (free-running async turns); with ``rollout.free_running_turns`` (sync mode) it has one
thread per trajectory of the rank. Otherwise a worker runs one call at a time.
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from verl.single_controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool
from verl.trainer.config import DataConfig, TrainerConfig
from verl.workers.config import RolloutConfig
from verl.workers.fsdp_workers import OVERLAP_CONCURRENCY_GROUPS, ROLLOUT_GROUP, ActorRolloutRefWorker

logger = logging.getLogger(__name__)


def trajectories_per_rank(cfg: DictConfig) -> int:
    """The trajectories each rank serves in a training rollout: ``ceil(data.train_batch_size x rollout.n / ranks)``
    (the ``generate`` threads a worker gets with ``rollout.free_running_turns``)."""
    rollouts = (
        DataConfig.from_config(cfg.data).train_batch_size * RolloutConfig.from_config(cfg.actor_rollout_ref.rollout).n
    )
    return max(1, -(-rollouts // TrainerConfig.from_config(cfg.trainer).world_size))


def actor_rollout_ref_class(cfg: DictConfig, device: str) -> RayClassWithInitArgs:
    """The actor/rollout/ref worker of ``cfg``, with the rollout and train threads when ``trainer.rollout_overlap``;
    the rollout group has ``rollout.async_free_running_calls`` threads in async mode (when set), or one per
    trajectory of the rank (:func:`trajectories_per_rank`) with ``rollout.free_running_turns`` in sync mode."""
    worker = RayClassWithInitArgs(ActorRolloutRefWorker, cfg.actor_rollout_ref, device=device)
    rc = RolloutConfig.from_config(cfg.actor_rollout_ref.rollout)
    if rc.mode == "async":
        calls = rc.async_free_running_calls
    else:
        calls = trajectories_per_rank(cfg) if rc.free_running_turns else 0
    trainer = TrainerConfig.from_config(cfg.trainer)
    if trainer.rollout_overlap or calls > 0:
        worker.update_options({"concurrency_groups": {**OVERLAP_CONCURRENCY_GROUPS, ROLLOUT_GROUP: max(1, calls)}})
    if calls > 0 and rc.mode == "async":
        per_rank = trajectories_per_rank(cfg)
        if calls < per_rank:
            logger.warning(
                "actor_rollout_ref.rollout.async_free_running_calls=%d is below the %d trajectories each rank serves "
                "(data.train_batch_size x rollout.n / ranks): a rank's engine sees at most %d requests at a time; set "
                "it to %d or more",
                calls,
                per_rank,
                calls,
                per_rank,
            )
    return worker


def build_ray_worker_group(cfg: DictConfig, device: str) -> RayWorkerGroup:
    pool = ResourcePool.from_trainer(
        int(cfg.trainer.nnodes),
        int(cfg.trainer.n_gpus_per_node),
        use_gpu=device == "cuda",
        name_prefix="actor_rollout_ref",
    )
    return RayWorkerGroup(pool, actor_rollout_ref_class(cfg, device), name_prefix="actor_rollout_ref", device=device)
