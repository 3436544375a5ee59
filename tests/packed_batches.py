"""Padded batches of given valid lengths, for the packed-rows tests (flex_attention shapes, the packed BlockMask)."""

from __future__ import annotations

import torch

RESPONSE_LENGTH = 16


def padded_batch(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts + right-padded responses whose valid tokens per row are ``lengths``: ``input_ids``,
    ``attention_mask`` and ``position_ids`` ``[len(lengths), max(lengths) + RESPONSE_LENGTH]``."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths) + RESPONSE_LENGTH
    input_ids = torch.randint(5, 1000, (len(lengths), width), generator=gen)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, length in enumerate(lengths):
        response = min(RESPONSE_LENGTH, 1 + (length + i) % RESPONSE_LENGTH, length - 1)
        attention_mask[i, width - RESPONSE_LENGTH - (length - response) : width - RESPONSE_LENGTH + response] = 1
    return input_ids, attention_mask, (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
