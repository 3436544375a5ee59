"""The dataset and dataloader section ``data``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from verl.workers.config.base import BaseConfig, Checks

__all__ = ["CustomClsConfig", "DataConfig", "file_list"]


@dataclass
class CustomClsConfig(BaseConfig):
    """``data.custom_cls``: a custom dataset class (upstream); null = RLHFDataset or the workflow's dataset."""

    SECTION = "data.custom_cls"

    # Python file defining the dataset class.
    path: Optional[str] = None
    # Class name inside that file.
    name: Optional[str] = None


@dataclass
class DataConfig(BaseConfig):
    """``data``."""

    SECTION = "data"

    # Tokenizer path; null = use actor_rollout_ref.model.path.
    tokenizer: Optional[str] = None
    # Training file(s): parquet/json/jsonl path or list of paths.
    train_files: Any = "~/data/rlhf/gsm8k/train.parquet"
    # Validation file(s): parquet/json/jsonl path or list of paths.
    val_files: Any = "~/data/rlhf/gsm8k/test.parquet"
    # Column holding the chat messages of the prompt.
    prompt_key: str = "prompt"
    # Column whose value selects the reward function.
    reward_fn_key: str = "data_source"
    # Max prompt tokens.
    max_prompt_length: int = 512
    # Max response tokens.
    max_response_length: int = 512
    # Prompts (questions) per training step, before the rollout.n repeat.
    train_batch_size: int = 1024
    # Prompts per validation batch; null = the whole validation set in one batch.
    val_batch_size: Optional[int] = None
    # Prompts drawn per generation batch (DAPO-style filtering); null = data.train_batch_size.
    gen_batch_size: Optional[int] = None
    # Also return the raw (un-templated) prompt ids.
    return_raw_input_ids: bool = False
    # Also return the raw chat messages.
    return_raw_chat: bool = False
    # Also return the full templated prompt text.
    return_full_prompt: bool = False
    # Shuffle the training set each epoch.
    shuffle: bool = True
    # Seed of the training-set shuffle.
    seed: int = 1
    # Drop rows whose prompt is too long when the dataset loads.
    filter_overlong_prompts: bool = False
    # Processes used by filter_overlong_prompts.
    filter_overlong_prompts_workers: int = 1
    # What to do with too-long prompts: error | left | right | center | middle.
    truncation: str = "error"
    # Worker processes loading training rows; 0 = in the trainer's process.
    dataloader_num_workers: int = 8
    # Column with images (multimodal datasets only).
    image_key: str = "images"
    # Column with videos (multimodal datasets only).
    video_key: str = "videos"
    # Custom dataset class.
    custom_cls: CustomClsConfig = field(default_factory=CustomClsConfig)

    def check(self, c: Checks) -> None:
        from verl.utils.dataset.rl_dataset import TRUNCATIONS

        c.integer("max_prompt_length", 1)
        c.integer("max_response_length", 1)
        c.integer("train_batch_size", 1)
        c.integer("val_batch_size", 1, allow_none=True)
        c.integer("gen_batch_size", 1, allow_none=True)
        c.integer("dataloader_num_workers", 0)
        c.integer("filter_overlong_prompts_workers", 1)
        c.choice("truncation", TRUNCATIONS)
        for name in ("train_files", "val_files"):
            if getattr(self, name) in (None, "", []):
                c.error(f"{c.key(name)} must name at least one file (got {getattr(self, name)!r})")
        train_bs, gen_bs = self.train_batch_size, self.gen_batch_size
        if not c.bad & {"train_batch_size", "gen_batch_size"} and gen_bs is not None and gen_bs < train_bs:
            c.error(
                f"{c.key('gen_batch_size')} must be >= {c.key('train_batch_size')} or null (got {gen_bs} and {train_bs})"
            )

    @property
    def train_file_list(self) -> list[str]:
        return file_list(self.train_files)

    @property
    def val_file_list(self) -> list[str]:
        return file_list(self.val_files)


def file_list(spec: Any) -> list[str]:
    """The files a ``*_files`` key names: one path, a list of paths (a ``ListConfig`` too), or none (null or
    ``""``). Shared by the RL and SFT trainers and the launch checks."""
    if spec is None or spec == "":
        return []
    if isinstance(spec, str):
        return [spec]
    return [str(s) for s in spec]
