"""String normalisation and ``\\boxed{}`` extraction shared by the answer verifiers.

This is the reduced MATH-style normalisation used by MemAgent's HotpotQA reward (docs/spec.md#training-reward):
``strip_string`` applies exactly the rules listed there, in that order, and nothing else (no unit
removal, no ``k =`` stripping, no ``\\frac`` repair, no ``0.5 -> \\frac{1}{2}``), because the answers
are short text spans, not formulas.

Every function here is total on arbitrary model output: it never raises, it returns ``None`` (or
``False``) where the original code would have raised or found nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np

BOXED_SPACE_PREFIX = "\\boxed "
BOXED_BRACE_PREFIX = "\\boxed{"
FBOX_BRACE_PREFIX = "\\fbox{"

_BRACE = re.compile(r"[{}]")

# Rules 1-7 of ``strip_string`` (shared with the full MATH normalisation in ``math.py``), applied in this order.
LATEX_CLEANUPS = (
    ("\n", ""),
    ("\\!", ""),
    ("\\\\", "\\"),
    ("tfrac", "frac"),
    ("dfrac", "frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\$", ""),
)


def strip_string(string: str) -> str:
    """Normalise an answer string with the MemAgent/MATH rules (docs/spec.md#training-reward), in order.

    1. delete ``\\n``; 2. delete ``\\!``; 3. ``\\\\`` -> ``\\``; 4. ``tfrac``/``dfrac`` -> ``frac``;
    5. delete ``\\left`` and ``\\right``; 6. delete ``^{\\circ}`` and ``^\\circ``; 7. delete ``\\$``;
    8. delete ``\\%`` (the original deletes it twice, once per escaping style: same string);
    9. ``" ."`` -> ``" 0."`` and ``"{."`` -> ``"{0."``; 10. empty -> return it; 11. delete all spaces.

    Only ``" "`` and ``"\\n"`` count as whitespace here (tabs survive), as in the original.
    """
    for old, new in LATEX_CLEANUPS:  # rules 1-7
        string = string.replace(old, new)
    string = string.replace("\\%", "")
    string = string.replace(" .", " 0.")
    string = string.replace("{.", "{0.")
    if len(string) == 0:
        return string
    return string.replace(" ", "")


def is_equiv(str1: str | None, str2: str | None) -> bool:
    """True iff both strings are equal after :func:`strip_string`.

    Two ``None`` are equivalent, one ``None`` is not (original behaviour). If normalisation fails
    (it cannot for ``str`` input) the raw strings are compared.
    """
    if str1 is None and str2 is None:
        return True
    if str1 is None or str2 is None:
        return False
    try:
        return strip_string(str1) == strip_string(str2)
    except Exception:  # noqa: BLE001 - defensive, mirrors the original fallback
        return str1 == str2


def _matching_brace_end(string: str, start: int) -> int | None:
    """Index of the ``}`` that brings the brace depth counted from ``start`` back to zero, else None.

    Depth starts at 0 at ``start``; every ``{`` adds one, every ``}`` subtracts one, and the first
    ``}`` after which the depth is exactly 0 closes the expression (original MATH semantics, so a
    stray ``}`` before the first ``{`` drives the depth negative and is skipped over).
    """
    depth = 0
    for match in _BRACE.finditer(string, start):
        if match.group() == "{":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return match.start()
    return None


def last_boxed_only_string(string: str | None) -> str | None:
    """Return the last boxed expression of ``string`` including its wrapper, or None.

    * If ``"\\boxed "`` (space form) occurs anywhere, the result is ``"\\boxed "`` + the text after
      its **last** occurrence up to the first ``$`` (or the end). This takes precedence over any
      brace form, even a later one (original behaviour).
    * Otherwise the last ``"\\boxed"`` (fallback: last ``"\\fbox"``) is located and brace-matched;
      the result runs from there to the matching ``}``. Unbalanced -> None.
    """
    if not isinstance(string, str):
        return None
    if BOXED_SPACE_PREFIX in string:
        tail = string.rsplit(BOXED_SPACE_PREFIX, 1)[1]
        return BOXED_SPACE_PREFIX + tail.split("$", 1)[0]
    idx = string.rfind("\\boxed")
    if idx < 0:
        idx = string.rfind("\\fbox")
        if idx < 0:
            return None
    end = _matching_brace_end(string, idx)
    if end is None:
        return None
    return string[idx : end + 1]


def remove_boxed(boxed: str | None) -> str | None:
    """Strip the wrapper from the output of :func:`last_boxed_only_string`.

    ``"\\boxed X"`` -> ``"X"``; ``"\\boxed{X}"`` -> ``"X"``; ``"\\fbox{X}"`` -> ``"X"``. Anything
    else (e.g. ``"\\boxedx{a}"`` or ``"\\boxed and {a}"``) -> None.

    Deliberate deviation: the original only knew the two ``\\boxed`` wrappers and *asserted* on
    anything else, so an ``\\fbox{X}`` answer was located but then scored 0 through the exception
    handler. We unwrap ``\\fbox{X}`` as the located expression clearly intends.
    """
    if not isinstance(boxed, str):
        return None
    if boxed.startswith(BOXED_SPACE_PREFIX):
        return boxed[len(BOXED_SPACE_PREFIX) :]
    for left in (BOXED_BRACE_PREFIX, FBOX_BRACE_PREFIX):
        if boxed.startswith(left) and boxed.endswith("}") and len(boxed) > len(left):
            return boxed[len(left) : -1]
    return None


def extract_boxed_answer(string: str | None) -> str | None:
    """Content of the last ``\\boxed{...}`` (brace-matched) or ``\\boxed `` form of ``string``.

    Looks at the whole string, no lower-casing. None when there is no well-formed boxed answer.
    """
    return remove_boxed(last_boxed_only_string(string))


def as_answer_list(answers: Any) -> list[str]:
    """Coerce gold answers into a flat ``list[str]``.

    Accepts a ``str`` (one answer, *not* its characters), ``bytes``, a list/tuple/set or numpy
    array (nested ones are flattened), or a scalar (``str()`` of it). ``None`` entries are dropped;
    ``None`` itself gives ``[]``.
    """
    if answers is None:
        return []
    if isinstance(answers, str):
        return [answers]
    if isinstance(answers, bytes):
        return [answers.decode("utf-8", errors="replace")]
    if isinstance(answers, np.ndarray):
        return as_answer_list(answers.tolist()) if answers.ndim else as_answer_list(answers.item())
    if isinstance(answers, (list, tuple, set, frozenset)):
        flat: list[str] = []
        for item in answers:
            flat.extend(as_answer_list(item))
        return flat
    return [str(answers)]


def first_answer(answers: Iterable[Any] | Any) -> str | None:
    """First gold answer after :func:`as_answer_list` coercion, or None when there is none."""
    golds = as_answer_list(answers)
    return golds[0] if golds else None
