"""Work counts of ``update_policy`` without a model or a GPU (``bench_update_policy.py --count-only``).

For a batch of the benchmark's shape (``synthetic``: prompts uniform in [1/2, 1] x ``--prompt-len``,
responses in [1/4, 1] x ``--response-len``; ``memagent``: the turns of memory-agent conversations) it counts,
per mini-batch and in total:

* micro-batches under the token budget: ``current`` (``verl.utils.seqlen_balancing.rearrange_micro_batches``),
  ``previous`` (the rule before: the smallest count whose Karmarkar-Karp partition fits the budget) and
  ``upstream`` (verl 0.7.1: ``min(rows, ceil(tokens / budget))``), and the largest micro-batch in tokens;
* tokens a forward processes: valid tokens, the padded layout (rows x the batch's width) and the packed
  layout (valid tokens, rounded up per micro-batch to flex_attention's 128-token blocks when ``--attn
  flex_attention``); the padded/valid ratio is the work padding adds;
* the entropy work the update no longer does with ``entropy_coeff=0`` (response tokens x vocabulary: float32
  logits read by the softmax, product and sum of the entropy, per micro-batch forward).

Host syncs per micro-batch are counted by ``tests/test_update_host_syncs.py`` (a dispatch-mode count of the
actor's device work: 0 from this project's code, <= 2 inside transformers' mask helpers; before: 8 per
packed micro-batch, 3 per padded fused one).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions, rearrange_micro_batches, split_rows_evenly
from verl.workers.actor.forward import padded_packed_length

__all__ = ["memagent_lengths", "previous_micro_batch_count", "count_report"]


def previous_micro_batch_count(lengths: list[int], budget: int) -> int:
    """The rule before this change: the smallest ``k >= ceil(total / budget)`` whose Karmarkar-Karp partition
    keeps every micro-batch of more than one row within the budget."""
    k = min(max(1, math.ceil(sum(lengths) / budget)), max(len(lengths), 1))
    while True:
        parts = get_seqlen_balanced_partitions(lengths, k)
        if all(sum(lengths[i] for i in p) <= budget or len(p) <= 1 for p in parts):
            return k
        k += 1


def memagent_lengths(
    conversations: int, chunks: int, chunk: int, memory: int, final: int, question: int, seed: int
) -> tuple[list[int], list[int]]:
    """(prompt, response) lengths of the turns of ``conversations`` memory-agent trajectories: ``chunks``
    memory turns (prompt = chunk + memory so far + question/template, response = a memory update of [1/2, 1]
    x ``memory`` tokens) and a final turn (prompt = memory + question/template, response in [1/4, 1] x
    ``final``). The first turn has no memory yet."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(conversations):
        held = 0
        for _turn in range(chunks):
            prompts.append(chunk + held + question)
            held = int(torch.randint(max(1, memory // 2), memory + 1, (1,), generator=gen))
            responses.append(held)
        prompts.append(held + question)
        responses.append(int(torch.randint(max(1, final // 4), final + 1, (1,), generator=gen)))
    return prompts, responses


def count_report(
    prompt_lens: list[int],
    response_lens: list[int],
    mini_batches: int,
    budget: int,
    vocab_size: int,
    length_multiple: int = 1,
    width: int | None = None,
) -> dict[str, Any]:
    """Counts for rows of these prompt/response lengths, padded to ``width`` (default: the longest prompt +
    the longest response, as ``concat_conversations`` pads the turns of a step)."""
    width = width or max(prompt_lens) + max(response_lens)
    lengths = [p + r for p, r in zip(prompt_lens, response_lens)]
    per_mini: list[dict[str, Any]] = []
    for rows in split_rows_evenly(len(lengths), mini_batches):
        mini = [lengths[i] for i in rows]
        parts = rearrange_micro_batches(mini, budget)
        sums = [sum(mini[i] for i in p) for p in parts]
        per_mini.append(
            {
                "rows": len(mini),
                "valid_tokens": sum(mini),
                "micro_batches": {
                    "current": len(parts),
                    "previous": previous_micro_batch_count(mini, budget),
                    "upstream": min(len(mini), max(1, math.ceil(sum(mini) / budget))),
                },
                "largest_micro_batch_tokens": max(sums),
                "padded_tokens": len(mini) * width,
                "packed_tokens": sum(padded_packed_length(t, length_multiple) for t in sums),
            }
        )
    valid = sum(m["valid_tokens"] for m in per_mini)
    padded = sum(m["padded_tokens"] for m in per_mini)
    packed = sum(m["packed_tokens"] for m in per_mini)
    response_tokens = sum(response_lens)
    return {
        "rows": len(lengths),
        "width": width,
        "token_budget": budget,
        "mini_batches": per_mini,
        "micro_batches": {
            key: sum(m["micro_batches"][key] for m in per_mini) for key in ("current", "previous", "upstream")
        },
        "largest_micro_batch_over_budget": max(m["largest_micro_batch_tokens"] for m in per_mini) / budget,
        "valid_tokens": valid,
        "padded_over_valid": padded / valid,
        "packed_over_valid": packed / valid,
        "response_tokens": response_tokens,
        "entropy_logit_elements_skipped": response_tokens * vocab_size,
    }
