"""Lenient evaluation metrics of MemAgent's evaluation harness (docs/spec.md#lenient-verifier).

These are the numbers the paper reports (``sub_em`` on RULER-HotpotQA). They differ from the strict
training reward (:mod:`verl.utils.reward_score.hotpotqa`) in three ways (docs/spec.md#answer-protocols):

* the answer is read after the **last** case-sensitive ``"the answer is"`` (or from ``\\boxed{}`` for
  the boxed evaluation methods), not from the last ``\\boxed{}`` of a 300-character tail;
* text is normalised SQuAD/HotpotQA-style: lower-case, punctuation removed, articles dropped;
* ``sub_em`` is a **symmetric** containment test, so a prediction that is a substring of the gold
  also counts.

Quirk kept on purpose (docs/spec.md#lenient-verifier): an extracted prediction that is non-empty but normalises to the
empty string (``"The."``) is contained in every gold answer, so it scores ``sub_em = 1``. An empty or
missing extracted prediction scores 0 on every metric (the original evaluation scripts skip the
metric computation when the extracted prediction is falsy).
"""

from __future__ import annotations

import os
import re
import string
from collections import Counter
from typing import Any

from verl.utils.reward_score.math_normalize import as_answer_list, extract_boxed_answer

__all__ = [
    "ANSWER_PHRASE",
    "EVAL_METHODS",
    "METRIC_KEYS",
    "calc_metrics",
    "calc_metrics_unrounded",
    "exact_match_score",
    "extract_answer",
    "extract_boxed_answer",
    "extract_prediction",
    "extract_solution",
    "f1_score",
    "new_metrics",
    "normalize_answer",
    "score_prediction",
    "sub_exact_match_score",
    "update_answer",
]

ANSWER_PHRASE = "the answer is"
"""Case-sensitive phrase after whose last occurrence the evaluation answer is read."""

_CHAT_ARTIFACTS = ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")
_DELETE_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NO_ANSWER_TOKENS = ("yes", "no", "noanswer")

METRIC_KEYS = ("em", "sub_em", "f1", "prec", "recall")
"""Per-sample metrics accumulated by :func:`update_answer`."""

EVAL_METHODS = ("recurrent", "openai", "recurrent-boxed", "boxed")
"""Evaluation methods (the ``--api`` choices of the original harness) known to :func:`extract_prediction`."""


def _force_think_enabled() -> bool:
    """True when the ``FORCE_THINK`` environment variable is set to a non-empty value."""
    return bool(os.environ.get("FORCE_THINK"))


def extract_solution(solution_str: str | None, force_think: bool | None = None) -> tuple[str | None, str | None]:
    """Split off a reasoning block: ``(text after the last "</think>", stripped; original string)``.

    Without ``"</think>"`` the whole string is the solution, unless ``force_think`` is true
    (default: the ``FORCE_THINK`` environment variable is non-empty), in which case the solution is
    None. A non-str input gives ``(None, None)``.
    """
    if not isinstance(solution_str, str):
        return None, None
    if "</think>" not in solution_str:
        if force_think is None:
            force_think = _force_think_enabled()
        return (None, solution_str) if force_think else (solution_str, solution_str)
    return solution_str.rsplit("</think>", 1)[1].strip(), solution_str


def extract_answer(response: str | tuple | None) -> str | None:
    """Text after the last case-sensitive ``"the answer is"``, cleaned; None if the phrase is absent.

    Steps: delete every ``*``; take the text after the last occurrence of the phrase; remove the
    ``<｜Assistant｜>`` and ``<｜end▁of▁sentence｜>`` markers; ``strip()``, ``strip('.')``, ``strip()``.
    ``"The answer is"`` (capital T) is *not* found. A tuple from :func:`extract_solution` is accepted
    (its first element is used).
    """
    if isinstance(response, tuple):
        response = response[0] if response else None
    if not isinstance(response, str):
        return None
    response = response.replace("*", "")
    if ANSWER_PHRASE not in response:
        return None
    answer = response.rsplit(ANSWER_PHRASE, 1)[1]
    for marker in _CHAT_ARTIFACTS:
        answer = answer.replace(marker, "")
    return answer.strip().strip(".").strip()


