"""Prompt texts of the MemAgent memory agent (docs/spec.md#prompts), shared by training and eval.

Two messages make up the workflow:

* the **memory update** (:data:`MEMORY_UPDATE_TEMPLATE`): problem + previous memory + one section of
  the document -> the model writes the new memory, which overwrites the old one;
* the **final answer**: problem + memory -> answer. Training uses the boxed variant
  (:data:`MEMORY_FINAL_TEMPLATE_BOXED`, renders ``\\boxed{}``; the original sync trainer leaked a
  literal ``\\boxed{{}}`` here, docs/spec.md#bug-boxed-braces, which we do not copy). Evaluation asks for
  "Therefore, the answer is ..." (:data:`MEMORY_FINAL_TEMPLATE_ANSWER_IS`).

The templates contain the placeholders ``{prompt}``, ``{memory}`` and ``{chunk}``. Always fill them
with :func:`render_update_prompt` / :func:`render_final_prompt`: these use plain ``str.replace`` in
one pass, so questions, memories or document text containing braces (``{x}``, LaTeX, JSON, code)
never break rendering, and placeholder-like text inside a filled value is never substituted again.
Note the literal space after ``<problem>`` (kept from the original).
"""

from __future__ import annotations

import re

__all__ = [
    "FINAL_STYLES",
    "MEMORY_FINAL_TEMPLATE_ANSWER_IS",
    "MEMORY_FINAL_TEMPLATE_BOXED",
    "MEMORY_UPDATE_TEMPLATE",
    "NO_MEMORY",
    "final_template",
    "render_final_prompt",
    "render_template",
    "render_update_prompt",
]

NO_MEMORY = "No previous memory"
"""Memory text used before the first update (and for a final turn that never had an update)."""

MEMORY_UPDATE_TEMPLATE = (
    "You are presented with a problem, a section of an article that may contain the answer to the "
    "problem, and a previous memory. Please read the provided section carefully and update the memory "
    "with the new information that helps to answer the problem. Be sure to retain all relevant details "
    "from the previous memory while adding any new, useful information.\n\n"
    "<problem> \n{prompt}\n</problem>\n\n"
    "<memory>\n{memory}\n</memory>\n\n"
    "<section>\n{chunk}\n</section>\n\n"
    "Updated memory:\n"
)
"""Memory-update message; placeholders ``{prompt}``, ``{memory}``, ``{chunk}``."""

_FINAL_TAIL = "\n\n<problem> \n{prompt}\n</problem>\n\n<memory>\n{memory}\n</memory>\n\nYour answer:\n"

MEMORY_FINAL_TEMPLATE_BOXED = (
    "You are presented with a problem and a previous memory. Please answer the problem based on the "
    "previous memory and put the answer in \\boxed{}." + _FINAL_TAIL
)
"""Final-answer message used in training (and the ``recurrent-boxed`` eval method); renders ``\\boxed{}``."""

MEMORY_FINAL_TEMPLATE_ANSWER_IS = (
    "You are presented with a problem and a previous memory. Please answer the problem based on the "
    'previous memory and format your response as follows "Therefore, the answer is (insert answer here)".' + _FINAL_TAIL
)
"""Final-answer message of the ``recurrent`` eval method ("Therefore, the answer is ...")."""

FINAL_STYLES = {"boxed": MEMORY_FINAL_TEMPLATE_BOXED, "answer_is": MEMORY_FINAL_TEMPLATE_ANSWER_IS}
"""Final-prompt style name -> template."""

_PLACEHOLDER = re.compile(r"\{(prompt|memory|chunk)\}")


def render_template(template: str, **values: str) -> str:
    """Fill ``{prompt}``/``{memory}``/``{chunk}`` placeholders of ``template`` in a single pass.

    Only the named placeholders given in ``values`` are replaced; every other brace is left as is.
    Values are inserted verbatim (a value containing ``{memory}`` is not substituted again).

    Raises:
        TypeError: if a value is not a ``str`` (names the placeholder and the type).
    """
    for name, value in values.items():
        if not isinstance(value, str):
            raise TypeError(f"render_template: value for {{{name}}} must be str, got {type(value).__name__}")

    def _fill(match: re.Match[str]) -> str:
        name = match.group(1)
        return values[name] if name in values else match.group(0)

    return _PLACEHOLDER.sub(_fill, template)


def render_update_prompt(question: str, memory: str | None, chunk: str) -> str:
    """The memory-update message for ``question``, the previous ``memory`` and one document ``chunk``.

    An empty or None memory is replaced by :data:`NO_MEMORY`.
    """
    return render_template(MEMORY_UPDATE_TEMPLATE, prompt=question, memory=memory or NO_MEMORY, chunk=chunk)


def final_template(style: str = "boxed") -> str:
    """The final-answer template of ``style`` (``"boxed"`` or ``"answer_is"``).

    Raises:
        ValueError: for an unknown style (names the accepted ones).
    """
    try:
        return FINAL_STYLES[style]
    except KeyError:
        raise ValueError(f"unknown final prompt style {style!r}; expected one of {sorted(FINAL_STYLES)}") from None


def render_final_prompt(question: str, memory: str | None, style: str = "boxed") -> str:
    """The final-answer message for ``question`` and ``memory`` (None/empty -> :data:`NO_MEMORY`).

    ``style="boxed"`` asks for ``\\boxed{}`` (training), ``style="answer_is"`` for
    "Therefore, the answer is ..." (evaluation).
    """
    return render_template(final_template(style), prompt=question, memory=memory or NO_MEMORY)
