"""Reward managers: turn a batch of final answers into trajectory scores with a verifier.

``naive``  scores in the driver process, one row at a time.
``thread`` scores in per-node Ray actors that own a process pool, so CPU-heavy verifiers never
           block the driver that drives generation (MemAgent's "Ray actor process pool").

Both take a trajectory-ordered batch (``final_batch(...)`` unioned with the trajectory rows: it has
``responses``/``response_mask`` and ``data_source``/``reward_model``/``extra_info`` per row) and
return ``(scores [T] float tensor, extra_info dict of lists)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl.workers.reward_manager.naive import NaiveRewardManager
from verl.workers.reward_manager.thread import ThreadRewardManager

REWARD_MANAGERS: dict[str, type] = {"naive": NaiveRewardManager, "thread": ThreadRewardManager}


def get_reward_manager_cls(name: str) -> type:
    if name not in REWARD_MANAGERS:
        raise ValueError(f"unknown reward_model.reward_manager {name!r}; valid: {', '.join(sorted(REWARD_MANAGERS))}")
    return REWARD_MANAGERS[name]


def load_reward_manager(name: str, tokenizer, compute_score: Callable | None = None, **kwargs: Any):
    return get_reward_manager_cls(name)(tokenizer, compute_score=compute_score, **kwargs)
