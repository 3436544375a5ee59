"""What the actor/rollout/ref worker and the critic worker share: config handling and device setup."""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from verl.single_controller import Worker
from verl.workers.config.base import BaseConfig


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

    # the typed section ``config`` holds (``self.conf``)
    CONFIG_CLS: ClassVar[Optional[type[BaseConfig]]] = None

    def __init__(self, config: Any, device: str = "cpu"):
        super().__init__()
        self.config = OmegaConf.create(config_to_dict(config))
        self.device_name = device

    @property
    def conf(self) -> Any:
        """``config`` as the typed ``CONFIG_CLS`` (built and validated once per config object)."""
        cached = self.__dict__.get("_conf")
        if cached is None or cached[0] is not self.config:
            cached = (self.config, self.CONFIG_CLS.from_config(self.config))
            self.__dict__["_conf"] = cached
        return cached[1]

    def _init_distributed(self) -> None:
        if self.device_name == "cuda":
            torch.cuda.set_device(torch.device(self.device))  # Ray shows each worker only its own GPU
        # FSDP2 (used for every rank on a GPU, see ``sharded``) needs a process group, also for one rank.
        if (self.world_size > 1 or self.device_name == "cuda") and not dist.is_initialized():
            self.init_process_group()
