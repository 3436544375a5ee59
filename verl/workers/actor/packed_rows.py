"""Packed rows: the valid tokens of a ``[b, S]`` micro-batch laid out as one ``[1, T]`` sequence.

``PackedRows`` is what ``forward.pack_rows`` and ``shared_prompts.shared_prompt_layout`` build and the forward passes
read (``forward.py``'s module docstring has the layouts); ``padded_packed_length`` is the trailing padding that keeps
flex_attention's compiled shapes whole blocks. ``PackedRows.to`` copies a host plan to the device
(``verl.utils.torch_functional.host_to_device``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from verl.utils.torch_functional import host_to_device

__all__ = ["PackedRows", "padded_packed_length"]


@dataclass
class PackedRows:
    """Valid tokens of ``b`` rows laid out as one sequence.

    ``input_ids``/``position_ids``: ``[1, T]``; ``predictor_index``: ``[K]`` packed positions whose logits
    predict a response token; ``label_index``: ``[K]`` packed positions of those tokens (``predictor + 1``);
    ``target_mask``: ``[b, R]`` bool, True where a log-prob is produced (row-major order matches ``K``).
    ``num_padding``: tokens appended after the valid ones (``length_multiple``); never indexed by the above.
    ``target_index``: ``[K]`` flat (row-major) positions of the True entries of ``target_mask``, or None.
    ``cu_seq_lens``: ``[N + 1]`` int32 offsets of the ``N`` sequences (non-empty rows, then the padding one) and
    ``max_length`` the longest, a host int: the boundaries ``torch_varlen`` attention takes (``varlen_attention``).
    ``segment_ids``/``prefix_ids``: ``[T]``, set when rows share a prompt (``shared_prompts.py``; then
    ``cu_seq_lens`` is None and ``predictor_index`` is not ``label_index - 1`` everywhere); ``tokens_saved``:
    prompt tokens not repeated.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    predictor_index: torch.Tensor
    label_index: torch.Tensor
    target_mask: torch.Tensor
    num_padding: int = 0
    target_index: Optional[torch.Tensor] = None
    cu_seq_lens: Optional[torch.Tensor] = None
    max_length: int = 0
    segment_ids: Optional[torch.Tensor] = None
    prefix_ids: Optional[torch.Tensor] = None
    tokens_saved: int = 0

    def to(self, device: torch.device) -> PackedRows:
        """The same rows on ``device`` (see ``host_to_device``)."""
        moved = {
            name: host_to_device(getattr(self, name), device)
            for name in ("input_ids", "position_ids", "predictor_index", "label_index", "target_mask")
        }
        index, cu_seq_lens, segment_ids, prefix_ids = (
            None if tensor is None else host_to_device(tensor, device)
            for tensor in (self.target_index, self.cu_seq_lens, self.segment_ids, self.prefix_ids)
        )
        return PackedRows(
            **moved,
            num_padding=self.num_padding,
            target_index=index,
            cu_seq_lens=cu_seq_lens,
            max_length=self.max_length,
            segment_ids=segment_ids,
            prefix_ids=prefix_ids,
            tokens_saved=self.tokens_saved,
        )


def padded_packed_length(total: int, length_multiple: int) -> int:
    """``total`` rounded up to a multiple of ``length_multiple`` and, when that is > 1, to at least two multiples
    (one flex block is a separate compile: torch specialises sizes 0 and 1, here the number of blocks)."""
    if length_multiple <= 1:
        return total
    return max(-(-total // length_multiple), 2) * length_multiple
