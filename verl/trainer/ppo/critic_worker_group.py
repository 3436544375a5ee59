"""Worker groups for the critic (value model), beside the actor/rollout/ref group.

* one in-process CPU rank (``trainer.nnodes x trainer.n_gpus_per_node == 1`` on CPU, no
  ``trainer.force_ray_workers``): :class:`LocalCriticGroup` next to the actor's ``LocalWorkerGroup``;
* otherwise both groups go on Ray, on ONE resource pool with ``max_colocate_count=2``: every bundle
  (GPU) hosts one actor process and one critic process (each takes half a GPU in Ray's accounting and
  sees the same device). The critic is a separate worker group with its own ``torch.distributed``
  process group, so the actor code is untouched.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from verl.workers.critic.critic_worker import CriticWorker

__all__ = ["LocalCriticGroup", "build_ray_actor_and_critic_groups", "build_actor_and_critic_groups"]


class LocalCriticGroup:
    """A critic group of one in-process rank, with the Ray group's method names and return layouts."""

    world_size = 1

    def __init__(self, config: Any, device: str = "cpu"):
        self.worker = CriticWorker(config, device=device)

    def init_model(self) -> None:
        self.worker.init_model()

    def compute_values(self, data):
        return self.worker.compute_values(data)

    def update_critic(self, data):
        return self.worker.update_critic(data)

    def save_checkpoint(self, path: str) -> None:
        self.worker.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.worker.load_checkpoint(path)

    def shutdown(self) -> None:
        pass


def build_ray_actor_and_critic_groups(cfg: DictConfig, device: str):
    """``(actor_wg, critic_wg)`` on Ray, sharing one pool of ``trainer.nnodes x trainer.n_gpus_per_node`` bundles."""
    from verl.single_controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool
    from verl.trainer.ppo.ray_worker_group import actor_rollout_ref_class

    pool = ResourcePool.from_trainer(
        int(cfg.trainer.nnodes),
        int(cfg.trainer.n_gpus_per_node),
        use_gpu=device == "cuda",
        max_colocate_count=2,
        name_prefix="actor_critic",
    )
    actor = RayWorkerGroup(
        pool,
        actor_rollout_ref_class(cfg, device),  # with the rollout/train threads under trainer.rollout_overlap
        name_prefix="actor_rollout_ref",
        device=device,
    )
    critic = RayWorkerGroup(
        pool, RayClassWithInitArgs(CriticWorker, cfg.critic, device=device), name_prefix="critic", device=device
    )
    return actor, critic


def build_actor_and_critic_groups(cfg: DictConfig, device: str):
    """``(actor_wg, critic_wg)``: in-process for a single CPU rank (as ``main_ppo.build_worker_group``), else Ray."""
    from verl.trainer.config import TrainerConfig

    if TrainerConfig.from_config(cfg.trainer).runs_in_process(device):
        from verl.trainer.ppo.local_worker_group import LocalWorkerGroup

        return LocalWorkerGroup(cfg.actor_rollout_ref, device), LocalCriticGroup(cfg.critic, device)
    return build_ray_actor_and_critic_groups(cfg, device)
