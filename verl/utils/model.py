"""Upstream verl's ``verl.utils.model`` helper that datasets and recipes import."""

from verl.utils.torch_functional import compute_position_id_with_mask

__all__ = ["compute_position_id_with_mask"]
