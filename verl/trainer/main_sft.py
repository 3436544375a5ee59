"""Entry point: ``python -m verl.trainer.main_sft [hydra overrides]`` (several GPUs: ``torchrun
--nproc_per_node=N -m verl.trainer.main_sft ...``). Config: ``config/sft_trainer.yaml``; the trainer:
:mod:`verl.trainer.fsdp_sft_trainer`.

    python -m verl.trainer.main_sft data.train_files=warmup.parquet model.partial_pretrain=/models/SmolLM2 \\
        data.train_batch_size=32 data.micro_batch_size_per_gpu=4 trainer.total_epochs=2 \\
        trainer.default_local_dir=runs/sft
"""

from __future__ import annotations

import os

import hydra
from omegaconf import DictConfig


def run(cfg: DictConfig) -> list[dict]:
    """Train per ``cfg``; return this process's logged metrics (one dict per step)."""
    import torch.distributed as dist

    from verl.trainer.fsdp_sft_trainer import FSDPSFTTrainer

    trainer = FSDPSFTTrainer(cfg)
    try:
        return trainer.fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@hydra.main(config_path="config", config_name="sft_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run(cfg)


if __name__ == "__main__":
    main()
