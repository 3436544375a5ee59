"""Conversation -> token ids + assistant mask, splicing in the engine's own sampled tokens.

The rendered text is cut at the generation blocks of the template. Text between blocks (system,
user and tool turns, role headers) is tokenised piece by piece; each assistant block becomes

* the engine's sampled token ids (and log-probs) when the message came from the engine and its
  content is unchanged (an :class:`EngineTurn` found by ``lookup``), else the tokenisation of the
  content text ("re-tokenised" turn);
* followed by the template's end-of-turn text (``<|im_end|>``): the engine's own end token when it
  sampled exactly that, else the tokenised text. A message with ``finished == False``
  (length-truncated) gets no end-of-turn token when it is the last message, and a masked-out one
  (0) when the conversation continues after it.

The same function renders engine prompts (``add_generation_prompt=True``), so the prompt the
engine saw at turn k is exactly the prefix of the training sequence before assistant turn k
(checked per turn, counted in ``prompt_mismatches``). Where a re-tokenised turn is used, the
training tokens can differ from what the engine sampled (BPE allows several tokenisations of one
text); see docs/async.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from recurrent.chat_template.utils import ChatTemplate


@dataclass
class EngineTurn:
    """What the engine produced for one chat completion choice (kept by the proxy).

    ``token_ids[:content_len]`` decode to ``text``; the rest (0 or 1 token) is the end token the
    engine stopped on (EOS or a stop token id). ``stop_text`` is the matched stop string (if any);
    ``visible`` is the OpenAI ``content`` (text before the stop string). ``prompt_text``: the rendered text
    ``prompt_ids`` are the encoding of, in one piece (:attr:`TokenizedConversation.text`), when known.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    log_probs: list[float] | None
    finish_reason: str
    text: str
    content_len: int
    stop_text: str | None = None
    visible: str = ""
    prompt_text: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason == "stop"

    def matches(self, content: Any) -> bool:
        """True when ``content`` is the text this turn produced (as returned, or with its stop string)."""
        if not isinstance(content, str):
            return False
        if content == self.text:
            return True
        return self.stop_text is not None and content == self.visible + self.stop_text


@dataclass
class TokenizedConversation:
    """Token ids of a whole conversation, the assistant mask and per-token rollout log-probs.

    ``response_start`` is the index of the first assistant token of the first generated turn (so
    ``ids[:response_start]`` is the first prompt); ``log_probs`` is 0.0 where the engine gave none.
    ``text``: the rendered text when ``ids`` are its encoding in one piece (a conversation without assistant
    messages, e.g. a first prompt), else None.
    """

    ids: list[int]
    mask: list[int]
    log_probs: list[float]
    response_start: int
    engine_turns: int = 0
    retokenized_turns: int = 0
    prompt_mismatches: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    text: str | None = None


Lookup = Callable[[dict[str, Any]], EngineTurn | None]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI message shapes the templates cannot render as they are: ``content`` given as a list of
    ``{"type": "text", "text": ...}`` parts is joined; ``None`` content becomes ``""``."""
    content = message.get("content")
    if content is None:
        return {**message, "content": ""}
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"only text content parts are supported, got {part!r}")
            parts.append(part["text"])
        return {**message, "content": "".join(parts)}
    return message


def tokenize_conversation(
    tokenizer: Any,
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    lookup: Lookup | None = None,
) -> TokenizedConversation:
    """Tokenise ``messages`` (see the module docstring).

    Without a generation prompt, text after the last assistant turn of a conversation that ends
    with an assistant message is dropped (the model never saw it). Raises ``ValueError`` when the
    template does not give exactly one generation block per assistant message.
    """
    messages = [normalize_message(m) for m in messages]
    engine = [lookup(m) if lookup is not None and m.get("role") == "assistant" else None for m in messages]
    engine = [e if e is not None and e.matches(m.get("content")) else None for e, m in zip(engine, messages)]
    normalized = []
    for m, e in zip(messages, engine):
        if e is not None and m.get("finished", e.finished) != e.finished:
            m = {**m, "finished": e.finished}
        normalized.append(m)
    text, spans = template.render(tokenizer, normalized, add_generation_prompt, tools)
    assistant_idx = [i for i, m in enumerate(normalized) if m.get("role") == "assistant"]
    if len(spans) != len(assistant_idx):
        raise ValueError(
            f"chat template {template.name!r} produced {len(spans)} generation blocks for {len(assistant_idx)} "
            "assistant messages; every assistant message must be wrapped in exactly one {% generation %} block"
        )
    out = TokenizedConversation(ids=[], mask=[], log_probs=[], response_start=-1)
    generated = [i for i in assistant_idx if engine[i] is not None]
    first_response = generated[0] if generated else (assistant_idx[0] if assistant_idx else None)
    ends_with_assistant = bool(assistant_idx) and assistant_idx[-1] == len(normalized) - 1

    def add(ids: list[int], mask: int, log_probs: list[float] | None = None) -> None:
        out.ids.extend(ids)
        out.mask.extend([mask] * len(ids))
        out.log_probs.extend(log_probs if log_probs is not None else [0.0] * len(ids))

    pos = 0
    for k, (start, end) in enumerate(spans):
        i = assistant_idx[k]
        msg, turn = normalized[i], engine[i]
        if pos == 0 and turn is not None and turn.prompt_text is not None and text[:start] == turn.prompt_text:
            add(turn.prompt_ids, 0)  # the engine's prompt: this very text, encoded in one piece
        else:
            add(_encode(tokenizer, text[pos:start]), 0)
        if i == first_response:
            out.response_start = len(out.ids)
        if turn is not None:
            out.engine_turns += 1
            if turn.prompt_ids != out.ids:
                out.prompt_mismatches += 1
        block = text[start:end]
        content = msg.get("content") if isinstance(msg.get("content"), str) else None
        if content is not None and block.startswith(content):
            suffix = block[len(content) :]
        else:  # e.g. structured tool_calls: the block is not "content + end"
            content, suffix = block, ""
        if turn is not None:
            lp = turn.log_probs[: turn.content_len] if turn.log_probs is not None else None
            add(turn.token_ids[: turn.content_len], 1, lp)
        else:
            if first_response is not None and i >= first_response:
                out.retokenized_turns += 1
            add(_encode(tokenizer, content), 1)
        finished = turn.finished if turn is not None else msg.get("finished", True) is not False
        if suffix:
            suffix_ids = _encode(tokenizer, suffix)
            if not finished:
                if i != len(normalized) - 1 or add_generation_prompt:
                    add(suffix_ids, 0)  # not generated, but the conversation continues after it
            elif turn is not None and turn.token_ids[turn.content_len :] == suffix_ids:
                end_lp = turn.log_probs[turn.content_len :] if turn.log_probs is not None else None
                add(suffix_ids, 1, end_lp)
            else:
                add(suffix_ids, 1)  # end-of-turn the template closes the turn with (e.g. after a stop string)
        if turn is not None:
            out.finish_reasons.append(turn.finish_reason)
        else:
            out.finish_reasons.append("stop" if finished else "length")
        pos = end
    if add_generation_prompt or not ends_with_assistant:
        add(_encode(tokenizer, text[pos:]), 0)
    if out.response_start < 0:
        out.response_start = len(out.ids)
    if not spans:
        out.text = text
    return out
