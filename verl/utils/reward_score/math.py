"""MATH reward (upstream ``verl.utils.reward_score.math``): the Hendrycks MATH answer normalisation.

``compute_score(solution_str, ground_truth)`` is 1.0 when the content of the last ``\\boxed{...}`` (or
``\\boxed x`` form) of the solution is equivalent to the ground truth, else 0.0. ``is_equiv`` compares the
strings after ``strip_string``, which applies, in order:

1. drop newlines and ``\\!``; ``\\\\`` -> ``\\``; ``tfrac``/``dfrac`` -> ``frac``; drop ``\\left``/``\\right``,
   degree marks ``^{\\circ}``/``^\\circ`` and ``\\$``;
2. drop a trailing unit ``"\\text{ ..."`` (the part after the only ``"\\text{ "``);
3. drop ``\\%``; ``" ."`` -> ``" 0."`` and ``"{."`` -> ``"{0."``; a leading ``.`` gets a ``0``;
4. drop a short left-hand side ``"k = "`` / ``"x = "`` (one ``=`` and at most 2 characters before it);
5. ``\\sqrt3`` -> ``\\sqrt{3}``; remove all spaces; ``\\frac12`` -> ``\\frac{1}{2}`` and ``\\frac1b`` ->
   ``\\frac{1}{b}``; the string ``0.5`` -> ``\\frac{1}{2}``; ``a/b`` of two integers -> ``\\frac{a}{b}``.

So ``0.5`` and ``\\frac12`` both equal ``\\frac{1}{2}``, as upstream. When a rule meets malformed input
(e.g. a trailing ``\\frac``) the raw strings are compared instead, as upstream does.

This is *not* the reduced normalisation of MemAgent's HotpotQA reward (``math_normalize.py``, which keeps
``0.5`` and ``\\frac{1}{2}`` apart on purpose: its answers are text spans, not formulas).
"""

from __future__ import annotations

from typing import Any

from verl.utils.reward_score.math_normalize import (
    BOXED_BRACE_PREFIX,
    BOXED_SPACE_PREFIX,
    LATEX_CLEANUPS,
    last_boxed_only_string,
)

__all__ = ["compute_score", "is_equiv", "last_boxed_only_string", "remove_boxed", "strip_string"]


class _Malformed(Exception):
    """A normalisation rule met input it cannot rewrite (the caller falls back to raw comparison)."""


def remove_boxed(boxed: str) -> str:
    """``"\\boxed X"`` -> ``"X"``, ``"\\boxed{X}"`` -> ``"X"``; anything else raises ``ValueError`` (upstream
    asserts, so e.g. an ``\\fbox{X}`` answer scores 0 there and here)."""
    if boxed.startswith(BOXED_SPACE_PREFIX):
        return boxed[len(BOXED_SPACE_PREFIX) :]
    if boxed.startswith(BOXED_BRACE_PREFIX) and boxed.endswith("}"):
        return boxed[len(BOXED_BRACE_PREFIX) : -1]
    raise ValueError(f"not a \\boxed expression: {boxed[:40]!r}")


def _fix_fracs(string: str) -> str:
    head, *rest = string.split("\\frac")
    out = head
    for part in rest:
        out += "\\frac"
        if not part:
            raise _Malformed("\\frac at the end")
        if part[0] == "{":
            out += part
            continue
        if len(part) < 2:
            return string
        numerator, second, tail = part[0], part[1], part[2:]
        if second == "{":
            out += "{" + numerator + "}" + second + tail
        else:
            out += "{" + numerator + "}{" + second + "}" + tail
    return out


def _fix_a_slash_b(string: str) -> str:
    pieces = string.split("/")
    if len(pieces) != 2:
        return string
    try:
        a, b = int(pieces[0]), int(pieces[1])
    except ValueError:
        return string
    if string != f"{a}/{b}":
        return string
    return "\\frac{" + str(a) + "}{" + str(b) + "}"


def _remove_right_units(string: str) -> str:
    if "\\text{ " not in string:
        return string
    pieces = string.split("\\text{ ")
    if len(pieces) != 2:
        raise _Malformed("more than one '\\text{ '")
    return pieces[0]


def _fix_sqrt(string: str) -> str:
    if "\\sqrt" not in string:
        return string
    head, *rest = string.split("\\sqrt")
    out = head
    for part in rest:
        if not part:
            raise _Malformed("\\sqrt at the end")
        out += "\\sqrt" + part if part[0] == "{" else "\\sqrt{" + part[0] + "}" + part[1:]
    return out


def strip_string(string: str) -> str:
    """Normalise a MATH answer (module docstring, steps 1-5). Raises ``_Malformed`` on malformed input."""
    for old, new in LATEX_CLEANUPS:
        string = string.replace(old, new)
    string = _remove_right_units(string)
    string = string.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not string:
        return string
    if string[0] == ".":
        string = "0" + string
    sides = string.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        string = sides[1]
    string = _fix_sqrt(string).replace(" ", "")
    string = _fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _fix_a_slash_b(string)


def is_equiv(str1: str | None, str2: str | None, verbose: bool = False) -> bool:
    """True iff both answers are equal after ``strip_string`` (raw equality when normalisation fails).
    Two ``None`` are equivalent, one ``None`` is not (upstream's behaviour)."""
    if str1 is None and str2 is None:
        return True
    if str1 is None or str2 is None:
        return False
    try:
        left, right = strip_string(str1), strip_string(str2)
    except (_Malformed, IndexError):
        return str1 == str2
    if verbose:
        print(left, right)
    return left == right


def compute_score(solution_str: str, ground_truth: Any, **kwargs: Any) -> float:
    """1.0 if the last boxed answer of ``solution_str`` is equivalent to ``ground_truth``, else 0.0."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    try:
        answer = remove_boxed(boxed)
    except ValueError:
        return 0.0
    return 1.0 if is_equiv(answer, str(ground_truth)) else 0.0
