"""Async mode's training tokens reuse the engine's prompt ids instead of encoding the prompt text again.

A conversation's first prompt was encoded once for the engine (``ChatCompletionProxy.chat``); turning the finished
conversation into training tokens (``tokenize_conversation``) takes those ids when the text rendered before the
first assistant turn is exactly the text they were encoded from, and encodes otherwise.
"""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from recurrent.async_utils import ChatCompletionProxy, msg
from recurrent.chat_template import EngineTurn, load_chat_template, tokenize_conversation
from verl.workers.rollout.base import FixedWeightsEngine, GenerationOutput


class CountingTokenizer:
    """The tokenizer, with every text it encodes recorded."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.encoded: list[str] = []

    def encode(self, text, **kwargs):
        self.encoded.append(text)
        return self._tok.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)


class EchoEngine(FixedWeightsEngine):
    """Answers every prompt with the same few tokens and EOS, log-prob -0.25 each."""

    def __init__(self, tokenizer):
        self.reply = tokenizer.encode(" noted", add_special_tokens=False) + [tokenizer.eos_token_id]
        self.eos_token_ids = [tokenizer.eos_token_id]

    async def generate(self, prompt_ids, params, request_id=None):
        await asyncio.sleep(0)
        return [GenerationOutput(list(self.reply), [-0.25] * len(self.reply), "stop")]


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _turn(tok, prompt_ids, prompt_text):
    reply = tok.encode("ok", add_special_tokens=False)
    ids = reply + [tok.eos_token_id]
    return EngineTurn(
        prompt_ids, ids, [-1.0] * len(ids), "stop", "ok", len(reply), visible="ok", prompt_text=prompt_text
    )


def test_the_engines_prompt_ids_are_used_when_the_rendered_text_is_the_one_they_were_encoded_from(tok):
    tpl = load_chat_template(tok)
    question = [{"role": "user", "content": "Where is the key? " * 40}]
    prompt_text = tpl.render_text(tok, question, True)
    prompt_ids = tok.encode(prompt_text, add_special_tokens=False)
    conv = question + [{"role": "assistant", "content": "ok", "record_id": "r"}]

    counting = CountingTokenizer(tok)
    reused = tokenize_conversation(counting, tpl, conv, lookup=lambda m: _turn(tok, prompt_ids, prompt_text))
    assert prompt_text not in counting.encoded  # not encoded a second time
    encoded = tokenize_conversation(tok, tpl, conv, lookup=lambda m: _turn(tok, prompt_ids, None))
    # the same training row either way
    assert (reused.ids, reused.mask, reused.log_probs, reused.response_start) == (
        encoded.ids,
        encoded.mask,
        encoded.log_probs,
        encoded.response_start,
    )
    assert reused.ids[: reused.response_start] == prompt_ids and reused.prompt_mismatches == 0
    assert reused.text is None  # a conversation with an assistant turn is not one piece


def test_a_prompt_rendered_from_other_text_is_encoded_and_counted_as_a_mismatch(tok):
    tpl = load_chat_template(tok)
    conv = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "ok", "record_id": "r"}]
    # the engine saw a system prompt that the conversation handed back for training no longer has
    engine_messages = [{"role": "system", "content": "Be brief."}, conv[0]]
    engine_text = tpl.render_text(tok, engine_messages, True)
    engine_ids = tok.encode(engine_text, add_special_tokens=False)

    out = tokenize_conversation(tok, tpl, conv, lookup=lambda m: _turn(tok, engine_ids, engine_text))
    own_prompt = tok.encode(tpl.render_text(tok, conv[:1], True), add_special_tokens=False)
    assert out.ids[: out.response_start] == own_prompt != engine_ids
    assert out.prompt_mismatches == 1


def test_the_proxy_records_the_prompt_text_of_one_piece_prompts_only(tok):
    counting = CountingTokenizer(tok)
    proxy = ChatCompletionProxy(EchoEngine(tok), counting)
    try:
        first = [{"role": "user", "content": "Read this."}]
        choice = proxy.run(proxy.chat(first, request_id="s")).choices[0]
        record = proxy.record(msg(choice))
        assert record.prompt_text == proxy.template.render_text(tok, first, True)
        assert record.prompt_ids == tok.encode(record.prompt_text, add_special_tokens=False)
        # a prompt holding an earlier assistant turn is spliced from pieces: no text recorded
        second = first + [msg(choice), {"role": "user", "content": "And now?"}]
        later = proxy.record(msg(proxy.run(proxy.chat(second, request_id="s")).choices[0]))
        assert later.prompt_text is None
        # the whole conversation's training tokens: the engine's prompt and samples, nothing re-tokenised
        whole = proxy.tokenize(second + [msg(proxy.run(proxy.chat(second, request_id="t")).choices[0])])
        assert whole.ids[: whole.response_start] == record.prompt_ids
        assert (whole.engine_turns, whole.retokenized_turns, whole.prompt_mismatches) == (2, 0, 0)
        # the first prompt's text was encoded once, for the engine; the shipped template renders it alike for training
        assert counting.encoded.count(record.prompt_text) == 1
    finally:
        proxy.close()