def normalize_answer(text: str | None) -> str:
    """SQuAD normalisation: lower-case, drop ASCII punctuation, articles -> space, collapse whitespace."""
    if not isinstance(text, str):
        return ""
    text = text.lower()
    text = text.translate(_DELETE_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _scorable(prediction: Any, ground_truth: Any) -> bool:
    """Only a non-empty str prediction and a str gold are scored; everything else scores 0."""
    return bool(prediction) and isinstance(prediction, str) and isinstance(ground_truth, str)


def _f1_normalized(pred: str, gold: str) -> tuple[float, float, float]:
    """``(f1, precision, recall)`` of two already-normalised strings (HotpotQA yes/no rule)."""
    zero = (0.0, 0.0, 0.0)
    if (pred in _NO_ANSWER_TOKENS or gold in _NO_ANSWER_TOKENS) and pred != gold:
        return zero
    pred_tokens = pred.split()
    gold_tokens = gold.split()
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return zero
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


def exact_match_score(prediction: str | None, ground_truth: str | None) -> bool:
    """Normalised equality. An empty/None raw prediction (or a non-str gold) never matches."""
    if not _scorable(prediction, ground_truth):
        return False
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def sub_exact_match_score(prediction: str | None, ground_truth: str | None) -> bool:
    """Symmetric containment of the normalised strings: ``gold in pred or pred in gold``.

    An empty/None raw prediction never matches; a non-empty one that normalises to ``""`` (e.g.
    ``"the"``) is contained in any gold and matches (original behaviour, see module docstring).
    """
    if not _scorable(prediction, ground_truth):
        return False
    pred = normalize_answer(prediction)
    gold = normalize_answer(ground_truth)
    return gold in pred or pred in gold


def f1_score(prediction: str | None, ground_truth: str | None) -> tuple[float, float, float]:
    """Token-overlap ``(f1, precision, recall)`` on normalised strings, HotpotQA style.

    If either normalised side is ``yes``/``no``/``noanswer`` and the two differ, all three are 0.
    No common token (or an empty/None raw prediction) also gives zeros.
    """
    if not _scorable(prediction, ground_truth):
        return 0.0, 0.0, 0.0
    return _f1_normalized(normalize_answer(prediction), normalize_answer(ground_truth))


def new_metrics() -> dict[str, float]:
    """An empty accumulator for :func:`update_answer`."""
    metrics: dict[str, float] = {key: 0.0 for key in METRIC_KEYS}
    metrics["total_num"] = 0
    return metrics


def _sample_metrics(prediction: str | None, gold: str | None) -> dict[str, float]:
    """em, sub_em, f1, prec, recall of one prediction against one gold answer (floats).

    Same values as the public scorers, but each side is normalised only once.
    """
    if not _scorable(prediction, gold):
        return {key: 0.0 for key in METRIC_KEYS}
    pred = normalize_answer(prediction)
    norm_gold = normalize_answer(gold)
    f1, prec, recall = _f1_normalized(pred, norm_gold)
    return {
        "em": float(pred == norm_gold),
        "sub_em": float(norm_gold in pred or pred in norm_gold),
        "f1": f1,
        "prec": prec,
        "recall": recall,
    }


def update_answer(metrics: dict[str, float], prediction: str | None, gold: str | None) -> dict[str, float]:
    """Add one sample's em/sub_em/f1/prec/recall to ``metrics`` and bump ``total_num``.

    Returns this sample's metrics. Missing keys in ``metrics`` are created.
    """
    sample = _sample_metrics(prediction, gold)
    for key, value in sample.items():
        metrics[key] = metrics.get(key, 0.0) + value
    metrics["total_num"] = metrics.get("total_num", 0) + 1
    return sample


def calc_metrics(predictions: list[str | None], goldens: list[str | None], ndigits: int | None = 2) -> dict[str, float]:
    """Average em/sub_em/f1/prec/recall over paired predictions and gold answers.

    Averages are fractions in [0, 1] rounded to ``ndigits`` (2, as the original harness does; pass
    None for unrounded values). ``total_num`` is the number of pairs. No pairs -> all zeros.

    Raises:
        ValueError: if the two lists differ in length (a caller bug, not model output).
    """
    if len(predictions) != len(goldens):
        raise ValueError(f"calc_metrics: {len(predictions)} predictions but {len(goldens)} gold answers")
    metrics = new_metrics()
    for prediction, gold in zip(predictions, goldens):
        update_answer(metrics, prediction, gold)
    total = metrics["total_num"]
    for key in METRIC_KEYS:
        mean = metrics[key] / total if total else 0.0
        metrics[key] = round(mean, ndigits) if ndigits is not None else mean
    return metrics


def calc_metrics_unrounded(predictions: list[str | None], goldens: list[str | None]) -> dict[str, float]:
    """:func:`calc_metrics` without rounding (for internal aggregation)."""
    return calc_metrics(predictions, goldens, ndigits=None)


def extract_prediction(response: str | None, method: str = "recurrent") -> str | None:
    """Extract the predicted answer from a raw response the way evaluation method ``method`` does.

    The response is stripped; :func:`extract_solution` removes a ``</think>`` block (falling back to
    the whole response when it yields nothing, as the original scripts do); then ``recurrent`` and
    ``openai`` use :func:`extract_answer` ("... the answer is X"), ``recurrent-boxed`` and ``boxed``
    use :func:`extract_boxed_answer`.

    Raises:
        ValueError: for an unknown ``method`` (a configuration error).
    """
    if method in ("recurrent", "openai"):
        extractor = extract_answer
    elif method in ("recurrent-boxed", "boxed"):
        extractor = extract_boxed_answer
    else:
        raise ValueError(f"unknown evaluation method {method!r}; expected one of {list(EVAL_METHODS)}")
    if not isinstance(response, str):
        return None
    response = response.strip()
    if not response:
        return None
    solution, _ = extract_solution(response)
    return extractor(solution if solution else response)


def score_prediction(
    prediction_text: str | None,
    gold_answers: Any,
    method: str = "recurrent",
    all_golds: bool = False,
) -> dict[str, Any]:
    """Score one raw model response with the lenient metrics, as the evaluation harness does.

    Args:
        prediction_text: the raw final response.
        gold_answers: one gold answer or a list of them.
        method: ``recurrent``/``openai`` (read after "the answer is") or ``recurrent-boxed``/``boxed``
            (read from ``\\boxed{}``), see :func:`extract_prediction`.
        all_golds: False (default, the original behaviour) scores against the **first** gold answer
            only; True takes the max of em and of sub_em over all gold answers, and f1/prec/recall
            of the gold answer with the best f1.

    Returns:
        ``{"em", "sub_em", "f1", "prec", "recall"}`` as floats in [0, 1] (unrounded) plus ``"pred"``,
        the extracted prediction (None if none). No prediction or no gold answer -> all zeros.
        Difference from the original: an empty response is scored 0 here; the original harness
        dropped such samples from the average entirely.
    """
    pred = extract_prediction(prediction_text, method)
    golds = as_answer_list(gold_answers)
    if not all_golds:
        golds = golds[:1]
    result: dict[str, Any] = {key: 0.0 for key in METRIC_KEYS}
    if pred:
        for gold in golds:
            sample = _sample_metrics(pred, gold)
            result["em"] = max(result["em"], sample["em"])
            result["sub_em"] = max(result["sub_em"], sample["sub_em"])
            if sample["f1"] > result["f1"]:  # prec/recall come from the best-f1 gold
                result.update(f1=sample["f1"], prec=sample["prec"], recall=sample["recall"])
    result["pred"] = pred
    return result
