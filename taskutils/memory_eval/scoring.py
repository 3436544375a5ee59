"""Score one response with the lenient evaluation metrics and the strict training verifier, side by side.

* lenient (what the paper reports, :mod:`verl.utils.reward_score.lenient`): the prediction is read
  after the last "the answer is" (``recurrent``/``openai``) or from the last ``\\boxed{}``
  (``recurrent-boxed``/``boxed``), then ``em``, ``sub_em`` (symmetric normalised containment) and
  ``f1`` against the gold answers (best gold), plus RULER's ``string_match_all`` (fraction of gold
  strings contained in the prediction, :mod:`verl.utils.reward_score.ruler`);
* strict (the training reward, :mod:`verl.utils.reward_score.hotpotqa`): 1 iff the last ``\\boxed{}``
  in the last 300 characters of the raw response equals a gold answer;
* format-free (``in_response``): RULER's ``string_match_all`` on the whole raw response (fraction of
  gold strings it contains), for models too small to follow the answer format: it separates "the
  answer never reached the final response" from "the answer was there but not in the asked form";
* whole-word (``whole_word``): the same, but a gold answer counts only where it stands as whole words
  (case-insensitive, not inside a longer word or number): ``Castel`` is not found in ``Castell``, ``482`` not in
  ``4826``, which the substring test of ``in_response`` accepts.

The strict score of an ``answer_is`` method is usually 0 (the prompt does not ask for a box); that
gap is exactly the train/eval verifier gap that the README's "Performance" note explains.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from verl.utils.reward_score import hotpotqa
from verl.utils.reward_score.lenient import score_prediction
from verl.utils.reward_score.ruler import string_match_all_single

__all__ = [
    "FORMAT_FREE_METRIC",
    "LENIENT_METRICS",
    "SCORE_KEYS",
    "STRICT_METRIC",
    "WHOLE_WORD_METRIC",
    "gold_as_whole_word",
    "primary_metric",
    "score_response",
    "whole_word_match",
]

LENIENT_METRICS = ("em", "sub_em", "f1", "string_match_all")
STRICT_METRIC = "strict_boxed"
FORMAT_FREE_METRIC = "in_response"
WHOLE_WORD_METRIC = "whole_word"
SCORE_KEYS = LENIENT_METRICS + (STRICT_METRIC, FORMAT_FREE_METRIC, WHOLE_WORD_METRIC)

_QA_TASK_MARKERS = ("hotpot", "qa", "squad")


def primary_metric(task: str) -> str:
    """The metric reported for ``task``: ``sub_em`` for QA tasks, ``string_match_all`` for the rest."""
    return "sub_em" if any(marker in task.lower() for marker in _QA_TASK_MARKERS) else "string_match_all"


def gold_as_whole_word(response: str | None, gold: str) -> bool:
    """Whether ``gold`` occurs in ``response`` as whole words: case-insensitive, with no letter, digit or ``_``
    right before or after it (``Castel`` is in "lives in Castel." but not in "lives in Castell.")."""
    gold = str(gold).strip()
    if not response or not gold:
        return False
    return re.search(rf"(?<!\w){re.escape(gold)}(?!\w)", response, flags=re.IGNORECASE) is not None


def whole_word_match(response: str | None, answers: Iterable[str]) -> float:
    """Fraction of the gold ``answers`` that occur in ``response`` as whole words (like RULER's string_match_all)."""
    golds = [str(a) for a in answers]
    if not golds:
        return 0.0
    return sum(gold_as_whole_word(response, g) for g in golds) / len(golds)


def score_response(response: str | None, answers: list[str], method: str) -> dict[str, Any]:
    """All metrics of one raw final ``response`` against the gold ``answers`` for eval ``method``.

    Returns ``{"pred", "em", "sub_em", "f1", "string_match_all", "strict_boxed", "in_response", "whole_word"}`` (floats
    in [0, 1]).
    Lenient QA metrics take the best over all gold answers (the original used only the first,
    docs/spec.md#bug-first-gold-only).
    """
    lenient = score_prediction(response, answers, method=method, all_golds=True)
    pred = lenient["pred"]
    return {
        "pred": pred,
        "em": float(lenient["em"]),
        "sub_em": float(lenient["sub_em"]),
        "f1": float(lenient["f1"]),
        "string_match_all": float(string_match_all_single(pred, answers)) if pred else 0.0,
        STRICT_METRIC: float(hotpotqa.compute_score(response, answers)),
        FORMAT_FREE_METRIC: float(string_match_all_single(response, answers)) if response else 0.0,
        WHOLE_WORD_METRIC: whole_word_match(response, answers),
    }
