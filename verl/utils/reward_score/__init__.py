"""Answer verifiers and the ``data_source`` -> scorer dispatch used by the reward managers.

Built-in routes (longest matching prefix wins; prefixes are case-sensitive):

=========================================  ===============================================
``data_source`` starts with                scorer
=========================================  ===============================================
``hotpotqa``                               :func:`hotpotqa.compute_score` (strict boxed EM)
``ruler_hotpotqa``, ``ruler_hqa``          :func:`hotpotqa.compute_score`
``ruler_qa``                               :func:`hotpotqa.compute_score` (any gold answer)
``synthetic``                              :func:`hotpotqa.compute_score` (our synthetic QA sets)
``ruler_`` (every other RULER task)        :func:`ruler.compute_score` (string_match_all, 0..1)
``gsm8k``, ``openai/gsm8k``                :func:`gsm8k.compute_score` (strict, as upstream)
``lighteval/MATH``, ``HuggingFaceH4/       :func:`math.compute_score` (Hendrycks MATH
MATH-500``, ``DigitalLearningGmbH/MATH-    normalisation, as upstream)
lighteval``
=========================================  ===============================================

Add a route with :func:`register_scorer`. A scorer is called as
``fn(solution_str, ground_truth, extra_info=extra_info, **kwargs)`` and must accept ``**kwargs``.
The lenient evaluation metrics live in :mod:`verl.utils.reward_score.lenient`; they are not a
training reward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl.utils.reward_score import gsm8k, hotpotqa, lenient, ruler
from verl.utils.reward_score import math as math_reward

__all__ = [
    "Scorer",
    "_default_compute_score",
    "default_compute_score",
    "gsm8k",
    "hotpotqa",
    "known_data_sources",
    "lenient",
    "math_reward",
    "register_scorer",
    "resolve_scorer",
    "ruler",
]

Scorer = Callable[..., Any]

_SCORERS: dict[str, Scorer] = {}


def register_scorer(data_source_prefix: str, fn: Scorer | None = None, *, overwrite: bool = False) -> Any:
    """Route every ``data_source`` starting with ``data_source_prefix`` to ``fn``.

    Usable directly (``register_scorer("my_set", my_fn)``) or as a decorator
    (``@register_scorer("my_set")``). Returns ``fn``.

    Raises:
        ValueError: empty prefix, or the prefix is already bound to a different scorer and
            ``overwrite`` is False.
    """
    if not isinstance(data_source_prefix, str) or not data_source_prefix:
        raise ValueError(f"register_scorer: data_source_prefix must be a non-empty str, got {data_source_prefix!r}")

    def _register(scorer: Scorer) -> Scorer:
        existing = _SCORERS.get(data_source_prefix)
        if existing is not None and existing is not scorer and not overwrite:
            raise ValueError(
                f"register_scorer: prefix {data_source_prefix!r} is already bound to "
                f"{getattr(existing, '__module__', '?')}.{getattr(existing, '__qualname__', existing)}; "
                "pass overwrite=True to replace it"
            )
        _SCORERS[data_source_prefix] = scorer
        return scorer

    return _register if fn is None else _register(fn)


def known_data_sources() -> list[str]:
    """The registered ``data_source`` prefixes, sorted."""
    return sorted(_SCORERS)


def resolve_scorer(data_source: str) -> Scorer:
    """The scorer of the longest registered prefix of ``data_source``.

    Raises:
        ValueError: no registered prefix matches; the message names ``data_source`` and lists the
            known prefixes.
    """
    if isinstance(data_source, str):
        matches = [prefix for prefix in _SCORERS if data_source.startswith(prefix)]
        if matches:
            return _SCORERS[max(matches, key=len)]
    raise ValueError(
        f"no reward scorer for data_source={data_source!r}; known data_source prefixes: "
        f"{known_data_sources()} (add one with verl.utils.reward_score.register_scorer)"
    )


def default_compute_score(
    data_source: str,
    solution_str: str | None,
    ground_truth: Any,
    extra_info: dict | None = None,
    sandbox_fusion_url: str | None = None,
    concurrent_semaphore: Any = None,
    memory_limit_mb: Any = None,
    **kwargs: Any,
) -> Any:
    """Score ``solution_str`` against ``ground_truth`` with the scorer routed from ``data_source``.

    Upstream's signature; its code-sandbox arguments (``sandbox_fusion_url``, ``concurrent_semaphore``,
    ``memory_limit_mb``) are accepted and unused (no code data sources here).

    Returns a float (or whatever a user-registered scorer returns, e.g. a dict with ``score``).

    Raises:
        ValueError: unknown ``data_source`` (see :func:`resolve_scorer`).
    """
    del sandbox_fusion_url, concurrent_semaphore, memory_limit_mb
    scorer = resolve_scorer(data_source)
    result = scorer(solution_str, ground_truth, extra_info=extra_info, **kwargs)
    if isinstance(result, (bool, int, float)):
        return float(result)
    return result


_default_compute_score = default_compute_score
"""verl's historical name of :func:`default_compute_score`."""


for _prefix in ("hotpotqa", "ruler_hotpotqa", "ruler_hqa", "ruler_qa", "synthetic"):
    register_scorer(_prefix, hotpotqa.compute_score)
register_scorer("ruler_", ruler.compute_score)
register_scorer("gsm8k", gsm8k.compute_score)
register_scorer("openai/gsm8k", gsm8k.compute_score)
for _prefix in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
    register_scorer(_prefix, math_reward.compute_score)
del _prefix
