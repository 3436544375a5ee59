"""RULER multi-document QA: ``qa_1`` (SQuAD) and ``qa_2`` (HotpotQA) (docs/spec.md#ruler-tasks).

Sample i uses the i-th answerable question of the source. Its documents are its own paragraphs,
then its preferred distractors (SQuAD: other paragraphs of the same article) and then random other
documents of the pool, as many as fit the target length; they are shuffled per sample (or with a
fresh ``Random(seed)`` under ``fixed_layout``, as RULER does) and rendered as ``Document i:``
blocks. Above ``index_only_above`` tokens (2M) the context is the list of pool indices (render with
:func:`taskutils.memory_data.documents.expand_index_context`) and lengths are estimated from the
per-document token counts. If the pool runs out, the sample holds the whole pool (shorter than the
target; SQuAD dev caps out around 256K tokens).
"""

from __future__ import annotations

from typing import Any

from taskutils.memory_data.documents import apply_layout, gold_positions, render_documents, sample_rng
from taskutils.memory_data.ruler.common import RulerResources, record, tolerance_for
from taskutils.memory_data.ruler.constants import ANSWER_PREFIXES, TEMPLATES, TOKENS_TO_GENERATE
from taskutils.memory_data.tokens import fit_to_budget


def generate_qa(task: str, index: int, max_length: int, res: RulerResources, dataset: str) -> dict[str, Any]:
    """One multi-document QA sample at ``max_length`` tokens."""
    source = res.qa_source(dataset)
    if index >= len(source.items):
        raise ValueError(
            f"{task}: sample {index} needs answerable question {index}, but {source.path} has only "
            f"{len(source.items)}; lower --num-samples"
        )
    item = source.items[index]
    counter = res.counter
    rng = sample_rng(res.seed, task, max_length, index)
    question = TEMPLATES["qa"].format(query=item.question)
    own = list(item.doc_ids)
    more = [i for i in item.more_doc_ids if i not in set(own)]
    rng.shuffle(more)
    excluded = set(own) | set(more)
    perm = list(range(len(source.docs)))
    rng.shuffle(perm)
    others = more + [i for i in perm if i not in excluded]
    del perm

    ttg = TOKENS_TO_GENERATE["qa"]
    budget = max_length - ttg
    q_tokens = counter.count(question)
    header = counter.count("\n\nDocument 100:\n")
    own_tokens = sum(res.doc_tokens(dataset, own)) + header * len(own)
    prefix = [0]

    def others_tokens(n: int) -> int:
        while len(prefix) <= n:
            start = len(prefix) - 1
            batch = others[start : start + max(256, start // 2)]
            for c in res.doc_tokens(dataset, batch):
                prefix.append(prefix[-1] + c + header)
        return prefix[n]

    def ordered(n: int) -> list[int]:
        if res.fixed_layout:
            return apply_layout(own + others[:n], "fixed", rng, fixed_seed=res.seed)
        layout_rng = sample_rng(res.seed, task, max_length, index, "layout")
        return apply_layout(own + others[:n], "random", layout_rng)

    def estimate(n: int) -> int:
        return q_tokens + own_tokens + others_tokens(n)

    def exact(n: int) -> int:
        return q_tokens + counter.count(render_documents([source.docs[i] for i in ordered(n)]))

    index_only = max_length > res.index_only_above
    per_doc = others_tokens(min(len(others), 64)) / max(1, min(len(others), 64))
    guess = min(len(others), max(0, int((budget - q_tokens - own_tokens) / max(per_doc, 1.0))))
    n, total = fit_to_budget(
        estimate,
        estimate if index_only else exact,
        budget,
        guess,
        n_max=len(others),
        tolerance=tolerance_for(max_length),
    )
    ids = ordered(n)
    context: Any = ids if index_only else render_documents([source.docs[i] for i in ids])
    return record(
        index,
        question,
        context,
        list(item.answers),
        ANSWER_PREFIXES["qa"],
        total + ttg,
        num_docs=len(ids),
        gold_docs=gold_positions(ids, item.gold_doc_ids),
        question_index=item.index,
    )
