"""In-process reward manager: decode each final answer and call the verifier."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from verl.protocol import DataProto
from verl.utils.conversation_batch import decode_rows
from verl.utils.reward_score import default_compute_score

logger = logging.getLogger(__name__)

# The keyword arguments :func:`reward_requests` gives every scorer call (reward_model.reward_kwargs must not repeat them).
SCORER_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def reward_requests(data: DataProto, tokenizer, reward_fn_key: str = "data_source") -> list[dict[str, Any]]:
    """One verifier call's keyword arguments per row: data_source (the row's ``reward_fn_key`` column, i.e.
    ``data.reward_fn_key``: it selects the scorer), solution_str, ground_truth, extra_info."""
    texts = decode_rows(tokenizer, data.batch["responses"], data.batch["response_mask"])
    nt = data.non_tensor_batch
    if reward_fn_key != "data_source" and len(texts) and reward_fn_key not in nt:
        raise KeyError(f"data.reward_fn_key={reward_fn_key!r}: the batch has no column {reward_fn_key!r}")
    out = []
    for i, text in enumerate(texts):
        rm = nt["reward_model"][i] if "reward_model" in nt else {}
        if "ground_truth" not in (rm or {}):
            raise KeyError(
                f"row {i}: reward_model.ground_truth is missing ({reward_fn_key}={nt.get(reward_fn_key, ['?'])[i]!r})"
            )
        out.append(
            {
                "data_source": nt[reward_fn_key][i] if reward_fn_key in nt else "hotpotqa",
                "solution_str": text,
                "ground_truth": rm["ground_truth"],
                "extra_info": nt["extra_info"][i] if "extra_info" in nt else None,
            }
        )
    return out


def split_score(result: Any) -> tuple[float, dict[str, Any]]:
    """A verifier returns a float or a dict with ``score`` (other keys become extra info)."""
    if isinstance(result, dict):
        extra = {k: v for k, v in result.items() if k != "score"}
        return float(result["score"]), extra
    return float(result), {}


class NaiveRewardManager:
    """``reward_fn_key``: the column passed as the scorer's ``data_source`` (``data.reward_fn_key``);
    ``reward_kwargs``: extra keyword arguments of every scorer call (``reward_model.reward_kwargs``)."""

    def __init__(
        self,
        tokenizer,
        compute_score: Callable | None = None,
        num_examine: int = 0,
        reward_fn_key: str = "data_source",
        **reward_kwargs: Any,
    ):
        self.tokenizer = tokenizer
        self.compute_score = compute_score or default_compute_score
        self.num_examine = num_examine
        self.reward_fn_key = reward_fn_key
        self.reward_kwargs = reward_kwargs

    def __call__(self, data: DataProto) -> tuple[torch.Tensor, dict[str, list]]:
        requests = reward_requests(data, self.tokenizer, self.reward_fn_key)
        results = [self.compute_score(**req, **self.reward_kwargs) for req in requests]
        return collect(results, requests, self.num_examine)


def collect(results: list[Any], requests: list[dict], num_examine: int) -> tuple[torch.Tensor, dict[str, list]]:
    scores, extra = [], {}
    for i, r in enumerate(results):
        s, e = split_score(r)
        scores.append(s)
        for k, v in e.items():
            extra.setdefault(k, [None] * len(results))[i] = v
    for req, s in list(zip(requests, scores))[:num_examine]:
        logger.info("[reward] %s -> %.3f | answer: %s", req["data_source"], s, req["solution_str"][-300:])
    return torch.tensor(scores, dtype=torch.float32), extra
