"""Split a long document into memory-agent chunks, lazily and with bounded memory.

Two ways of measuring a chunk:

* **Token chunks** (a tokenizer is given, e.g. ``--tokenizer /path/to/model``): every chunk holds
  exactly ``chunk_tokens`` tokens of the served model's tokenizer (the last one fewer), as in the
  original evaluation (tokenize, slice every 5,000 tokens).
* **Approximate character chunks** (no tokenizer): a chunk is ``round(chunk_tokens *
  chars_per_token)`` characters (default 4 characters per token, about right for English text and
  BPE tokenizers), moved back to the last whitespace within the final 10 % of the window so words
  are not split. Use this when the tokenizer of a remote model is not available locally; chunks are
  then only approximately ``chunk_tokens`` long.

Bounded memory: the text is never tokenized as a whole. It is walked in windows of a few chunks'
worth of characters (cut at whitespace); each window is tokenized with character offsets, full
chunks are cut out of it as exact substrings of the document, and the unused tail is carried into
the next window. Per-token Python objects therefore exist for one window at a time, so a
1M-token document costs the same per chunk as a 32K one. Because windows are cut at whitespace
and the window's last (possibly incomplete) token is never used as a cut point, chunk boundaries
equal those of whole-text tokenization for ordinary text; at worst a chunk is a token longer or
shorter at a window seam. The chunks always concatenate back to the exact document text.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "DEFAULT_CHARS_PER_TOKEN",
    "HFTokenizer",
    "TokenSpanner",
    "count_tokens",
    "iter_chunks",
    "load_tokenizer",
    "middle_truncate",
]

DEFAULT_CHARS_PER_TOKEN = 4.0
"""Characters per token assumed by the approximate character chunking."""

_MIN_WINDOW_CHARS = 1 << 16


class TokenSpanner(Protocol):
    """What the chunker needs from a tokenizer: where each token of ``text`` starts."""

    def token_starts(self, text: str) -> list[int]:
        """Character offset (into ``text``) of the start of every token, in order."""
        ...


@dataclass
class HFTokenizer:
    """Adapter of a Hugging Face *fast* tokenizer to :class:`TokenSpanner` (no special tokens)."""

    tokenizer: Any

    def __post_init__(self) -> None:
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError(
                f"chunking needs a fast tokenizer (character offsets); {type(self.tokenizer).__name__} is not fast"
            )

    def token_starts(self, text: str) -> list[int]:
        # the Rust tokenizer directly: same offsets as ``tokenizer(..., return_offsets_mapping=True)``,
        # without the Python wrapper's per-call state handling; encode_batch (unlike encode) releases
        # the GIL, so threads sharing one tokenizer run in parallel
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return [start for start, _ in backend.encode_batch([text], add_special_tokens=False)[0].offsets]
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return [start for start, _ in enc["offset_mapping"]]


_IMPORT_LOCK = threading.Lock()


def load_tokenizer(path: str | Path | None) -> HFTokenizer | None:
    """Load the tokenizer at ``path`` (a local model folder) for token chunking; None -> None.

    Raises:
        ValueError: if the folder has no loadable tokenizer (names the path).
    """
    if path is None or str(path) == "":
        return None
    with _IMPORT_LOCK:  # callers run this in worker threads; a concurrent first import of transformers'
        from transformers import AutoTokenizer  # lazy module can fail with "cannot import name"

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - re-raised with the path named
        raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {type(exc).__name__}: {exc}") from exc
    return HFTokenizer(tok)


def _cut_at_whitespace(text: str, start: int, end: int, slack: int) -> int:
    """Move ``end`` back to just after the last whitespace in ``text[end - slack:end]`` (if any)."""
    lo = max(start + 1, end - slack)
    best = -1
    for sep in (" ", "\n", "\t"):
        best = max(best, text.rfind(sep, lo, end))
    return best + 1 if best >= 0 else end


def _iter_char_chunks(text: str, chunk_chars: int) -> Iterator[tuple[str, int]]:
    pos, n = 0, len(text)
    while pos < n:
        end = min(n, pos + chunk_chars)
        if end < n:
            end = _cut_at_whitespace(text, pos, end, max(1, chunk_chars // 10))
        yield text[pos:end], end - pos
        pos = end


def _iter_token_chunks(
    text: str, chunk_tokens: int, tokenizer: TokenSpanner, window_chars: int | None
) -> Iterator[tuple[str, int]]:
    n = len(text)
    window = window_chars or max(_MIN_WINDOW_CHARS, chunk_tokens * 16)
    pos = 0
    while pos < n:
        end = min(n, pos + window)
        is_last = end == n
        if not is_last:
            end = _cut_at_whitespace(text, pos, end, max(1, window // 4))
        piece = text[pos:end]
        starts = tokenizer.token_starts(piece)
        if not starts:  # e.g. whitespace the tokenizer drops
            if is_last:
                yield piece, 0
                return
            window *= 2
            continue
        # A non-final window keeps its last token (it may be cut mid-word) for the next window.
        usable = len(starts) if is_last else len(starts) - 1
        emitted = 0
        cut = 0  # the first chunk of a window starts at the window start (keeps leading spaces)
        while usable - emitted > chunk_tokens or (is_last and usable - emitted > 0):
            take = min(chunk_tokens, usable - emitted)
            nxt = emitted + take
            end_char = starts[nxt] if nxt < len(starts) else len(piece)
            yield piece[cut:end_char], take
            cut, emitted = end_char, nxt
        if is_last:
            if cut < len(piece):  # trailing text after the last token start (already covered) - safety
                yield piece[cut:], 0
            return
        if emitted == 0:  # window too small for one chunk (very long tokens): grow it
            window *= 2
            continue
        pos += cut


def iter_chunks(
    text: str,
    chunk_tokens: int,
    tokenizer: TokenSpanner | None = None,
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
    window_chars: int | None = None,
) -> Iterator[str]:
    """Yield the chunks of ``text`` lazily (see the module docstring); they concatenate to ``text``.

    Args:
        text: the document.
        chunk_tokens: tokens per chunk (e.g. 5,000).
        tokenizer: the served model's tokenizer (:class:`HFTokenizer`) for exact token chunks, or
            None for approximate character chunks.
        chars_per_token: characters per token of the approximate mode.
        window_chars: characters tokenized at a time in token mode (default ``max(65536, 16 *
            chunk_tokens)``); mainly for tests.

    Raises:
        ValueError: if ``chunk_tokens`` or ``chars_per_token`` is not positive.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if tokenizer is None:
        if chars_per_token <= 0:
            raise ValueError(f"chars_per_token must be positive, got {chars_per_token}")
        chunks = _iter_char_chunks(text, max(1, round(chunk_tokens * chars_per_token)))
    else:
        chunks = _iter_token_chunks(text, chunk_tokens, tokenizer, window_chars)
    for chunk, _ in chunks:
        if chunk:
            yield chunk


