"""Reward managers: turn a batch of final answers into trajectory scores with a verifier.

``naive``  scores in the driver process, one row at a time.
``thread`` scores in per-node Ray actors that own a process pool, so CPU-heavy verifiers never
           block the driver that drives generation (MemAgent's "Ray actor process pool").

Both take a trajectory-ordered batch (``final_batch(...)`` unioned with the trajectory rows: it has
``responses``/``response_mask`` and ``data_source``/``reward_model``/``extra_info`` per row) and
return ``(scores [T] float tensor, extra_info dict of lists)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from verl.workers.reward_manager.naive import SCORER_ARGS, NaiveRewardManager
from verl.workers.reward_manager.thread import ThreadRewardManager

REWARD_MANAGERS: dict[str, type] = {"naive": NaiveRewardManager, "thread": ThreadRewardManager}


def get_reward_manager_cls(name: str) -> type:
    if name not in REWARD_MANAGERS:
        raise ValueError(f"unknown reward_model.reward_manager {name!r}; valid: {', '.join(sorted(REWARD_MANAGERS))}")
    return REWARD_MANAGERS[name]


def load_reward_manager(name: str, tokenizer, compute_score: Callable | None = None, **kwargs: Any):
    return get_reward_manager_cls(name)(tokenizer, compute_score=compute_score, **kwargs)


def reserved_reward_kwargs() -> dict[str, str]:
    """Names ``reward_model.reward_kwargs`` cannot use, with whose they are: every named constructor argument of
    the reward managers (``reward_kwargs`` are passed through the constructor) and the scorer's per-row arguments."""
    reserved = {name: "the scorer's per-row arguments" for name in SCORER_ARGS}
    for manager, cls in REWARD_MANAGERS.items():
        for param in list(inspect.signature(cls.__init__).parameters.values())[1:]:
            if param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                reserved.setdefault(param.name, f"an argument of the {manager} reward manager")
    return reserved
