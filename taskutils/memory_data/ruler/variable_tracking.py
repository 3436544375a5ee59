"""RULER variable tracking (``vt``; docs/spec.md#ruler-tasks).

Each chain has ``num_hops + 1`` variables with 5-letter upper-case names:
``VAR X0 = <5-digit value>.`` then ``VAR Xj+1 = VAR Xj.``. The statements are placed, in chain
order, at random positions among repetitions of the noise paragraph (one piece per line). The
question gives the first chain's value; the answer is that chain's variable names.
"""

from __future__ import annotations

from typing import Any

from taskutils.memory_data.documents import sample_rng
from taskutils.memory_data.haystack import NOISE_SENTENCES, insert_at_fractions
from taskutils.memory_data.ruler.common import RulerResources, random_letters, record, tolerance_for
from taskutils.memory_data.ruler.constants import ANSWER_PREFIXES, TEMPLATES, TOKENS_TO_GENERATE
from taskutils.memory_data.tokens import fit_to_budget


def make_chains(rng: Any, num_chains: int, num_hops: int) -> tuple[list[list[str]], list[list[str]], list[str]]:
    """Returns (variable names per chain, statements per chain, value per chain)."""
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < num_chains * (num_hops + 1):
        name = random_letters(rng, 5)
        if name not in seen:
            seen.add(name)
            names.append(name)
    values: list[str] = []
    while len(values) < num_chains:
        v = str(rng.randint(10000, 99998))
        if v not in values:
            values.append(v)
    chain_vars, chain_statements = [], []
    for c in range(num_chains):
        vs = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        statements = [f"VAR {vs[0]} = {values[c]}."] + [f"VAR {vs[j + 1]} = VAR {vs[j]}." for j in range(num_hops)]
        chain_vars.append(vs)
        chain_statements.append(statements)
    return chain_vars, chain_statements, values


def generate_variable_tracking(
    task: str,
    index: int,
    max_length: int,
    res: RulerResources,
    num_chains: int = 1,
    num_hops: int = 4,
) -> dict[str, Any]:
    """One variable-tracking sample at ``max_length`` tokens."""
    rng = sample_rng(res.seed, task, max_length, index)
    counter = res.counter
    chain_vars, chain_statements, values = make_chains(rng, num_chains, num_hops)
    statements, fractions = [], []
    for stmts in chain_statements:
        fr = sorted(rng.random() for _ in stmts)
        statements.extend(stmts)
        fractions.extend(fr)
    question = TEMPLATES["variable_tracking"].format(query=values[0])
    answer_prefix = ANSWER_PREFIXES["variable_tracking"].format(num_v=num_hops + 1, query=values[0])
    ttg = TOKENS_TO_GENERATE["variable_tracking"]
    budget = max_length - ttg
    q_tokens = counter.count(question)
    statement_tokens = sum(counter.count_many(["\n" + s for s in statements]))
    noise_tokens = counter.count("\n" + NOISE_SENTENCES)

    def build(n: int) -> str:
        return "\n".join(insert_at_fractions([NOISE_SENTENCES] * n, statements, fractions))

    def estimate(n: int) -> int:
        return q_tokens + statement_tokens + n * noise_tokens

    def exact(n: int) -> int:
        return q_tokens + counter.count(build(n))

    guess = max(0, (budget - q_tokens - statement_tokens) // max(1, noise_tokens))
    n, total = fit_to_budget(estimate, exact, budget, guess, tolerance=tolerance_for(max_length))
    return record(index, question, build(n), list(chain_vars[0]), answer_prefix, total + ttg)
