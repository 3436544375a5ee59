"""Rows that share a prompt, packed with that prompt once (``actor_rollout_ref.model.share_prompts``).

The ``n`` samples of a GRPO/DAPO group start from the same prompt. In MemAgent that is the whole first turn of
every conversation (problem, first chunk, no memory yet: ~5K of the ~6K tokens of a first-turn row); the later
turns differ in their memory and share only the problem. Packed rows (``use_remove_padding``) normally hold that
prompt ``n`` times and the training passes (old and reference log-probs, the update's forward and backward)
compute it ``n`` times. Here, inside one micro-batch, rows whose valid prompt tokens are identical are laid out
as the prompt once followed by each row's response:

    [ prompt | response 1 | response 2 | ... | response n ]   position_ids 0..p-1 | p..p+l1-1 | p..p+l2-1 | ...

and every response token attends to the prompt and, causally, to its own response only
(``packed_block_mask.shared_prompt_block_mask`` for flex_attention, a dense mask for sdpa/eager). A response token
then sees exactly the keys and positions it sees in its own row, so its hidden states, log-probs and gradients
are those of the unshared layout (tested in float32 to 1e-5, gradients included: ``tests/test_shared_prompts.py``);
the prompt's activations receive the gradient of all ``n`` responses at once, which is the sum the unshared layout
accumulates. The first token of response ``i`` is predicted by the prompt's last token (one hidden state, ``n``
labels), so ``predictor_index`` is no longer ``label_index - 1`` there.

Micro-batches are formed from *units* (``micro_batch_units``): a group of rows sharing a prompt counts as
``p + sum(l_i)`` tokens against the token budget and stays in one micro-batch (split into sub-groups, each with
its own copy of the prompt, when it exceeds the budget); so a group is not broken up by the balancing.

Variable-length kernels (flash_attention_2, torch_varlen) take sequence boundaries, not a mask, and cannot express
"attend to this other segment": with them the rows are packed as before (``supports_shared_prompts``).
"""

from __future__ import annotations

from typing import Optional

import torch

from verl.workers.actor.packed_rows import PackedRows, padded_packed_length

__all__ = ["prompt_groups", "micro_batch_units", "shared_prompt_layout"]


def _prompt_tokens(input_ids: torch.Tensor, valid: torch.Tensor, row: int, prompt_width: int) -> torch.Tensor:
    return input_ids[row, :prompt_width][valid[row, :prompt_width]]


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> list[list[int]]:
    """Row indices grouped by identical valid prompt tokens (the first ``S - response_length`` columns), each group
    in row order, groups in the order of their first row; rows with an empty prompt stay alone. Host tensors."""
    input_ids, valid = input_ids.cpu(), attention_mask.bool().cpu()  # one copy (a no-op for the actor's host plans)
    width = input_ids.shape[1] - response_length
    groups: dict[bytes, list[int]] = {}
    alone: dict[int, list[int]] = {}
    for row in range(input_ids.shape[0]):
        prompt = _prompt_tokens(input_ids, valid, row, width)
        if prompt.numel() == 0:
            alone[row] = [row]
        else:
            groups.setdefault(prompt.numpy().tobytes(), []).append(row)
    return sorted([*groups.values(), *alone.values()], key=lambda rows: rows[0])


def micro_batch_units(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int, max_token_len: Optional[int]
) -> tuple[list[list[int]], list[int]]:
    """Rows grouped as ``prompt_groups`` and the tokens each group packs to (``p + sum(l_i)``), a group split into
    consecutive sub-groups where it would exceed ``max_token_len`` (None: no limit; a sub-group holds at least
    one row). Returns ``(units, lengths)``."""
    valid = attention_mask.bool()
    width = input_ids.shape[1] - response_length
    prompt_lens = valid[:, :width].sum(dim=1).tolist()
    response_lens = valid[:, width:].sum(dim=1).tolist()
    units: list[list[int]] = []
    lengths: list[int] = []
    for rows in prompt_groups(input_ids, attention_mask, response_length):
        prompt = prompt_lens[rows[0]]
        current: list[int] = []
        length = prompt
        for row in rows:
            if current and max_token_len is not None and length + response_lens[row] > max_token_len:
                units.append(current)
                lengths.append(length)
                current, length = [], prompt
            current.append(row)
            length += response_lens[row]
        units.append(current)
        lengths.append(length)
    return units, lengths


