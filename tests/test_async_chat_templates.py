"""Async mode's chat templates: the shipped templates' text, template selection, and the token-by-token training mask
of conversations built from the engine's own tokens (moved from ``test_async_mode.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from recurrent.chat_template import (
    ChatTemplate,
    EngineTurn,
    load_chat_template,
    set_chat_template,
    shipped_template,
    tokenize_conversation,
)

SMOLLM = Path.home() / ".cache" / "memagent" / "SmolLM2-135M-Instruct-float32"
HEADER = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_template_selection_and_no_mutation(tok):
    assert load_chat_template(tok).name == "chatml"
    before = tok.chat_template
    clone = set_chat_template(tok, "qwen2.5")
    assert tok.chat_template == before and clone.chat_template != before
    assert clone.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True
    ).startswith("<|im_start|>system\nYou are Qwen")
    bare = set_chat_template(tok, "chatml")
    bare.chat_template = None
    with pytest.raises(ValueError, match="has no chat template.*actor_rollout_ref.rollout.chat_template"):
        load_chat_template(bare)
    bare.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="no \\{% generation %\\} blocks"):
        load_chat_template(bare)
    with pytest.raises(ValueError, match="unknown chat template 'llama'"):
        load_chat_template(tok, "llama")


def test_qwen_template_text(tok):
    q = shipped_template("qwen2.5")
    assert q.render_text(tok, [{"role": "user", "content": "{message}"}], True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
    )
    conv = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "<tool_call>x</tool_call>"},
        {"role": "tool", "content": "r1"},
        {"role": "tool", "content": "r2"},
        {"role": "assistant", "content": "A", "finished": False},
    ]
    text, spans = q.render(tok, conv, False)
    assert (
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response><|im_end|>"
        in text
    )
    assert [text[s:e] for s, e in spans] == ["<tool_call>x</tool_call><|im_end|>", "A"]  # unfinished: no <|im_end|>


@pytest.mark.skipif(not (SMOLLM / "tokenizer.json").exists(), reason="SmolLM2 tokenizer not in ~/.cache/memagent")
def test_smollm2_template_matches_family():
    smol = AutoTokenizer.from_pretrained(SMOLLM)
    tpl = load_chat_template(smol)
    assert tpl.name == "smollm2"
    conv = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert tpl.render_text(smol, conv, True) == smol.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=True
    )
    ids = tokenize_conversation(smol, tpl, conv[:2])
    assert smol.decode([t for t, m in zip(ids.ids, ids.mask) if m]) == "Hello!<|im_end|>"


def test_mask_token_by_token_with_engine_tokens(tok):
    """[user, assistant (engine, EOS), tool, assistant (engine, truncated)] checked against hand pieces."""
    tpl = load_chat_template(tok)
    eos = tok.eos_token_id
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    g1 = enc("\n") + enc("\n") + enc("ok") + [eos]  # non-canonical "\n\n" split: kept as sampled
    g2 = enc("the answer")  # truncated, no EOS
    p1 = enc("<|im_start|>user\nQ<|im_end|>\n" + HEADER)
    mid = enc("\n<|im_start|>tool\nR<|im_end|>\n" + HEADER)
    records = {
        "a1": EngineTurn(p1, g1, [-1.0] * len(g1), "stop", "\n\nok", len(g1) - 1, visible="\n\nok"),
        "a2": EngineTurn(p1 + g1 + mid, g2, [-2.0] * len(g2), "length", "the answer", len(g2), visible="the answer"),
    }
    conv = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "\n\nok", "record_id": "a1"},
        {"role": "tool", "content": "R"},
        {"role": "assistant", "content": "the answer", "record_id": "a2"},
    ]
    out = tokenize_conversation(tok, tpl, conv, lookup=lambda m: records.get(m.get("record_id")))
    assert out.ids == p1 + g1 + mid + g2
    assert out.mask == [0] * len(p1) + [1] * len(g1) + [0] * len(mid) + [1] * len(g2)
    assert out.response_start == len(p1)
    assert out.log_probs[len(p1) : len(p1) + len(g1)] == [-1.0] * len(g1)
    assert out.ids[-1] != eos and out.engine_turns == 2 and out.prompt_mismatches == 0 and out.retokenized_turns == 0
    # The tiny model's own template always closes assistant turns; the truncated turn still gets no <|im_end|>.
    own = tokenize_conversation(
        tok, ChatTemplate("tiny-own", tok.chat_template), conv, lookup=lambda m: records.get(m.get("record_id"))
    )
    assert (own.ids, own.mask) == (out.ids, out.mask)
    # Without records: re-tokenised; with canonical text this equals transformers' own assistant mask.
    plain = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "R"},
        {"role": "assistant", "content": "fine"},
    ]
    ours = tokenize_conversation(tok, tpl, plain)
    ref = tok.apply_chat_template(
        plain, chat_template=tpl.source, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ours.ids == ref["input_ids"][:-1]  # the trailing "\n" after the last turn is dropped
    assert ours.mask == ref["assistant_masks"][:-1] and ours.retokenized_turns == 2
