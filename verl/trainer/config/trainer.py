"""The training-loop section ``trainer`` and upstream's ``ray_init``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from verl.workers.config.base import BaseConfig, Checks

__all__ = ["TrainerConfig", "RayInitConfig", "VALID_LOGGERS", "DEVICES", "RESUME_MODES"]

# Logger backends implemented by verl.utils.tracking.Tracking.
VALID_LOGGERS = ("console", "wandb", "tensorboard", "jsonl")
DEVICES = ("cpu", "cuda")
RESUME_MODES = ("auto", "disable", "resume_path")


@dataclass
class TrainerConfig(BaseConfig):
    """``trainer``: loop, logging, checkpointing and cluster."""

    SECTION = "trainer"

    # Deal each mini-batch's rows to the ranks longest first (token balance per optimizer step; ppo/rank_spread.py).
    balance_batch: bool = True
    # Epochs over the training set.
    total_epochs: int = 30
    # Stop after this many steps; null = len(train_dataloader) x total_epochs.
    total_training_steps: Optional[int] = None
    # Project name for loggers.
    project_name: str = "verl_examples"
    # Run name for loggers.
    experiment_name: str = "gsm8k"
    # Logger backends: any of console, wandb, tensorboard, jsonl.
    logger: list[str] = field(default_factory=lambda: ["console", "wandb"])
    # Validation generations to log per validation (0 = none).
    log_val_generations: int = 0
    # Folder for tensorboard events and metrics.jsonl; null = follows default_local_dir/logs.
    log_dir: Optional[str] = None
    # Folder for each training step's generations as text, <step>.jsonl; null = none (ppo/generation_dump.py).
    rollout_data_dir: Optional[str] = None
    # Folder for each validation's generations, <step>.jsonl (0 = before training); null = none.
    validation_data_dir: Optional[str] = None
    # Nodes in the Ray cluster.
    nnodes: int = 1
    # GPUs (or CPU workers when device=cpu) per node.
    n_gpus_per_node: int = 8
    # Device: cuda | cpu | null (null = cuda if available else cpu).
    device: Optional[str] = None
    # Checkpoint every N steps and at the last step; -1 = never.
    save_freq: int = -1
    # Stop cleanly after the first step that ends past this many seconds; null = no limit.
    max_wall_time_s: Optional[float] = None
    # One-step-off: generate step k+1's rollout during step k's update on the pre-update weights (staleness 1).
    rollout_overlap: bool = False
    # Resume: auto | disable | resume_path.
    resume_mode: str = "auto"
    # Checkpoint folder to resume from when resume_mode=resume_path.
    resume_from_path: Optional[str] = None
    # Validate before the first training step.
    val_before_train: bool = True
    # Validate every N steps; -1 = never.
    test_freq: int = -1
    # Steps during which only the critic is trained.
    critic_warmup: int = 0
    # HDFS folder to copy checkpoints to; null = none.
    default_hdfs_dir: Optional[str] = None
    # Delete the local checkpoint after loading it.
    del_local_ckpt_after_load: bool = False
    # Local checkpoint folder; null = follows checkpoints/<project_name>/<experiment_name>.
    default_local_dir: Optional[str] = None
    # Actor checkpoints to keep; null = all.
    max_actor_ckpt_to_keep: Optional[int] = None
    # Critic checkpoints to keep; null = all.
    max_critic_ckpt_to_keep: Optional[int] = None
    # Seconds to wait for Ray workers to register.
    ray_wait_register_center_timeout: int = 300
    # Ray cluster, when Ray is needed (not for one in-process CPU rank with the naive reward manager):
    # null = start a local cluster; "auto" = join the running cluster; or an address.
    ray_address: Optional[str] = None
    # CPUs for a locally started Ray cluster; null = all.
    ray_num_cpus: Optional[int] = None
    # Show a progress bar over training steps.
    progress_bar: bool = True
    # Run even a single CPU rank in a Ray worker process (tests of the Ray path); False = in-process.
    force_ray_workers: bool = False
    # Start-up memory estimate per rank: error (refuse what cannot fit on a GPU) | warn | off (YAML's bare off = False).
    memory_check: Any = "error"

    def check(self, c: Checks) -> None:
        if "logger" not in c.bad:
            for name in self.logger:
                if name not in VALID_LOGGERS:
                    c.error(
                        f"{c.key('logger')} entries must be in [{', '.join(VALID_LOGGERS)}] (got {name!r} in {self.logger})"
                    )
        c.choice("device", DEVICES, allow_none=True)
        c.choice("resume_mode", RESUME_MODES)
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            c.error(f"{c.key('resume_from_path')} must be set when {c.key('resume_mode')}=resume_path")
        c.integer("nnodes", 1)
        c.integer("n_gpus_per_node", 1)
        c.integer("total_epochs", 1)
        c.integer("total_training_steps", 1, allow_none=True)
        c.integer("save_freq", 1, also=(-1,))
        c.integer("test_freq", 1, also=(-1,))
        c.number("max_wall_time_s", lambda v: v > 0, "> 0 seconds (or null for no limit)", allow_none=True)
        c.integer("critic_warmup", 0)
        c.integer("log_val_generations", 0)
        c.integer("max_actor_ckpt_to_keep", 1, allow_none=True)
        c.integer("max_critic_ckpt_to_keep", 1, allow_none=True)
        c.integer("ray_num_cpus", 1, allow_none=True)
        if self.memory_check is not False and self.memory_check not in ("error", "warn", "off"):
            c.error(f"{c.key('memory_check')} must be one of [error, warn, off] (got {self.memory_check!r})")
        if self.default_local_dir == "":
            c.error(f"{c.key('default_local_dir')} must be a folder path (got '')")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_gpus_per_node

    def runs_in_process(self, device: str) -> bool:
        """The actor (and critic) workers run in the trainer's process: one CPU rank, no ``force_ray_workers``."""
        return self.world_size == 1 and device == "cpu" and not self.force_ray_workers

    @property
    def local_dir(self) -> str:
        """``default_local_dir``, or the YAML's ``checkpoints/<project_name>/<experiment_name>`` when null."""
        return self.default_local_dir or f"checkpoints/{self.project_name}/{self.experiment_name}"

    @property
    def logs_dir(self) -> str:
        """``log_dir``, or ``<local_dir>/logs`` when null."""
        return self.log_dir or f"{self.local_dir}/logs"


@dataclass
class RayInitConfig(BaseConfig):
    """``ray_init`` (upstream, kept for old scripts)."""

    SECTION = "ray_init"

    # CPUs for ray.init; null = trainer.ray_num_cpus. When set it overrides trainer.ray_num_cpus.
    num_cpus: Optional[int] = None

    def check(self, c: Checks) -> None:
        c.integer("num_cpus", 1, allow_none=True)
