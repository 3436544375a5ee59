"""Conversations for supervised fine-tuning, with a loss mask on the assistant's tokens only.

Rows come from parquet / json / jsonl files (:func:`verl.utils.dataset.rl_dataset.read_rows`):

* multi-turn (``data.multiturn.enable=True``): a column ``data.multiturn.messages_key`` holding a list of
  ``{"role", "content"}`` messages (roles ``system``, ``user``, ``assistant``, ``tool``);
* single-turn: columns ``data.prompt_key`` and ``data.response_key`` (text), read as the conversation
  ``[user: prompt, assistant: response]``.

Tokens and mask (:func:`tokenize_with_assistant_mask`). The whole conversation is rendered once with the chat
template and tokenised; the tokens of assistant message ``i`` are those between the rendering of
``messages[:i]`` with the generation prompt and the rendering of ``messages[:i + 1]`` (upstream verl's
``MultiTurnSFTDataset`` does the same), so the role header (``<|im_start|>assistant\\n``) is never trained and
the content and the end-of-turn token are. Tokens after the span's last special token (the ``\\n`` a ChatML
template writes after ``<|im_end|>``) are not trained either: the model stops at ``<|im_end|>`` and never
generates them, exactly as a ``{% generation %}`` block marks it. The conversation is tokenised once: a prefix's
token count is read off a fast tokenizer's offsets where its text ends on a token boundary (the prefix is
tokenised on its own only where it does not, or for a slow tokenizer). Each prefix must tokenise to a prefix of the
whole conversation; a template for which it does not (one that rewrites earlier turns) raises ``ValueError``.

Truncation to ``data.max_length`` tokens (``data.truncation``): ``error`` raises, ``left`` keeps the last
tokens (the final answer), ``right`` keeps the first ones; the mask is cut with the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from verl.utils.dataset.rl_dataset import read_rows
from verl.utils.torch_functional import compute_position_id_with_mask

__all__ = ["MultiTurnSFTDataset", "SFT_TRUNCATIONS", "sft_collate", "tokenize_with_assistant_mask"]

SFT_TRUNCATIONS = ("error", "left", "right")
ROLES = ("system", "user", "assistant", "tool")


def _render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool, chat_template: str | None) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
    )


def _encode(tokenizer: Any, text: str) -> tuple[list[int], dict[int, int] | None]:
    """Token ids of ``text`` and, for a fast tokenizer, ``{character offset: number of tokens ending there}``."""
    if not getattr(tokenizer, "is_fast", False):
        return tokenizer(text, add_special_tokens=False)["input_ids"], None
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return encoded["input_ids"], {end: k + 1 for k, (_, end) in enumerate(encoded["offset_mapping"])}


def _prefix_length(tokenizer: Any, ids: list[int], text: str, ends: dict[int, int] | None, prefix: str) -> int | None:
    """How many leading tokens of ``ids`` (the tokens of ``text``) spell ``prefix``; None when no prefix of ``ids``
    does. Read off the offsets when ``prefix`` ends on a token boundary of ``text``, so the conversation is
    tokenised once; otherwise ``prefix`` is tokenised on its own and compared."""
    if ends is not None and text.startswith(prefix) and len(prefix) in ends:
        return ends[len(prefix)]
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    return len(prefix_ids) if ids[: len(prefix_ids)] == prefix_ids else None


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def tokenize_with_assistant_mask(
    tokenizer: Any, messages: Sequence[dict], chat_template: str | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of the templated conversation and a 0/1 mask marking the assistant tokens (see the module
    docstring). Raises ``ValueError`` for a conversation without an assistant message, one that starts with one,
    or a template whose prefixes do not tokenise to prefixes of the whole conversation."""
    messages = list(messages)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant message: nothing to train on")
    if messages[0]["role"] == "assistant":
        raise ValueError("the conversation starts with an assistant message: it has no prompt")
    text = _render(tokenizer, messages, False, chat_template)
    ids, ends = _encode(tokenizer, text)
    mask = [0] * len(ids)
    special = _special_ids(tokenizer)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        lo = _prefix_length(tokenizer, ids, text, ends, _render(tokenizer, messages[:i], True, chat_template))
        hi = _prefix_length(tokenizer, ids, text, ends, _render(tokenizer, messages[: i + 1], False, chat_template))
        if lo is None or hi is None:
            raise ValueError(
                f"the chat template renders messages[:{i}] / messages[:{i + 1}] as something that does not "
                "tokenise to a prefix of the whole conversation, so the assistant tokens cannot be located; "
                "set data.chat_template to a template that renders earlier turns unchanged"
            )
        last_special = max((k for k in range(lo, hi) if ids[k] in special), default=None)
        if last_special is not None:
            hi = last_special + 1  # content + end-of-turn token; not what the template writes after it
        mask[lo:hi] = [1] * (hi - lo)
    return ids, mask


