"""RULER task templates, generation budgets, answer prefixes and task settings (docs/spec.md#ruler-tasks).

MemAgent's change to RULER: templates hold only the question (no ``{context}``); the haystack is
stored separately so the agent can stream it. Answer prefixes are stored but not used in prompts.
"""

from __future__ import annotations

from typing import Any

TEMPLATES: dict[str, str] = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
    ),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text. "
        "Question: Find all variables that are assigned the value {query} in the text above."
    ),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often. Question: What are the 10 most common words in the above list?"
    ),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. Question: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?"
    ),
    "qa": "Answer the question based on the given documents. {query}",
}

ANSWER_PREFIXES: dict[str, str] = {
    "niah": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    "variable_tracking": (
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assgined the value {query}, they are: "
    ),
    "common_words_extraction": " Answer: The top 10 words that appear most often in the list are:",
    "freq_words_extraction": (
        " Answer: According to the coded text above, the three most frequently appeared words are:"
    ),
    "qa": " Answer:",
}

TOKENS_TO_GENERATE: dict[str, int] = {
    "niah": 128,
    "variable_tracking": 30,
    "common_words_extraction": 120,
    "freq_words_extraction": 50,
    "qa": 32,
}

# task name -> (generator, arguments)
TASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "niah_single_1": ("niah", dict(haystack="repeat", key="words", value="numbers", num_k=1, num_v=1, num_q=1)),
    "niah_single_2": ("niah", dict(haystack="essay", key="words", value="numbers", num_k=1, num_v=1, num_q=1)),
    "niah_single_3": ("niah", dict(haystack="essay", key="words", value="uuids", num_k=1, num_v=1, num_q=1)),
    "niah_multikey_1": ("niah", dict(haystack="essay", key="words", value="numbers", num_k=4, num_v=1, num_q=1)),
    "niah_multikey_2": ("niah", dict(haystack="needle", key="words", value="numbers", num_k=1, num_v=1, num_q=1)),
    "niah_multikey_3": ("niah", dict(haystack="needle", key="uuids", value="uuids", num_k=1, num_v=1, num_q=1)),
    "niah_multivalue": ("niah", dict(haystack="essay", key="words", value="numbers", num_k=1, num_v=4, num_q=1)),
    "niah_multiquery": ("niah", dict(haystack="essay", key="words", value="numbers", num_k=1, num_v=1, num_q=4)),
    "vt": ("variable_tracking", dict(num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0)),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}

DEFAULT_TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "fwe",
    "qa_1",
)
"""The tasks of the original ``ruler_data_prepare.sh`` (``cwe`` and ``qa_2`` are defined but not run)."""

DEFAULT_LENGTHS = (8192, 16384, 32768, 65536, 131072, 262144, 524288)

NIAH_DEPTHS = tuple(round(100 * k / 39) for k in range(40))
"""40 evenly spaced needle depths (percent) from 0 to 100, as in RULER's essay haystack."""