def shared_prompt_layout(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int, length_multiple: int = 1
) -> Optional[PackedRows]:
    """The shared-prompt layout of a ``[b, S]`` micro-batch on the host (its valid position_ids checked by the caller
    to count 0, 1, ... per row), or None when no two rows share a prompt. ``segment_ids``: the segment (a row's
    prompt + response, a shared prompt, or one response of a group) of every token, non-decreasing; ``prefix_ids``:
    the segment each token may attend to besides its own (a response's shared prompt, else its own). Padding up to
    ``length_multiple`` (``padded_packed_length``) is one more segment, as in ``forward.pack_rows``."""
    groups = prompt_groups(input_ids, attention_mask, response_length)
    if all(len(rows) == 1 for rows in groups):
        return None
    input_ids, valid = input_ids.cpu(), attention_mask.bool().cpu()
    width = input_ids.shape[1] - response_length
    num_rows = input_ids.shape[0]
    pieces: list[torch.Tensor] = []  # token pieces in packed order, each one segment
    positions: list[torch.Tensor] = []
    prefixes: list[int] = []  # the prefix segment of each piece
    response_start = [0] * num_rows  # packed position of each row's first response token
    first_predictor = [-1] * num_rows  # packed position predicting it (-1: none, an empty prompt)
    cursor = saved = 0

    def place(tokens: torch.Tensor, start_position: int, prefix: int) -> None:
        nonlocal cursor
        pieces.append(tokens)
        positions.append(torch.arange(start_position, start_position + tokens.numel()))
        prefixes.append(prefix)
        cursor += tokens.numel()

    for rows in groups:
        prompt = _prompt_tokens(input_ids, valid, rows[0], width)
        p = prompt.numel()
        if len(rows) == 1:
            row = rows[0]
            response_start[row], first_predictor[row] = cursor + p, (cursor + p - 1 if p else -1)
            place(torch.cat([prompt, input_ids[row, width:][valid[row, width:]]]), 0, len(pieces))
            continue
        prompt_segment, prompt_last = len(pieces), cursor + p - 1
        place(prompt, 0, prompt_segment)
        saved += (len(rows) - 1) * p
        for row in rows:
            response_start[row], first_predictor[row] = cursor, prompt_last
            place(input_ids[row, width:][valid[row, width:]], p, prompt_segment)

    num_padding = padded_packed_length(cursor, length_multiple) - cursor
    if num_padding:
        place(input_ids.new_zeros(num_padding), 0, len(pieces))
    lengths = torch.tensor([piece.numel() for piece in pieces])
    response_valid = valid[:, width:]
    j = response_valid.long().cumsum(dim=1) - 1  # index of each valid response token within its response
    label = torch.tensor(response_start).unsqueeze(1) + j
    first = torch.tensor(first_predictor).unsqueeze(1)
    target_mask = response_valid & ((j > 0) | (first >= 0))
    predictor = torch.where(j == 0, first.expand_as(label), label - 1)
    return PackedRows(
        input_ids=torch.cat(pieces).unsqueeze(0),
        position_ids=torch.cat(positions).unsqueeze(0),
        predictor_index=predictor[target_mask],
        label_index=label[target_mask],
        target_mask=target_mask,
        num_padding=num_padding,
        segment_ids=torch.repeat_interleave(torch.arange(len(pieces)), lengths),
        prefix_ids=torch.repeat_interleave(torch.tensor(prefixes), lengths),
        tokens_saved=saved,
    )
