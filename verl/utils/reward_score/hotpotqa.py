"""Strict HotpotQA training reward (docs/spec.md#training-reward).

``compute_score`` = 1.0 iff the last boxed expression within the final ``STRICT_TAIL_CHARS`` (300)
characters of the response, lower-cased and normalised with :func:`strip_string`, equals one of the
lower-cased, normalised gold answers; else 0.0. Matching is case-insensitive and ignores spaces and
newlines, but it does **not** drop articles or punctuation (``\\boxed{Eiffel Tower}`` does not match
the gold ``"the Eiffel Tower"``); that is the job of the lenient evaluation metric in
:mod:`verl.utils.reward_score.lenient`.
"""

from __future__ import annotations

import logging
from typing import Any

from verl.utils.reward_score.math_normalize import (
    as_answer_list,
    extract_boxed_answer,
    is_equiv,
    last_boxed_only_string,
    remove_boxed,
    strip_string,
)

__all__ = [
    "STRICT_TAIL_CHARS",
    "compute_score",
    "extract_boxed_answer",
    "extract_strict_answer",
    "is_equiv",
    "last_boxed_only_string",
    "remove_boxed",
    "strip_string",
]

logger = logging.getLogger(__name__)

STRICT_TAIL_CHARS = 300
"""Only this many trailing characters of the response are inspected by the strict verifier."""


def extract_strict_answer(solution_str: str | None) -> str | None:
    """The answer the strict verifier reads: last boxed content of the lower-cased 300-char tail."""
    if not isinstance(solution_str, str):
        return None
    tail = solution_str[-STRICT_TAIL_CHARS:].lower()
    return remove_boxed(last_boxed_only_string(tail))


def compute_score(solution_str: str | None, ground_truth: Any, **kwargs: Any) -> float:
    """Strict boxed exact-match reward in {0.0, 1.0}.

    Args:
        solution_str: the decoded final answer of the trajectory (None or non-str scores 0.0).
        ground_truth: one gold answer (str) or several (list/tuple/numpy array of str); the score is
            the max over them.
        **kwargs: accepted and ignored (``extra_info`` etc. from the reward manager).

    Never raises on model output; any unexpected internal error is logged and scores 0.0.
    """
    try:
        answer = extract_strict_answer(solution_str)
        if answer is None:
            return 0.0
        for gold in as_answer_list(ground_truth):
            if is_equiv(answer, gold.lower()):
                return 1.0
        return 0.0
    except Exception as exc:  # noqa: BLE001 - a reward function must not kill the trainer
        logger.warning("hotpotqa.compute_score failed (%s: %s); scoring 0.0", type(exc).__name__, exc)
        return 0.0
