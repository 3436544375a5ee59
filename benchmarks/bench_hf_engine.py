"""Throughput of HFRolloutEngine versus plain ``model.generate`` on the same batch.

    python benchmarks/bench_hf_engine.py --model /path/to/checkpoint --batch 32 --prompt-len 256 --new-tokens 128
    python benchmarks/bench_hf_engine.py --shape qwen2-0.5b --device cuda --dtype bfloat16
    python benchmarks/bench_hf_engine.py --shape tiny --device cpu       # the tiny test model, CPU

Prompts are random token ids (no EOS, pad or special ids), the same for every method; decoding is
greedy (``--sample`` for temperature-1 sampling). Reported tokens are the tokens actually generated
(a row that hits EOS early counts fewer). Prints one table row per method.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import SHAPES, shape_config  # noqa: E402  (also puts the repository root on sys.path)


def build_model(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    if args.shape == "tiny":
        from verl.utils.tiny_model import tiny_model_cached

        path = tiny_model_cached(Path(tempfile.gettempdir()) / "memagent-bench")
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(shape_config(args.shape))
    return model.to(dtype)


def make_prompts(batch: int, prompt_len: int, vocab: int, avoid: set[int], vary: bool) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    prompts = []
    for i in range(batch):
        length = prompt_len if not vary else max(1, prompt_len - (i * prompt_len) // (2 * batch))
        ids = torch.randint(3, vocab, (length,), generator=gen).tolist()
        prompts.append([t if t not in avoid else 3 for t in ids])
    return prompts


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_generate(model, prompts, new_tokens, pad_id, eos_ids, device, sample, cache_implementation=None) -> int:
    """Plain HF generate on the left-padded batch; returns generated tokens (up to each row's EOS)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kwargs = dict(do_sample=sample, max_new_tokens=new_tokens, pad_token_id=pad_id)
    if sample:
        kwargs.update(temperature=1.0, top_p=1.0, top_k=0)
    if cache_implementation:
        kwargs["cache_implementation"] = cache_implementation
    with torch.inference_mode():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), **kwargs)[:, width:].cpu()
    total = 0
    for row in out.tolist():
        n = len(row)
        for j, tok in enumerate(row):
            if tok in eos_ids:
                n = j + 1
                break
        total += n
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint folder")
    src.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="random-init shape")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--vary-lengths", action="store_true", help="prompt lengths from prompt-len down to half")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--sample", action="store_true", help="temperature-1 sampling instead of greedy")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads for both methods (default: 1 on cpu, where a second OpenMP team "
        "in the engine thread thrashes small/busy boxes; unchanged on cuda)",
    )
    parser.add_argument("--static-cache", action="store_true", help="also time generate(cache_implementation='static')")
    args = parser.parse_args(argv)

    from verl.workers.rollout import SamplingParams
    from verl.workers.rollout.hf_engine import HFRolloutEngine

    num_threads = args.num_threads or (1 if args.device == "cpu" else None)
    if num_threads:
        torch.set_num_threads(num_threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    model = build_model(args, dtype).to(args.device).eval()
    engine = HFRolloutEngine(
        model,
        device=args.device,
        max_batch_size=args.batch,
        num_threads=num_threads,
        max_model_len=args.prompt_len + args.new_tokens + 1,
    )
    vocab = engine.vocab_size
    avoid = set(engine.eos_token_ids) | {engine.pad_token_id}
    prompts = make_prompts(args.batch, args.prompt_len, vocab, avoid, args.vary_lengths)
    params = SamplingParams(greedy=not args.sample, temperature=1.0, max_tokens=args.new_tokens, seed=None)
    eos = set(engine.eos_token_ids)

    def engine_run() -> int:
        outs = engine.generate_batch(prompts, params)
        return sum(len(o[0].token_ids) for o in outs)

    methods = {
        "HFRolloutEngine": engine_run,
        "model.generate": lambda: run_generate(
            model, prompts, args.new_tokens, engine.pad_token_id, eos, args.device, args.sample
        ),
    }
    if args.static_cache:
        methods["generate(static)"] = lambda: run_generate(
            model, prompts, args.new_tokens, engine.pad_token_id, eos, args.device, args.sample, "static"
        )
    results = {}
    for name, fn in methods.items():
        fn()  # warm-up (allocations, kernels)
        times, tokens = [], 0
        for _ in range(args.repeats):
            sync(args.device)
            start = time.perf_counter()
            tokens = fn()
            sync(args.device)
            times.append(time.perf_counter() - start)
        results[name] = (tokens, statistics.median(times))

    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"model={args.model or args.shape} device={device_name} dtype={dtype} batch={args.batch} "
        f"prompt_len={args.prompt_len} new_tokens={args.new_tokens} sample={args.sample} "
        f"torch={torch.__version__} threads={torch.get_num_threads()} (median of {args.repeats})"
    )
    base = results["model.generate"][0] / results["model.generate"][1]
    print(f"{'method':<18}{'tokens':>8}{'seconds':>10}{'tokens/s':>12}{'vs generate':>13}")
    for name, (tokens, seconds) in results.items():
        rate = tokens / seconds
        print(f"{name:<18}{tokens:>8}{seconds:>10.3f}{rate:>12.1f}{rate / base:>12.2f}x")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
