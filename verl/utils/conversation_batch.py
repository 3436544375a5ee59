"""Conversation batches: verl's per-conversation training tensors built from unpadded token lists.

Used by every trainer (single-turn rows are one-turn conversations) and by multi-turn workflows,
which emit one conversation per turn and concatenate the turns of a step with
:func:`concat_conversations`. :func:`final_batch` picks each trajectory's final-answer conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from verl.protocol import DataProto

__all__ = [
    "engine_log_probs",
    "TokenIds",
    "pad_token_lists",
    "build_conversation_batch",
    "unpad_rows",
    "decode_rows",
    "concat_conversations",
    "final_batch",
]

TokenIds = Sequence[int] | torch.Tensor


def pad_token_lists(
    seqs: Sequence[TokenIds], pad_id: int, width: int | None = None, left: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad variable-length token sequences into ``(ids [N, W], mask [N, W])``.

    ``W = max(width, longest)``: a wider row never fails, it widens the batch.
    """
    lengths = [len(s) for s in seqs]
    w = max([width or 0, *lengths, 0])
    ids = torch.full((len(seqs), w), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), w), dtype=torch.long)
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        if n == 0:
            continue
        t = s if isinstance(s, torch.Tensor) else torch.as_tensor(s, dtype=torch.long)
        if left:
            ids[i, w - n :], mask[i, w - n :] = t, 1
        else:
            ids[i, :n], mask[i, :n] = t, 1
    return ids, mask


def build_conversation_batch(
    prompts: Sequence[TokenIds],
    responses: Sequence[TokenIds],
    pad_id: int,
    prompt_width: int | None = None,
    response_width: int | None = None,
    response_masks: Sequence[Sequence[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Build verl's per-conversation training tensors from unpadded token lists.

    Prompts are left-padded and responses right-padded, so every row's prompt ends and response
    starts at the same column. ``response_mask`` is 1 on real response tokens (or the given
    per-token masks, e.g. 0 on tool-output tokens inside an agent's multi-turn response).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    p_ids, p_mask = pad_token_lists(prompts, pad_id, prompt_width, left=True)
    r_ids, r_mask = pad_token_lists(responses, pad_id, response_width, left=False)
    attention_mask = torch.cat([p_mask, r_mask], dim=1)
    position_ids = torch.clamp_min(torch.cumsum(attention_mask, dim=1) - 1, 0)
    if response_masks is not None:
        resp_mask, _ = pad_token_lists(response_masks, 0, r_ids.shape[1], left=False)
    else:
        resp_mask = r_mask
    return {
        "prompts": p_ids,
        "responses": r_ids,
        "input_ids": torch.cat([p_ids, r_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": resp_mask,
    }


def unpad_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Return each row's tokens where ``mask`` is set."""
    return [row[m.bool()] for row, m in zip(ids, mask)]


def decode_rows(tokenizer: Any, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Each row's tokens where ``mask`` is set, decoded without special tokens (one ``batch_decode`` call)."""
    return tokenizer.batch_decode([row.tolist() for row in unpad_rows(ids, mask)], skip_special_tokens=True)


def concat_conversations(batches: Sequence[DataProto], pad_id: int) -> DataProto:
    """Concatenate per-turn conversation batches whose widths differ.

    Every turn is re-padded to the widest prompt (left) and response (right) of all turns, so
    turns with long questions or long chunks concatenate without shape errors. Other
    response-aligned tensors (same width as ``responses``, e.g. ``rollout_log_probs``) are
    right-padded with zeros; non-tensor columns are concatenated as they are.
    """
    if not batches:
        raise ValueError("no conversation batches to concatenate")
    rw = max(b.batch["responses"].shape[1] for b in batches)
    prompts, responses, resp_masks, extras = [], [], [], {}
    for b in batches:
        td = b.batch
        r = td["responses"].shape[1]
        attn = td["attention_mask"]
        prompts += unpad_rows(td["prompts"], attn[:, :-r] if r else attn)
        resp_valid = attn[:, -r:] if r else torch.zeros_like(td["responses"])
        responses += unpad_rows(td["responses"], resp_valid)
        resp_masks += [m[v.bool()] for m, v in zip(td.get("response_mask", resp_valid), resp_valid)]
        for key, t in td.items():
            if key in _CONVERSATION_KEYS:
                continue
            if t.dim() >= 2 and t.shape[1] == r:
                t = torch.nn.functional.pad(t, (0, rw - r))
            extras.setdefault(key, []).append(t)
    tensors = build_conversation_batch(prompts, responses, pad_id, response_masks=resp_masks)
    for key, parts in extras.items():
        if len(parts) != len(batches):
            raise KeyError(f"tensor {key!r} is present in only {len(parts)} of {len(batches)} turns")
        tensors[key] = torch.cat(parts)
    non_tensors = {k: np.concatenate([b.non_tensor_batch[k] for b in batches]) for k in batches[0].non_tensor_batch}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=dict(batches[0].meta_info))


_CONVERSATION_KEYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")


def final_batch(batch: DataProto, final_mask: torch.Tensor, sample_index: torch.Tensor) -> DataProto:
    """Select the final-answer conversations and order them by trajectory (row i = trajectory i)."""
    idx = torch.nonzero(final_mask.bool(), as_tuple=False).squeeze(-1)
    traj = sample_index[idx]
    if len(set(traj.tolist())) != len(traj):
        raise ValueError("more than one final conversation for a trajectory")
    order = idx[torch.argsort(traj)]
    return batch[order.numpy()]


def engine_log_probs(outputs: Sequence, width: int) -> torch.Tensor | None:
    """``[N, width]`` log-probs the rollout engine reported for its sampled tokens (0 past each response);
    None when any output has none (``logprobs`` was not requested)."""
    if not outputs or any(getattr(o, "log_probs", None) is None for o in outputs):
        return None
    lp = torch.zeros((len(outputs), width), dtype=torch.float32)
    for i, o in enumerate(outputs):
        n = min(len(o.log_probs), width)
        lp[i, :n] = torch.tensor(o.log_probs[:n], dtype=torch.float32)
    return lp