def count_tokens(
    text: str, tokenizer: TokenSpanner | None = None, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
) -> int:
    """Number of tokens of ``text``, counted window by window (approximate without a tokenizer)."""
    if tokenizer is None:
        return round(len(text) / chars_per_token)
    return sum(n for _, _, n in _token_spans(text, tokenizer))


_SPAN_TOKENS = 4096
"""Tokens per span of the streamed counting in :func:`middle_truncate`."""


def _token_spans(text: str, tokenizer: TokenSpanner) -> list[tuple[int, int, int]]:
    """``(start_char, end_char, n_tokens)`` of consecutive spans of ~4,096 tokens (one streamed pass)."""
    spans, pos = [], 0
    for chunk, n in _iter_token_chunks(text, _SPAN_TOKENS, tokenizer, None):
        spans.append((pos, pos + len(chunk), n))
        pos += len(chunk)
    return spans


def _prefix_chars(text: str, n_tokens: int, tokenizer: TokenSpanner, spans: list[tuple[int, int, int]]) -> int:
    """Characters of ``text`` covered by its first ``n_tokens`` tokens, given its :func:`_token_spans`
    (only the span holding the cut is tokenized again)."""
    if n_tokens <= 0:
        return 0
    seen = 0
    for start, end, n in spans:
        if seen + n >= n_tokens:
            starts = tokenizer.token_starts(text[start:end])
            k = n_tokens - seen
            return start + (starts[k] if k < len(starts) else end - start)
        seen += n
    return len(text)


def middle_truncate(
    text: str,
    max_tokens: int | None,
    tokenizer: TokenSpanner | None = None,
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
) -> tuple[str, int, int]:
    """Keep the first ``max_tokens // 2`` and the last ``max_tokens - max_tokens // 2`` tokens.

    This is the centre/middle truncation of the original harness (first half + last half of the
    token sequence). Returns ``(text, tokens_before, tokens_after)``; the text is unchanged when it
    already fits or ``max_tokens`` is None. One streamed pass counts the tokens (bounded memory);
    only the two spans that hold the cuts are tokenized again.
    """
    if tokenizer is None:
        total = count_tokens(text, None, chars_per_token)

        def prefix(n: int) -> int:
            return min(len(text), round(max(0, n) * chars_per_token))
    else:
        spans = _token_spans(text, tokenizer)  # one pass: the count, and where to look for the two cuts
        total = sum(n for _, _, n in spans)

        def prefix(n: int) -> int:
            return _prefix_chars(text, n, tokenizer, spans)

    if max_tokens is None or total <= max_tokens:
        return text, total, total
    head = max_tokens // 2
    head_end = prefix(head)
    tail_start = max(prefix(total - (max_tokens - head)), head_end)
    return text[:head_end] + text[tail_start:], total, max_tokens
