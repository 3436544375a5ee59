"""Document selection, layout and rendering shared by the HotpotQA synthesis and RULER ``qa`` tasks.

docs/spec.md#document-model: a sample's documents are its own paragraphs, then its preferred distractors
(``more_doc_ids``), then documents sampled uniformly without replacement from the rest of the pool,
up to ``num_docs``; the list is shuffled and rendered as ``"Document {i}:\\n{doc}"`` blocks
(i from 1) joined by a blank line.

Layout (docs/spec.md#bug-fixed-shuffle): the original shuffles every sample with a fresh ``random.Random(4)``, so the
own (and gold) documents land at the same positions in every sample of a given size. We default to
a per-sample shuffle (``layout="random"``); ``layout="fixed"`` reproduces the original permutation.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from taskutils.memory_data.sources import QAItem

FIXED_LAYOUT_SEED = 4
"""Seed of the original's fresh-RNG shuffle (``random.Random(4).shuffle`` per sample)."""

LAYOUTS = ("random", "fixed")


def sample_rng(seed: int, *parts: object) -> random.Random:
    """A ``random.Random`` determined only by ``seed`` and ``parts`` (independent of run order/workers)."""
    return random.Random(":".join(str(p) for p in (seed, *parts)))


def render_documents(docs: Sequence[str]) -> str:
    """Render documents as ``Document 1:\\n...`` blocks joined by ``\\n\\n``."""
    return "\n\n".join(f"Document {i}:\n{doc}" for i, doc in enumerate(docs, 1))


def expand_index_context(context: str | Sequence[int], pool: Sequence[str]) -> str:
    """Render an index-only context (list of pool indices) as text; text contexts pass through.

    Large eval files (``eval_{D}.json`` with D > 10,000 documents, RULER ``qa`` above 2M tokens) store
    document indices into the sorted document pool of the source file instead of text.
    """
    if isinstance(context, str):
        return context
    return render_documents([pool[int(i)] for i in context])


def sample_other_documents(pool_size: int, count: int, exclude: set[int], rng: random.Random) -> list[int]:
    """``count`` distinct pool indices not in ``exclude``, uniformly at random, in random order."""
    available = pool_size - len(exclude)
    if count > available:
        raise ValueError(f"cannot sample {count} documents: only {available} outside the excluded set")
    if count <= 0:
        return []
    # A uniformly random ordered sample of size count+|exclude| still holds >= count non-excluded
    # indices, and its non-excluded subsequence is a uniformly random ordered sample of the rest.
    picks = rng.sample(range(pool_size), min(pool_size, count + len(exclude)))
    return [i for i in picks if i not in exclude][:count]


def select_documents(item: QAItem, num_docs: int, pool_size: int, rng: random.Random) -> list[int]:
    """Pool indices of the ``num_docs`` documents of one sample, before layout (own docs first).

    ``num_docs >= pool_size`` gives the whole pool. Raises ValueError if ``num_docs`` is smaller than
    the number of the question's own documents (they must all be present).
    """
    own = list(item.doc_ids)
    if num_docs >= pool_size:
        own_set = set(own)
        return own + [i for i in range(pool_size) if i not in own_set]
    if num_docs < len(own):
        raise ValueError(
            f"num_docs={num_docs} is smaller than the {len(own)} own documents of question index {item.index}"
        )
    more = [i for i in item.more_doc_ids if i not in set(own)]
    if num_docs - len(own) > len(more):
        rest = sample_other_documents(pool_size, num_docs - len(own) - len(more), set(own) | set(more), rng)
        return own + more + rest
    return own + rng.sample(more, num_docs - len(own))


def apply_layout(doc_ids: list[int], layout: str, rng: random.Random, fixed_seed: int = FIXED_LAYOUT_SEED) -> list[int]:
    """Shuffle a copy of ``doc_ids``: with ``rng`` ("random") or a fresh ``Random(fixed_seed)`` ("fixed")."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    out = list(doc_ids)
    (random.Random(fixed_seed) if layout == "fixed" else rng).shuffle(out)
    return out


def gold_positions(ordered_ids: Sequence[int], gold_ids: Sequence[int]) -> list[int]:
    """1-based positions (the ``Document i`` numbers) of the gold documents in ``ordered_ids``."""
    gold = set(gold_ids)
    return [pos for pos, i in enumerate(ordered_ids, 1) if i in gold]
