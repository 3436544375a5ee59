"""Chat templates with ``{% generation %}`` blocks: which one a tokenizer gets, and how it renders.

Async mode renders every conversation twice: once as the engine prompt (``add_generation_prompt``)
and once as training tokens with an assistant mask. Both use one :class:`ChatTemplate`, chosen by
:func:`load_chat_template`:

1. an explicit name (``chatml``, ``qwen2.5``, ``smollm2``) or a ``.jinja``/``.j2`` file path
   (``actor_rollout_ref.rollout.chat_template``);
2. otherwise the shipped template that renders *exactly like* the tokenizer's own template on a set
   of probe conversations (so the model sees the text it was tuned on);
3. otherwise the tokenizer's own template, if it already has generation blocks;
4. otherwise a ``ValueError`` that says what to configure.

The tokenizer is never modified (the original ``set_chat_template`` replaced the template of the
shared tokenizer in place, docs/spec.md#bug-template-mutation): :func:`set_chat_template` returns a shallow
copy, and :class:`ChatTemplate` passes its source explicitly on every render.
"""

from __future__ import annotations

import copy
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_HERE = Path(__file__).parent

TEMPLATE_FILES = {
    "chatml": "chatml.jinja",
    "qwen2.5": "qwen2_5.jinja",
    "smollm2": "smollm2.jinja",
}
"""Shipped templates by name (aliases in :data:`TEMPLATE_ALIASES`)."""

TEMPLATE_ALIASES = {"qwen2": "qwen2.5", "qwen2_5": "qwen2.5", "qwen": "qwen2.5", "smollm": "smollm2"}

# transformers caches one compiled template per source, and its generation-block tracker keeps its
# state on that shared object: renders with assistant indices must not overlap between threads.
_RENDER_LOCK = threading.Lock()

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

# Conversations on which a tokenizer's own template and a shipped one must render identically.
_PROBES: list[tuple[list[dict[str, str]], bool]] = [
    ([{"role": "user", "content": "Hello."}], True),
    ([{"role": "user", "content": "Hello."}], False),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], True),
    ([{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}], False),
    (
        [
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "and 2+2?"},
        ],
        True,
    ),
]


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template whose assistant turns sit in ``{% generation %}`` blocks."""

    name: str
    source: str

    def __post_init__(self) -> None:
        if not _GENERATION_TAG.search(self.source):
            raise ValueError(
                f"chat template {self.name!r} has no {{% generation %}} block; the assistant mask cannot be "
                "computed (use one of the shipped templates: " + ", ".join(sorted(TEMPLATE_FILES)) + ")"
            )

    def render(
        self,
        tokenizer: Any,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
    ) -> tuple[str, list[tuple[int, int]]]:
        """Render ``messages``; return the text and the ``(start, end)`` character span of every
        generation block, in order (one per assistant message)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        if not messages:
            raise ValueError("cannot render an empty conversation")
        special = dict(getattr(tokenizer, "special_tokens_map", {}) or {})
        with _RENDER_LOCK:
            rendered, indices = render_jinja_template(
                conversations=[messages],
                tools=tools,
                chat_template=self.source,
                return_assistant_tokens_mask=True,
                add_generation_prompt=add_generation_prompt,
                **special,
            )
        return rendered[0], [(int(s), int(e)) for s, e in indices[0]]

    def render_text(
        self,
        tokenizer: Any,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
    ) -> str:
        """Only the rendered text."""
        return self.render(tokenizer, messages, add_generation_prompt, tools)[0]


def shipped_template(name: str) -> ChatTemplate:
    """The shipped template called ``name`` (or an alias); ``ValueError`` lists the valid names."""
    key = TEMPLATE_ALIASES.get(name.lower(), name.lower())
    if key not in TEMPLATE_FILES:
        raise ValueError(
            f"unknown chat template {name!r}; shipped templates are {sorted(TEMPLATE_FILES)} "
            f"(aliases {sorted(TEMPLATE_ALIASES)}), or give a path to a .jinja/.j2 file"
        )
    return ChatTemplate(key, (_HERE / TEMPLATE_FILES[key]).read_text())


def _own_template(tokenizer: Any) -> str | None:
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):  # named templates: use the default one
        tpl = tpl.get("default")
    return tpl if isinstance(tpl, str) and tpl.strip() else None


def renders_like(tokenizer: Any, own_source: str, candidate: ChatTemplate) -> bool:
    """True when ``candidate`` renders every probe conversation exactly like ``own_source``."""
    for messages, gen in _PROBES:
        try:
            ours = candidate.render_text(tokenizer, messages, gen)
            theirs = tokenizer.apply_chat_template(
                messages, chat_template=own_source, tokenize=False, add_generation_prompt=gen
            )
        except Exception:  # noqa: BLE001 - a template that cannot render a probe does not match
            return False
        if ours != theirs:
            return False
    return True


def load_chat_template(tokenizer: Any, name: str | None = None) -> ChatTemplate:
    """Pick the generation-marked template for ``tokenizer`` (see the module docstring).

    Raises:
        ValueError: unknown name, a file without generation blocks, or a tokenizer whose template is
            missing or matches no shipped template (the message says which config key to set).
    """
    if name:
        path = Path(str(name)).expanduser()
        if str(name).endswith((".jinja", ".j2")) or path.is_file():
            if not path.is_file():
                raise ValueError(f"chat template file not found: {name}")
            return ChatTemplate(path.name, path.read_text())
        return shipped_template(str(name))
    who = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    own = _own_template(tokenizer)
    if own is None:
        raise ValueError(
            f"tokenizer {who!r} has no chat template; async mode needs one with {{% generation %}} blocks. "
            f"Set actor_rollout_ref.rollout.chat_template to one of {sorted(TEMPLATE_FILES)} or to a .jinja file"
        )
    for key in TEMPLATE_FILES:
        candidate = shipped_template(key)
        if renders_like(tokenizer, own, candidate):
            return candidate
    if _GENERATION_TAG.search(own):
        return ChatTemplate(f"{who} (own template)", own)
    raise ValueError(
        f"tokenizer {who!r}: its chat template has no {{% generation %}} blocks and renders unlike every shipped "
        f"template ({sorted(TEMPLATE_FILES)}). Set actor_rollout_ref.rollout.chat_template to a shipped name or "
        "to a .jinja file whose assistant turns are wrapped in {% generation %}...{% endgeneration %}"
    )


def set_chat_template(tokenizer: Any, name: str | None = None) -> Any:
    """Return a shallow copy of ``tokenizer`` whose ``chat_template`` is the generation-marked one.

    The given tokenizer is left untouched (datasets and reward decoding keep using it); the copy
    shares the underlying (immutable) vocabulary. ``apply_chat_template(...,
    return_assistant_tokens_mask=True, return_dict=True)`` on the copy yields assistant masks.
    """
    template = load_chat_template(tokenizer, name)
    clone = copy.copy(tokenizer)
    clone.chat_template = template.source
    return clone