def _as_messages(value: Any, where: str) -> list[dict]:
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where}: expected a non-empty list of messages, got {type(value).__name__}")
    messages = []
    for k, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: message {k} is not a {{'role', 'content'}} dict: {message!r:.120}")
        role, content = str(message["role"]), message["content"]
        if role not in ROLES:
            raise ValueError(f"{where}: message {k} has role {role!r}; expected one of {ROLES}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: message {k} content is {type(content).__name__}, expected text")
        messages.append({"role": role, "content": content})
    return messages


class MultiTurnSFTDataset(torch.utils.data.Dataset):
    """SFT rows as ``{"input_ids", "loss_mask"}`` (1-D long tensors), tokenised on first access and kept: later
    epochs (and validation passes) read the cached tensors instead of templating and tokenising again. The cache
    holds only the rows this process reads (under FSDP each rank tokenises its own share).

    Args:
        files: parquet / json / jsonl path(s).
        tokenizer: the model's Hugging Face tokenizer.
        config: the ``data`` section (``multiturn.enable``, ``multiturn.messages_key``, ``prompt_key``,
            ``response_key``, ``max_length``, ``truncation``, ``chat_template``).
    """

    def __init__(self, files: str | Sequence[str], tokenizer: Any, config: Any) -> None:
        cfg = dict(config or {})
        multiturn = dict(cfg.get("multiturn") or {})
        self.tokenizer = tokenizer
        self.max_length = int(cfg.get("max_length", 1024))
        self.truncation = str(cfg.get("truncation", "error"))
        if self.truncation not in SFT_TRUNCATIONS:
            raise ValueError(f"data.truncation must be one of {SFT_TRUNCATIONS}, got {self.truncation!r}")
        if self.max_length < 2:
            raise ValueError(f"data.max_length must be >= 2, got {self.max_length}")
        self.chat_template = _load_template(cfg.get("chat_template"))
        df = read_rows(files)
        if bool(multiturn.get("enable", True)):
            key = str(multiturn.get("messages_key", "messages"))
            self._need_column(df, key, "data.multiturn.messages_key")
            self.conversations = [
                _as_messages(v, f"{df['_source_file'][i]} row {i} ({key})") for i, v in enumerate(df[key])
            ]
        else:
            pkey, rkey = str(cfg.get("prompt_key", "prompt")), str(cfg.get("response_key", "response"))
            self._need_column(df, pkey, "data.prompt_key")
            self._need_column(df, rkey, "data.response_key")
            self.conversations = [
                [{"role": "user", "content": str(p)}, {"role": "assistant", "content": str(r)}]
                for p, r in zip(df[pkey], df[rkey])
            ]
        self.sources = [str(s) for s in df["_source_file"]]
        self._cache: dict[int, dict[str, torch.Tensor]] = {}

    @staticmethod
    def _need_column(df: Any, key: str, config_key: str) -> None:
        if key not in df.columns:
            found = [c for c in df.columns if c != "_source_file"]
            raise ValueError(f"{config_key}={key!r} is not a column of the data files (columns: {found})")

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        if index not in self._cache:
            self._cache[index] = self._tokenize(index)
        return self._cache[index]

    def _tokenize(self, index: int) -> dict[str, torch.Tensor]:
        try:
            ids, mask = tokenize_with_assistant_mask(self.tokenizer, self.conversations[index], self.chat_template)
        except ValueError as error:
            raise ValueError(f"{self.sources[index]} row {index}: {error}") from None
        if len(ids) > self.max_length:
            if self.truncation == "error":
                raise ValueError(
                    f"{self.sources[index]} row {index} has {len(ids)} tokens > data.max_length={self.max_length}; "
                    "raise data.max_length or set data.truncation to left or right"
                )
            cut = slice(len(ids) - self.max_length, None) if self.truncation == "left" else slice(0, self.max_length)
            ids, mask = ids[cut], mask[cut]
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long)}


def _load_template(spec: Any) -> str | None:
    """``data.chat_template``: null (the tokenizer's own), a path to a Jinja file, or the template text."""
    if spec is None or str(spec).strip() == "":
        return None
    from pathlib import Path

    text = str(spec)
    if "{" not in text:
        path = Path(text).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"data.chat_template={text!r}: no such file (give a .jinja path or the template)")
        return path.read_text()
    return text


def sft_collate(rows: Sequence[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows to the longest one: ``input_ids``, ``attention_mask``, ``position_ids``, ``loss_mask``."""
    length = max(int(r["input_ids"].numel()) for r in rows)
    out = {
        "input_ids": torch.full((len(rows), length), int(pad_token_id), dtype=torch.long),
        "attention_mask": torch.zeros((len(rows), length), dtype=torch.long),
        "loss_mask": torch.zeros((len(rows), length), dtype=torch.long),
    }
    for k, row in enumerate(rows):
        n = int(row["input_ids"].numel())
        out["input_ids"][k, :n] = row["input_ids"]
        out["attention_mask"][k, :n] = 1
        out["loss_mask"][k, :n] = row["loss_mask"]
    out["position_ids"] = compute_position_id_with_mask(out["attention_mask"])
    return out
