"""RULER aggregation tasks: common words extraction (``cwe``) and frequent words extraction (``fwe``).

* ``cwe``: a numbered list ``"1. w 2. w ..."`` of 10 common words repeated ``freq_cw`` (30) times
  and as many uncommon words as fit, each ``freq_ucw`` (3) times (6 and 1 below 4,096 tokens),
  shuffled; the answer is the 10 common words.
* ``fwe``: a vocabulary of ``max_length // 50`` random 6-letter words with ``vocab[0]`` replaced by
  ``"..."`` (noise); word k (1-based) appears ``int(N * k**-alpha / zeta(alpha))`` times, shuffled,
  N chosen to fill the length; the answer is ``vocab[1:4]``, the three most frequent real words.
"""

from __future__ import annotations

import string
from typing import Any

from taskutils.memory_data.documents import sample_rng
from taskutils.memory_data.ruler.common import RulerResources, random_letters, record, tolerance_for
from taskutils.memory_data.ruler.constants import ANSWER_PREFIXES, TEMPLATES, TOKENS_TO_GENERATE
from taskutils.memory_data.tokens import fit_largest
from taskutils.memory_data.wordlists import vocabulary


def zeta(alpha: float, terms: int = 10_000) -> float:
    """Riemann zeta(alpha) for alpha > 1 (partial sum + Euler-Maclaurin tail)."""
    if alpha <= 1:
        raise ValueError(f"zeta needs alpha > 1, got {alpha}")
    partial = sum(k**-alpha for k in range(1, terms))
    n = float(terms)
    return partial + n ** (1 - alpha) / (alpha - 1) + 0.5 * n**-alpha + alpha * n ** (-alpha - 1) / 12


def generate_cwe(
    task: str,
    index: int,
    max_length: int,
    res: RulerResources,
    freq_cw: int = 30,
    freq_ucw: int = 3,
    num_cw: int = 10,
) -> dict[str, Any]:
    """One common-words-extraction sample at ``max_length`` tokens."""
    if max_length < 4096:
        freq_cw, freq_ucw = 6, 1
    counter = res.counter
    question = TEMPLATES["common_words_extraction"]
    ttg = TOKENS_TO_GENERATE["common_words_extraction"]
    budget = max_length - ttg
    q_tokens = counter.count(question)

    def build(num_ucw: int) -> tuple[str, list[str]]:
        rng = sample_rng(res.seed, task, max_length, index)
        words = vocabulary(num_cw + num_ucw, rng)
        common, uncommon = words[:num_cw], words[num_cw:]
        items = common * freq_cw + uncommon * freq_ucw
        rng.shuffle(items)
        return " ".join(f"{i}. {w}" for i, w in enumerate(items, 1)), common

    def exact(num_ucw: int) -> int:
        return q_tokens + counter.count(build(num_ucw)[0])

    per_word = max(1.0, (exact(20) - exact(0)) / 20)
    guess = max(0, int((budget - exact(0)) / per_word))
    n, total = fit_largest(exact, budget, guess, tolerance=tolerance_for(max_length))
    context, common = build(n)
    return record(index, question, context, common, ANSWER_PREFIXES["common_words_extraction"], total + ttg)


def generate_fwe(task: str, index: int, max_length: int, res: RulerResources, alpha: float = 2.0) -> dict[str, Any]:
    """One frequent-words-extraction sample at ``max_length`` tokens."""
    counter = res.counter
    question = TEMPLATES["freq_words_extraction"]
    ttg = TOKENS_TO_GENERATE["freq_words_extraction"]
    budget = max_length - ttg
    q_tokens = counter.count(question)
    z = zeta(alpha)
    vocab_rng = sample_rng(res.seed, task, max_length, index, "vocab")
    size = max(8, max_length // 50)
    vocab: list[str] = []
    seen: set[str] = set()
    while len(vocab) < size:
        w = random_letters(vocab_rng, 6, string.ascii_lowercase)
        if w not in seen:
            seen.add(w)
            vocab.append(w)
    vocab[0] = "..."

    def build(num_words: int) -> str:
        words = []
        for k, w in enumerate(vocab, 1):
            words.extend([w] * int(num_words * k**-alpha / z))
        sample_rng(res.seed, task, max_length, index, "order").shuffle(words)
        return " ".join(words)

    def exact(num_words: int) -> int:
        return q_tokens + counter.count(build(num_words))

    min_words = int(4**alpha * z) + 1  # the 4th word (last answer) appears at least once
    guess = max(min_words, int((budget - q_tokens) / 2.5))
    n, total = fit_largest(exact, budget, guess, n_min=min_words, tolerance=tolerance_for(max_length))
    return record(index, question, build(n), vocab[1:4], ANSWER_PREFIXES["freq_words_extraction"], total + ttg)
