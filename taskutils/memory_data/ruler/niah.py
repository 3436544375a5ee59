"""RULER needle-in-a-haystack tasks (single, multi-key, multi-value, multi-query; docs/spec.md#ruler-tasks).

Needle: ``"One of the special magic {type_needle_v} for {key} is: {value}."``. Haystacks:

* ``essay``: essay sentences (from a random start, cyclic), needles inserted at depths drawn from
  40 evenly spaced depths in 0-100 %, sentences joined by spaces;
* ``repeat``: the noise paragraph repeated, needles at random positions, joined by newlines;
* ``needle``: distractor needles with other random keys (never a queried key), joined by newlines.

The haystack size is the largest that keeps ``tokens(question) + tokens(context) + 128`` within
the target length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from taskutils.memory_data.documents import sample_rng
from taskutils.memory_data.haystack import NOISE_SENTENCES, insert_at_fractions
from taskutils.memory_data.ruler.common import RulerResources, distinct_values, random_value, record, tolerance_for
from taskutils.memory_data.ruler.constants import ANSWER_PREFIXES, NIAH_DEPTHS, TEMPLATES, TOKENS_TO_GENERATE
from taskutils.memory_data.tokens import TokenCounter, fit_to_budget

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."


def singular_template(template: str) -> str:
    """RULER's rewrite for one query with one value: "Some ... are" -> "A ... is" etc."""
    return template.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def join_queries(queries: list[str]) -> str:
    """ "a" / "a, and b" / "a, b, and c" (RULER's multi-query phrasing)."""
    return queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]


class LazyLines:
    """Distractor lines generated on demand, with token counts (``"\\n" + line``) and prefix sums."""

    def __init__(self, make_line: Callable[[], str], counter: TokenCounter):
        self.make_line, self.counter = make_line, counter
        self.lines: list[str] = []
        self.prefix = [0]

    def ensure(self, n: int) -> None:
        if n <= len(self.lines):
            return
        new = [self.make_line() for _ in range(n - len(self.lines) + max(64, len(self.lines) // 4))]
        for c in self.counter.count_many(["\n" + s for s in new]):
            self.prefix.append(self.prefix[-1] + c)
        self.lines.extend(new)

    def tokens(self, n: int) -> int:
        self.ensure(n)
        return self.prefix[n]


def generate_niah(
    task: str,
    index: int,
    max_length: int,
    res: RulerResources,
    haystack: str,
    key: str,
    value: str,
    num_k: int,
    num_v: int,
    num_q: int,
) -> dict[str, Any]:
    """One NIAH sample for ``task`` at ``max_length`` tokens (deterministic per seed/task/length/index)."""
    rng = sample_rng(res.seed, task, max_length, index)
    counter = res.counter
    num_k = max(num_k, num_q)
    keys = distinct_values(key, num_k, rng)
    values = distinct_values(value, num_k * num_v, rng)
    values_of = [values[i * num_v : (i + 1) * num_v] for i in range(num_k)]
    needles = [NEEDLE.format(type_needle_v=value, key=k, value=v) for k, vs in zip(keys, values_of) for v in vs]
    rng.shuffle(needles)
    picked = rng.sample(range(num_k), num_q)
    queries = [keys[i] for i in picked]
    answers = [v for i in picked for v in values_of[i]]

    template, prefix_t, type_v = TEMPLATES["niah"], ANSWER_PREFIXES["niah"], value
    if num_q * num_v == 1:
        template, prefix_t, type_v = singular_template(template), singular_template(prefix_t), value[:-1]
    query = join_queries(queries)
    question = template.format(type_needle_v=type_v, query=query)
    answer_prefix = prefix_t.format(type_needle_v=type_v, query=query)

    ttg = TOKENS_TO_GENERATE["niah"]
    budget = max_length - ttg
    q_tokens = counter.count(question)
    if haystack == "essay":
        depths = (
            rng.sample(NIAH_DEPTHS, len(needles))
            if len(needles) <= len(NIAH_DEPTHS)
            else [rng.choice(NIAH_DEPTHS) for _ in needles]
        )
        fractions = [d / 100 for d in depths]
        needle_tokens = sum(counter.count_many([" " + s for s in needles]))
        essay = res.essay
        start = rng.randrange(len(essay))
        sep = " "

        def pieces(n: int) -> list[str]:
            return essay.take(start, n)

        def estimate(n: int) -> int:
            return q_tokens + needle_tokens + essay.tokens(start, n)

        per_piece = essay.mean_tokens
    else:
        fractions = [rng.random() for _ in needles]
        needle_tokens = sum(counter.count_many(["\n" + s for s in needles]))
        sep = "\n"
        if haystack == "repeat":
            noise_tokens = counter.count("\n" + NOISE_SENTENCES)

            def pieces(n: int) -> list[str]:
                return [NOISE_SENTENCES] * n

            def estimate(n: int) -> int:
                return q_tokens + needle_tokens + n * noise_tokens

            per_piece = noise_tokens
        elif haystack == "needle":
            line_rng = sample_rng(res.seed, task, max_length, index, "distractors")
            taken = set(keys)

            def make_line() -> str:
                k = random_value(key, line_rng)
                while k in taken:
                    k = random_value(key, line_rng)
                return NEEDLE.format(type_needle_v=value, key=k, value=random_value(value, line_rng))

            lines = LazyLines(make_line, counter)

            def pieces(n: int) -> list[str]:
                lines.ensure(n)
                return lines.lines[:n]

            def estimate(n: int) -> int:
                return q_tokens + needle_tokens + lines.tokens(n)

            per_piece = lines.tokens(64) / 64
        else:
            raise ValueError(f"{task}: unknown haystack {haystack!r} (essay, repeat or needle)")

    def build(n: int) -> str:
        return sep.join(insert_at_fractions(pieces(n), needles, fractions))

    def exact(n: int) -> int:
        return q_tokens + counter.count(build(n))

    guess = max(0, int((budget - q_tokens - needle_tokens) / max(per_piece, 1e-9)))
    n, total = fit_to_budget(estimate, exact, budget, guess, tolerance=tolerance_for(max_length))
    return record(index, question, build(n), answers, answer_prefix, total + ttg)
