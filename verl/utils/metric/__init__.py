"""Metric reduction helpers (upstream ``verl.utils.metric``)."""

from verl.utils.metric.utils import reduce_metrics, weighted_mean

__all__ = ["reduce_metrics", "weighted_mean"]
