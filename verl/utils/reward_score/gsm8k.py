"""GSM8K reward (upstream verl's scorer; default method ``strict`` as upstream).

Only the last 300 characters of the solution are read (as upstream).

* ``strict`` (upstream's rule exactly): the text after the last ``"#### "`` made of ``-``, digits, ``.`` and
  ``,``; commas and ``$`` are removed. So ``"#### 42."`` extracts ``"42."`` and scores 0 against ``42``, and
  ``"#### $56"`` extracts nothing.
* ``flexible`` (ours; MemAgent's tool workflow asks for it, docs/spec.md#training-reward): the last number
  anywhere in the text, where a number is an optional ``-``, an optional ``$``, digits (commas only as thousands
  separators, ``1,234,567``) and an optional decimal part; a trailing sentence period is not part of it
  (``"is 42."`` -> ``42``). Upstream's flexible keeps that period (docs/differences.md).

The comparison with the ground truth (``$``/``,`` removed) is exact string equality, as in verl
(``"18.0"`` does not equal ``"18"``).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["GSM8K_METHODS", "compute_score", "extract_solution", "normalize_number"]

GSM8K_METHODS = ("strict", "flexible")

_NUMBER = r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
SOLUTION_CLIP_CHARS = 300
_FLEXIBLE = re.compile(_NUMBER)


def normalize_number(text: str) -> str:
    """Remove ``$``, ``,`` and surrounding whitespace from a number string."""
    return text.replace("$", "").replace(",", "").strip()


def extract_solution(solution_str: str | None, method: str = "strict") -> str | None:
    """Extract the final numeric answer; None if there is none (or ``solution_str`` is not a str).

    Raises:
        ValueError: for a ``method`` other than ``strict``/``flexible`` (a configuration error).
    """
    if method not in GSM8K_METHODS:
        raise ValueError(f"gsm8k extraction method {method!r} is not one of {list(GSM8K_METHODS)}")
    if not isinstance(solution_str, str):
        return None
    solution_str = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT.findall(solution_str)
    else:
        matches = _FLEXIBLE.findall(solution_str)
    return normalize_number(matches[-1]) if matches else None


def compute_score(
    solution_str: str | None,
    ground_truth: Any,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    **kwargs: Any,
) -> float:
    """``score`` if the extracted answer equals the ground truth, ``format_score`` if an answer was
    extracted but differs, 0.0 if nothing could be extracted. ``**kwargs`` are ignored."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    gold = normalize_number(str(ground_truth)) if ground_truth is not None else None
    return float(score) if answer == gold else float(format_score)
