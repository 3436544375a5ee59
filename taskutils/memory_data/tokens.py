"""Token counting with bounded memory, and the size search used to hit target token lengths.

Counting a multi-megabyte text with ``tokenizer(text)["input_ids"]`` builds a Python list of
millions of ints. :class:`TokenCounter` instead splits long texts at spaces into segments of about
``segment_chars`` characters (each later segment starts with its space, so byte-level BPE
pre-tokenisation sees the same pieces as in the whole text) and sums the per-segment lengths,
using the Rust ``tokenizers`` backend (``len(Encoding)``, no Python id lists) when available.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any


def load_tokenizer(path: str | os.PathLike) -> Any:
    """Load a Hugging Face tokenizer from a local folder (never downloads)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"--tokenizer must be a local folder with tokenizer files, got {path!r}")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class TokenCounter:
    """Counts tokens of texts (no special tokens) with a HF tokenizer, memory-bounded for long texts."""

    def __init__(self, tokenizer: Any, segment_chars: int = 100_000):
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.segment_chars = segment_chars
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None

    def _segments(self, text: str) -> list[str]:
        if len(text) <= self.segment_chars:
            return [text]
        out, start = [], 0
        while start < len(text):
            cut = text.find(" ", start + self.segment_chars)
            if cut == -1:
                out.append(text[start:])
                break
            out.append(text[start:cut])
            start = cut
        return out

    def _count_pieces(self, pieces: Sequence[str]) -> list[int]:
        if not pieces:
            return []
        if self._backend is not None:
            return [len(e) for e in self._backend.encode_batch(list(pieces), add_special_tokens=False)]
        return [len(self.tokenizer.encode(p, add_special_tokens=False)) for p in pieces]

    def count(self, text: str) -> int:
        """Number of tokens of ``text`` (segment-wise for long texts, a few segments at a time)."""
        segments = self._segments(text)
        return sum(sum(self._count_pieces(segments[i : i + 4])) for i in range(0, len(segments), 4))

    def count_many(self, texts: Sequence[str], batch: int = 512) -> list[int]:
        """Token counts of many short texts (batched)."""
        out: list[int] = []
        for i in range(0, len(texts), batch):
            group = texts[i : i + batch]
            if any(len(t) > self.segment_chars for t in group):
                out.extend(self.count(t) for t in group)
            else:
                out.extend(self._count_pieces(group))
        return out


def fit_largest(
    measure: Callable[[int], int],
    budget: int,
    n_guess: int,
    n_min: int = 0,
    n_max: int | None = None,
    tolerance: int = 0,
    max_steps: int = 64,
) -> tuple[int, int]:
    """Find a large ``n`` with ``measure(n) <= budget`` for a non-decreasing ``measure``.

    Stops at the first fitting ``n`` whose slack ``budget - measure(n)`` is at most ``tolerance``, or
    when ``n + 1`` is known not to fit, or at ``n_max``. Uses proportional steps, then regula falsi
    between the largest fitting and the smallest non-fitting ``n``.

    Returns:
        ``(n, measure(n))``.

    Raises:
        ValueError: if even ``n_min`` does not fit the budget.
    """
    lo = lo_t = hi = hi_t = None
    n = max(n_min, n_guess if n_max is None else min(n_guess, n_max))
    for _ in range(max_steps):
        t = measure(n)
        if t <= budget:
            if lo is None or n > lo:
                lo, lo_t = n, t
            if budget - t <= tolerance or (n_max is not None and n >= n_max) or (hi is not None and hi == n + 1):
                return n, t
        else:
            if n <= n_min:
                raise ValueError(f"the smallest size ({n_min}) already needs {t} tokens > budget {budget}")
            if hi is None or n < hi:
                hi, hi_t = n, t
            if lo is not None and lo == n - 1:
                return lo, lo_t
        # next guess
        if lo is not None and hi is not None:
            nxt = lo + int((budget - lo_t) * (hi - lo) / max(1, hi_t - lo_t))
            nxt = min(max(nxt, lo + 1), hi - 1)
        else:
            per_piece = max(t / max(n, 1), 1e-9)
            nxt = n + int((budget - t) / per_piece)
            if t <= budget:
                nxt = max(nxt, n + 1)
                if n_max is not None:
                    nxt = min(nxt, n_max)
            else:
                nxt = max(min(nxt, n - 1), n_min)
        n = nxt
    if lo is None:
        raise ValueError(f"could not fit budget {budget} in {max_steps} steps")
    return lo, lo_t


def fit_to_budget(
    estimate: Callable[[int], int],
    exact: Callable[[int], int],
    budget: int,
    n_guess: int,
    n_min: int = 0,
    n_max: int | None = None,
    tolerance: int = 0,
    rounds: int = 6,
) -> tuple[int, int]:
    """Like :func:`fit_largest`, but searches on a cheap ``estimate`` and checks with ``exact``.

    After each search the exact count of the chosen ``n`` corrects the estimate by a constant
    offset; typically one or two exact counts are needed per sample. Falls back to searching on
    ``exact`` directly if the estimate keeps misleading.

    Returns:
        ``(n, exact(n))`` with ``exact(n) <= budget``.
    """
    offset = 0
    for _ in range(rounds):
        n, _ = fit_largest(lambda k, offset=offset: estimate(k) + offset, budget, n_guess, n_min, n_max, tolerance)
        t = exact(n)
        new_offset = t - estimate(n)
        if t <= budget:
            at_max = n_max is not None and n >= n_max
            if budget - t <= tolerance or at_max or estimate(n + 1) + new_offset > budget:
                return n, t
        offset, n_guess = new_offset, n
    return fit_largest(exact, budget, n_guess, n_min, n_max, tolerance)
