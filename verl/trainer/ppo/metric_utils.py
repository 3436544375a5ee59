"""Metrics of one training step and of validation, computed on the driver from a ``DataProto``.

Key names follow upstream verl (``critic/score/mean``, ``response_length/clip_ratio``, ``timing_s/gen``,
``perf/throughput``, ``val-core/<data_source>/reward/mean@<n>``) plus MemAgent's and ours:

* ``critic/pass@n`` (MemAgent): fraction of **conversations** whose score is exactly 1.0. Every conversation
  carries its trajectory's score, so this (like ``critic/score/*``) is turn-weighted: a trajectory with more
  memory turns counts more (docs/spec.md#validation-metrics).
* ``trajectory/*`` (ours): the same quantities counted once per trajectory (from its final-answer
  conversation), plus conversations per trajectory.
* ``response_length/memory_turn/*`` vs ``response_length/final_turn/*``: response lengths split by turn type.

Rows flagged as padding (``is_padding`` True or ``no_padding_mask`` False) are dropped before any statistic.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from verl.protocol import PADDING_FLAG_KEY, DataProto
from verl.utils.metric import reduce_metrics

__all__ = [
    "bootstrap_metric",
    "calc_maj_val",
    "compute_data_metrics",
    "compute_timing_metrics",
    "compute_throughout_metrics",
    "process_validation_metrics",
    "reduce_metrics",
]


def bootstrap_metric(
    data: Sequence[Any], subset_size: int, reduce_fns: Sequence[Any], n_bootstrap: int = 1000, seed: int = 42
) -> list[tuple[float, float]]:
    """``(mean, std)`` of each ``reduce_fn`` over ``n_bootstrap`` resamples (with replacement) of ``subset_size``
    items of ``data``, drawn as upstream draws them (``np.random.seed(seed)`` then ``np.random.choice``), but
    from a private ``RandomState`` so the global numpy state is untouched."""
    rng = np.random.RandomState(seed)
    results: list[list[float]] = [[] for _ in reduce_fns]
    for _ in range(n_bootstrap):
        picks = rng.choice(len(data), size=subset_size, replace=True)
        sample = [data[i] for i in picks]
        for j, fn in enumerate(reduce_fns):
            results[j].append(float(fn(sample)))
    return [(float(np.mean(r)), float(np.std(r))) for r in results]


def calc_maj_val(data: Sequence[Mapping[str, Any]], vote_key: str, val_key: str) -> Any:
    """``val_key`` of the first item whose ``vote_key`` is the most common vote (ties: first vote seen)."""
    votes: dict[Any, list[Any]] = {}
    for item in data:
        votes.setdefault(item[vote_key], []).append(item[val_key])
    winner = max(votes, key=lambda vote: len(votes[vote]))
    return votes[winner][0]


def _tensor_keys(batch: DataProto) -> set[str]:
    return set(batch.batch.keys()) if batch.batch is not None else set()


def _real_rows(batch: DataProto) -> torch.Tensor:
    """Bool ``[N]``: True for real rows, False for padding rows."""
    keys = _tensor_keys(batch)
    keep = torch.ones(len(batch), dtype=torch.bool)
    if PADDING_FLAG_KEY in keys:
        keep &= ~batch.batch[PADDING_FLAG_KEY].bool().reshape(-1).cpu()
    if "no_padding_mask" in keys:
        keep &= batch.batch["no_padding_mask"].bool().reshape(-1).cpu()
    return keep


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """``{prefix}/mean, /max, /min`` of a 1-D tensor (0.0 for an empty one)."""
    values = values.detach().float().reshape(-1)
    if values.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def _lengths(batch: DataProto) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """``(prompt_length [N], response_length [N], response_mask [N, R], prompt_width, response_width)``.

    Lengths count attention-mask tokens of each segment; ``response_mask`` is the batch's own (async mode:
    assistant tokens only) or the response part of the attention mask.
    """
    responses = batch.batch["responses"]
    attention_mask = batch.batch["attention_mask"].cpu()
    response_width = responses.shape[-1]
    prompt_width = attention_mask.shape[-1] - response_width
    response_attention = attention_mask[:, -response_width:].float()
    if "response_mask" in _tensor_keys(batch):
        response_mask = batch.batch["response_mask"].cpu()
    else:
        response_mask = response_attention
    prompt_length = attention_mask[:, :prompt_width].float().sum(-1)
    return prompt_length, response_attention.sum(-1), response_mask.bool(), prompt_width, response_width


def _as_numpy(values: Any, name: str, expected_len: int) -> np.ndarray:
    array = values.cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    array = array.reshape(-1)
    if array.shape[0] != expected_len:
        raise ValueError(f"{name} has {array.shape[0]} entries but the batch has {expected_len} rows")
    return array


def compute_data_metrics(
    batch: DataProto,
    use_critic: bool = False,
    sample_index: Any = None,
    final_mask: Any = None,
) -> dict[str, float]:
    """Score, reward, advantage, return, length and pass-rate statistics of a (conversation-level) batch.

    Args:
        batch: needs tensors ``token_level_scores``, ``token_level_rewards``, ``advantages``, ``returns``,
            ``responses``, ``attention_mask`` (``values`` when ``use_critic``); ``response_mask`` optional.
        use_critic: also report ``critic/values/*`` and ``critic/vf_explained_var``.
        sample_index: ``[N]`` trajectory id of each row (conversation); None = every row is its own trajectory.
        final_mask: ``[N]`` True on each trajectory's final-answer row; None = ``batch["final_mask"]`` if present,
            else every row is final (single-turn).
    """
    num_rows = len(batch)
    keys = _tensor_keys(batch)
    if final_mask is None:
        final_mask = batch.batch["final_mask"] if "final_mask" in keys else np.ones(num_rows, dtype=bool)
    final = _as_numpy(final_mask, "final_mask", num_rows).astype(bool)
    traj = np.arange(num_rows) if sample_index is None else _as_numpy(sample_index, "sample_index", num_rows)

    keep = _real_rows(batch)
    keep_np = keep.numpy()
    final, traj = final[keep_np], traj[keep_np]

    def column(key: str) -> torch.Tensor:
        return batch.batch[key].detach().cpu()[keep]

    sequence_score = column("token_level_scores").float().sum(-1)
    sequence_reward = column("token_level_rewards").float().sum(-1)
    prompt_length, response_length, response_mask, prompt_width, response_width = _lengths(batch)
    prompt_length, response_length, response_mask = prompt_length[keep], response_length[keep], response_mask[keep]
    advantages = torch.masked_select(column("advantages").float(), response_mask)
    returns = torch.masked_select(column("returns").float(), response_mask)

    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", sequence_score))
    metrics.update(_stats("critic/rewards", sequence_reward))
    metrics.update(_stats("critic/advantages", advantages))
    metrics.update(_stats("critic/returns", returns))
    metrics["critic/pass@n"] = (sequence_score == 1.0).float().mean().item() if len(sequence_score) else 0.0
    if use_critic:
        values = torch.masked_select(column("values").float(), response_mask)
        metrics.update(_stats("critic/values", values))
        return_var = torch.var(returns) if returns.numel() > 1 else torch.tensor(0.0)
        residual_var = torch.var(returns - values) if returns.numel() > 1 else torch.tensor(0.0)
        metrics["critic/vf_explained_var"] = (1.0 - residual_var / (return_var + 1e-5)).item()

    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = _fraction(response_length == response_width)
    metrics.update(_stats("prompt_length", prompt_length))
    metrics["prompt_length/clip_ratio"] = _fraction(prompt_length == prompt_width)

    final_t = torch.from_numpy(final)
    for turn, rows in (("memory_turn", ~final_t), ("final_turn", final_t)):
        if rows.any():
            metrics[f"response_length/{turn}/mean"] = response_length[rows].mean().item()
            metrics[f"response_length/{turn}/max"] = response_length[rows].max().item()
            metrics[f"response_length/{turn}/clip_ratio"] = _fraction(response_length[rows] == response_width)

    metrics.update(_trajectory_metrics(sequence_score[final_t], sequence_reward[final_t], traj))
    return metrics


def _fraction(flags: torch.Tensor) -> float:
    return flags.float().mean().item() if flags.numel() else 0.0


def _trajectory_metrics(final_scores: torch.Tensor, final_rewards: torch.Tensor, traj: np.ndarray) -> dict[str, float]:
    """Statistics counted once per trajectory: its final conversation's score/reward, its number of turns."""
    metrics: dict[str, float] = {"trajectory/count": float(final_scores.numel())}
    metrics.update(_stats("trajectory/score", final_scores))
    metrics.update(_stats("trajectory/reward", final_rewards))
    metrics["trajectory/pass_rate"] = _fraction(final_scores == 1.0)
    if traj.size:
        _, counts = np.unique(traj, return_counts=True)
        metrics.update(_stats("trajectory/num_conv", torch.from_numpy(counts)))
    return metrics


# Timed sections whose per-token cost is measured against generated (response) tokens; every other
# section listed here is measured against all (prompt + response) tokens.
_RESPONSE_TOKEN_SECTIONS = ("gen", "mt_gen")
_ALL_TOKEN_SECTIONS = ("ref", "old_log_prob", "values", "adv", "update_critic", "update_actor")


def compute_timing_metrics(batch: DataProto, timing_raw: Mapping[str, float]) -> dict[str, float]:
    """``timing_s/<name>`` for every timed section and ``timing_per_token_ms/<name>`` for the known ones."""
    keep = _real_rows(batch)
    prompt_length, response_length, *_ = _lengths(batch)
    num_response_tokens = response_length[keep].sum().item()
    num_all_tokens = num_response_tokens + prompt_length[keep].sum().item()
    metrics = {f"timing_s/{name}": float(seconds) for name, seconds in timing_raw.items()}
    for name, seconds in timing_raw.items():
        tokens = (
            num_response_tokens
            if name in _RESPONSE_TOKEN_SECTIONS
            else (num_all_tokens if name in _ALL_TOKEN_SECTIONS else None)
        )
        if tokens:
            metrics[f"timing_per_token_ms/{name}"] = float(seconds) * 1000.0 / tokens
    return metrics


def compute_throughout_metrics(batch: DataProto, timing_raw: Mapping[str, float], n_gpus: int) -> dict[str, float]:
    """``perf/total_num_tokens``, ``perf/time_per_step`` and ``perf/throughput`` (tokens / s / GPU).

    Tokens = ``sum(meta_info["global_token_num"])`` when the trainer recorded it, else the attention-mask
    tokens of the real rows. The step time is ``timing_raw["step"]``.
    """
    if "step" not in timing_raw:
        raise KeyError(f"timing_raw needs a 'step' entry for throughput metrics; has {sorted(timing_raw)}")
    if n_gpus < 1:
        raise ValueError(f"n_gpus must be >= 1, got {n_gpus}")
    if "global_token_num" in batch.meta_info:
        total_tokens = float(sum(batch.meta_info["global_token_num"]))
    else:
        total_tokens = batch.batch["attention_mask"].cpu()[_real_rows(batch)].float().sum().item()
    step_time = float(timing_raw["step"])
    return {
        "perf/total_num_tokens": total_tokens,
        "perf/time_per_step": step_time,
        "perf/throughput": total_tokens / (step_time * n_gpus) if step_time > 0 else 0.0,
    }


def process_validation_metrics(
    data_sources: Sequence[str],
    sample_uids: Sequence[Any],
    infos_dict: Mapping[str, Sequence[Any]],
    seed: int = 42,
) -> dict[str, float]:
    """Validation metrics per data source, grouping the ``n`` repeats of each sample by its uid.

    For every numeric variable in ``infos_dict`` (e.g. ``reward``, ``acc``) and every group of ``n`` repeats:
    ``mean@n``; with ``n > 1`` also ``std@n``, ``best@n`` (max of the group) and ``worst@n`` (min). Each is
    averaged over the groups of a data source. Keys: ``val-core/<ds>/<var>/<metric>`` for the core variable
    (``acc`` if present, else ``reward``) and its ``mean``/``best`` at the largest ``n``; ``val-aux/...``
    for everything else. E.g. ``val-core/hotpotqa/reward/mean@4``. ``seed`` is upstream's bootstrap seed,
    accepted for its signature: best/worst here are exact group max/min, not bootstrap estimates.
    """
    del seed
    num = len(data_sources)
    if len(sample_uids) != num:
        raise ValueError(f"sample_uids has {len(sample_uids)} entries but data_sources has {num}")
    for var, values in infos_dict.items():
        if len(values) != num:
            raise ValueError(f"infos_dict[{var!r}] has {len(values)} entries but data_sources has {num}")
    core_var = "acc" if "acc" in infos_dict else "reward"

    grouped: dict[str, dict[Any, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i, (source, uid) in enumerate(zip(data_sources, sample_uids)):
        for var, values in infos_dict.items():
            value = values[i]
            value = value.item() if hasattr(value, "item") else value
            if isinstance(value, (bool, int, float)):  # non-numeric infos (e.g. predictions) are skipped
                grouped[source][uid][var].append(float(value))

    result: dict[str, float] = {}
    for source, groups in grouped.items():
        per_metric: dict[tuple[str, str], list[float]] = defaultdict(list)
        for var_values in groups.values():
            for var, values in var_values.items():
                n = len(values)
                per_metric[(var, f"mean@{n}")].append(float(np.mean(values)))
                if n > 1:
                    per_metric[(var, f"std@{n}")].append(float(np.std(values)))
                    per_metric[(var, f"best@{n}")].append(max(values))
                    per_metric[(var, f"worst@{n}")].append(min(values))
        n_max = {var: max(int(name.split("@")[1]) for v, name in per_metric if v == var) for var, _ in per_metric}
        for (var, name), values in per_metric.items():
            kind, n = name.split("@")
            is_core = var == core_var and kind in ("mean", "best") and int(n) == n_max[var]
            result[f"{'val-core' if is_core else 'val-aux'}/{source}/{var}/{name}"] = float(np.mean(values))
    return result
