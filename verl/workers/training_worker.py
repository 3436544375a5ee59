"""What the actor/rollout/ref worker and the critic worker share: config handling and device setup."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from verl.single_controller import Worker


def config_to_dict(cfg: Any) -> dict:
    """A resolved plain dict of a DictConfig / mapping (None -> {})."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    return dict(cfg or {})


class TrainingWorker(Worker):
    """A rank holding trainable models; ``device`` is ``cpu`` or ``cuda``.

    Under Ray (``RayWorkerGroup``) rank and world size come from the environment the group sets;
    in-process (``LocalWorkerGroup``) the defaults are rank 0 of 1.
    """

    def __init__(self, config: Any, device: str = "cpu"):
        super().__init__()
        self.config = OmegaConf.create(config_to_dict(config))
        self.device_name = device

    def _init_distributed(self) -> None:
        if self.device_name == "cuda":
            torch.cuda.set_device(torch.device(self.device))  # Ray shows each worker only its own GPU
        # FSDP2 (used for every rank on a GPU, see ``sharded``) needs a process group, also for one rank.
        if (self.world_size > 1 or self.device_name == "cuda") and not dist.is_initialized():
            self.init_process_group()
