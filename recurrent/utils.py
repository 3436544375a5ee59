"""Helpers of the workflow managers: truncation and token templates.

The generic conversation-batch builders live in :mod:`verl.utils.conversation_batch` (re-exported here
for existing imports)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import torch

from verl.utils.conversation_batch import (  # noqa: F401 - re-exported for existing imports
    TokenIds,
    build_conversation_batch,
    concat_conversations,
    final_batch,
    pad_token_lists,
    unpad_rows,
)


def _as_list(ids: TokenIds) -> list[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)


def center_truncate(ids: Sequence[int] | np.ndarray, max_length: int) -> Sequence[int]:
    """Keep the first ``max_length // 2`` and the last ``max_length - max_length // 2`` tokens."""
    if len(ids) <= max_length:
        return ids
    head = max_length // 2
    tail = max_length - head
    if isinstance(ids, np.ndarray | torch.Tensor):
        return np.concatenate([np.asarray(ids[:head]), np.asarray(ids[len(ids) - tail :])])
    return list(ids[:head]) + list(ids[len(ids) - tail :])


_PLACEHOLDER = re.compile(r"\{([a-zA-Z_]+)\}")


class TokenTemplate:
    """A ``str.format``-like template over token ids.

    Literal text pieces are tokenised once; ``format(**ids)`` splices token-id lists into the
    placeholders. Only ``{name}`` placeholders are recognised, so any other brace text (such as
    ``\\boxed{}``) stays literal. Used so the long context is tokenised once per sample and its
    chunks are spliced in without re-tokenising.
    """

    def __init__(self, template: str, tokenizer):
        self.pieces: list[list[int] | str] = []
        pos = 0
        for m in _PLACEHOLDER.finditer(template):
            if m.start() > pos:
                self.pieces.append(tokenizer.encode(template[pos : m.start()], add_special_tokens=False))
            self.pieces.append(m.group(1))
            pos = m.end()
        if pos < len(template):
            self.pieces.append(tokenizer.encode(template[pos:], add_special_tokens=False))
        self.keys = [p for p in self.pieces if isinstance(p, str)]
        self.length = sum(len(p) for p in self.pieces if not isinstance(p, str))

    def format(self, **values: TokenIds) -> torch.Tensor:
        missing = set(self.keys) - set(values)
        if missing:
            raise KeyError(f"TokenTemplate.format missing placeholder(s): {sorted(missing)}")
        out: list[int] = []
        for p in self.pieces:
            out.extend(_as_list(values[p]) if isinstance(p, str) else p)
        return torch.tensor(out, dtype=torch.long)


def chat_template_string(tokenizer, placeholder: str = "{message}") -> str:
    """The model's chat template around one user message, as a string with ``placeholder`` in it."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": placeholder}], add_generation_prompt=True, tokenize=False
    )
