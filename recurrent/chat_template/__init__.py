"""Chat templates with ``{% generation %}`` blocks and conversation tokenisation for async mode.

Shipped templates (``*.jinja`` here): ``chatml`` (plain ChatML, the tiny test model), ``qwen2.5``
(Qwen2/Qwen2.5-Instruct, with tools) and ``smollm2`` (SmolLM2-Instruct). See :mod:`.utils` for how
one is chosen and :mod:`.tokens` for how conversations become training tensors.
"""

from recurrent.chat_template.tokens import EngineTurn, TokenizedConversation, tokenize_conversation
from recurrent.chat_template.utils import (
    TEMPLATE_FILES,
    ChatTemplate,
    load_chat_template,
    set_chat_template,
    shipped_template,
)

__all__ = [
    "TEMPLATE_FILES",
    "ChatTemplate",
    "EngineTurn",
    "TokenizedConversation",
    "load_chat_template",
    "set_chat_template",
    "shipped_template",
    "tokenize_conversation",
]
