"""Reduce per-micro-batch (or per-rank) metric lists to one value per key, as upstream verl does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np

__all__ = ["reduce_metrics", "weighted_mean"]


def weighted_mean(values: Sequence[float], weights: Optional[Sequence[float]] = None) -> float:
    """``sum(v * w) / sum(w)``; the plain mean without weights; NaN when the weights sum to 0.

    Example: ``weighted_mean([0.8, 0.6], [100, 200]) == (80 + 120) / 300``.
    """
    if not weights:
        return float(np.mean([float(v) for v in values]))
    if len(values) != len(weights):
        raise ValueError(f"weighted_mean: {len(values)} values but {len(weights)} weights")
    total = float(np.sum(weights))
    if total == 0:
        return float("nan")
    return float(np.dot(np.asarray(values, dtype=float), np.asarray(weights, dtype=float)) / total)


def reduce_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """One float per key: ``max`` when the key contains ``"max"``, ``min`` when it contains ``"min"``, else the
    mean (upstream's rule). A value with an ``aggregate()`` method (upstream's ``Metric``) reduces itself; a
    scalar passes through. Keys with an empty list are left out (upstream returns NaN for them).

    Example: ``{"loss": [1, 2, 3], "response_length/max": [5, 8]} -> {"loss": 2.0, "response_length/max": 8.0}``.
    """
    result: dict[str, float] = {}
    for key, values in metrics.items():
        if hasattr(values, "aggregate"):
            result[key] = float(values.aggregate())
            continue
        if np.isscalar(values):
            result[key] = float(values)
            continue
        numbers = [float(v) for v in values]
        if not numbers:
            continue
        if "max" in key:
            result[key] = float(np.max(numbers))
        elif "min" in key:
            result[key] = float(np.min(numbers))
        else:
            result[key] = float(np.mean(numbers))
    return result
