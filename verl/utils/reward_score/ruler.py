"""RULER string-match metrics (docs/spec.md#ruler-metrics) and the RULER-task scorer.

* ``string_match_all``: per sample, the fraction of reference strings contained (case-insensitive
  substring) in the prediction; averaged over samples, times 100, rounded to 2 decimals, exactly
  the batch form RULER reports. MemAgent's "all answers required" reward
  R(y_hat, Y) = |{y in Y : y in y_hat}| / |Y| is the per-sample form :func:`string_match_all_single`.
* ``string_match_part``: per sample, 1 if any reference is contained; same averaging.

The per-sample functions return fractions in [0, 1]; the batch functions return percentages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl.utils.reward_score.lenient import extract_prediction, score_prediction
from verl.utils.reward_score.math_normalize import as_answer_list

__all__ = [
    "compute_score",
    "score_ruler_response",
    "string_match_all",
    "string_match_all_single",
    "string_match_part",
    "string_match_part_single",
]


def _contained_flags(prediction: Any, references: Any) -> list[bool]:
    """For each reference, whether it occurs case-insensitively in ``prediction``."""
    refs = as_answer_list(references)
    if not isinstance(prediction, str):
        return [False] * len(refs)
    pred = prediction.lower()
    return [ref.lower() in pred for ref in refs]


def string_match_all_single(prediction: str | None, references: Any) -> float:
    """Fraction in [0, 1] of ``references`` contained case-insensitively in ``prediction``.

    ``references`` may be one string or a list of strings; no references or a None prediction -> 0.0.
    """
    flags = _contained_flags(prediction, references)
    return sum(flags) / len(flags) if flags else 0.0


def string_match_part_single(prediction: str | None, references: Any) -> float:
    """1.0 if any reference is contained case-insensitively in ``prediction``, else 0.0."""
    return 1.0 if any(_contained_flags(prediction, references)) else 0.0


def _batch_percent(per_sample: list[float]) -> float:
    """Mean x 100, rounded to 2 decimals (RULER reporting); empty -> 0.0."""
    return round(sum(per_sample) / len(per_sample) * 100, 2) if per_sample else 0.0


def _check_lengths(name: str, predictions: Sequence[Any], references: Sequence[Any]) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{name}: {len(predictions)} predictions but {len(references)} reference lists")


def string_match_all(predictions: Sequence[str | None], references: Sequence[Any]) -> float:
    """RULER ``string_match_all``: mean over samples of :func:`string_match_all_single`, x 100, 2 dp.

    Raises:
        ValueError: if the two sequences differ in length (a caller bug).
    """
    _check_lengths("string_match_all", predictions, references)
    return _batch_percent([string_match_all_single(p, r) for p, r in zip(predictions, references)])


def string_match_part(predictions: Sequence[str | None], references: Sequence[Any]) -> float:
    """RULER ``string_match_part``: mean over samples of :func:`string_match_part_single`, x 100, 2 dp.

    Raises:
        ValueError: if the two sequences differ in length (a caller bug).
    """
    _check_lengths("string_match_part", predictions, references)
    return _batch_percent([string_match_part_single(p, r) for p, r in zip(predictions, references)])


def compute_score(solution_str: str | None, ground_truth: Any, **kwargs: Any) -> float:
    """Training/validation reward for RULER sources: :func:`string_match_all_single` on the response.

    The whole decoded response is searched (no answer extraction). ``**kwargs`` are ignored.
    """
    return string_match_all_single(solution_str, ground_truth)


def score_ruler_response(response: str | None, outputs: Any, split: str, method: str = "recurrent") -> dict[str, Any]:
    """Score one evaluation response on a RULER task as MemAgent's ``ruler_general.py`` does.

    * QA splits (``"qa" in split``): lenient metrics (:func:`lenient.score_prediction`) against the
      **first** gold answer only (docs/spec.md#bug-first-gold-only).
    * Other splits: the prediction is extracted with ``method`` (e.g. after "the answer is"), then
      ``sub_em`` = :func:`string_match_all_single` of it against all references (0 if none extracted).

    Returns a dict with ``sub_em`` (and em/f1/prec/recall for QA) in [0, 1] and ``pred``.
    """
    if "qa" in split:
        return score_prediction(response, outputs, method=method, all_golds=False)
    pred = extract_prediction(response, method)
    return {"sub_em": string_match_all_single(pred, outputs) if pred else 0.0, "pred": pred}
