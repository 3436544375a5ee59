"""Log-prob passes with and without the fused head, side by side: seconds, tokens/s and peak memory.

Variants (``--variants``):

* ``unfused``: ``model(...).logits`` -> ``.float()`` -> ``/ temperature`` -> ``log_softmax``/``gather`` and
  entropy (``model.use_fused_kernels=False``);
* ``chunked``: the fused head of ``verl/workers/actor/fused_logprob.py`` (``impl_backend=torch``, the default):
  log-probs and entropy from the last hidden states ``--chunk-size`` tokens at a time, in forward and backward
  (several sizes: ``chunked-512``, ``chunked-2048``, ... side by side);
* ``liger``: ``impl_backend=triton``: liger-kernel's fused linear cross-entropy for the ``ref`` pass (no grad,
  no entropy); measured only where liger-kernel imports on CUDA.

Passes, as the trainer runs them through ``forward_response_log_probs``: ``ref`` (no grad, no entropy: the
reference model), ``old`` (no grad, entropy: the old-log-prob pass), ``update`` (forward + backward of a
per-token loss, entropy as a detached metric: the policy update with ``entropy_coeff=0``).

Each (variant, pass) runs in its own process, so that peak memory is that pass's alone: on CUDA
``torch.cuda.max_memory_allocated`` above what was allocated before the pass; on CPU the peak resident set
size above the one before the pass (the peak counter is reset first through ``/proc/self/clear_refs``, so
the model build does not count). Every process builds the same random-init model and batch (seeded), so
log-probs are compared to the unfused ones (max abs diff in the report). One line per (variant, pass) is
printed; ``--out`` writes the JSON report.

Examples:

    # CPU, tiny model (seconds)
    python benchmarks/bench_logprob.py --shape tiny --device cpu --rows 4 --prompt-len 64 --response-len 256
    # one GPU, Qwen2.5-1.5B shape (vocabulary 151,936), 8 rows x (1024 prompt + 1024 response) = 16K tokens,
    # 8K of them scored (about 2 minutes on one H200, model builds included)
    python benchmarks/bench_logprob.py --preset qwen2.5-1.5b-8k --device cuda --out logprob.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_common import SHAPES, device_sync, environment, median, peak_rss_mib, rss_mib, shape_config, write_json  # noqa: E402

VARIANTS = ("unfused", "chunked", "liger")
PASSES = ("ref", "old", "update")
PRESETS = {
    "qwen2.5-1.5b-8k": dict(shape="qwen2.5-1.5b", rows=8, prompt_len=1024, response_len=1024),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="shape and batch of a realistic run")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="random-init model shape")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="model dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--attn", default="sdpa", help="attention implementation (rows are full: no padding mask)")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--response-len", type=int, default=256, help="response tokens per row (the scored ones)")
    p.add_argument(
        "--chunk-size",
        type=int,
        nargs="+",
        default=[1024],
        help="fused_kernel_options.chunk_size; several values: one chunked variant each (chunked-512, ...)",
    )
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--no-grad-ckpt", action="store_true", help="gradient checkpointing off (on by default)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per pass (after one warm-up call)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    # internal: run one (variant, pass) and write its result to this file
    p.add_argument("--only", nargs=2, metavar=("VARIANT", "PASS"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.preset:
        for key, value in PRESETS[args.preset].items():
            setattr(args, key, value)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def liger_usable(device: str) -> bool:
    from verl.workers.actor.fused_logprob import liger_available

    return liger_available(torch.device(device))


def reset_peak_rss() -> str:
    """Reset this process's peak resident set size (Linux ``clear_refs``), so that the peak of the timed pass
    is not that of the model build; ``"VmHWM"`` when that worked, else ``"ru_maxrss"`` (process lifetime)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        hiwater_rss_mib()
        return "VmHWM"
    except (OSError, ValueError):
        return "ru_maxrss"


def hiwater_rss_mib() -> float:
    """Peak resident set size since the last ``reset_peak_rss`` (MiB), from /proc/self/status."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise ValueError("no VmHWM in /proc/self/status")


def make_batch(args, vocab: int):
    """``rows`` full rows (prompt + response, no padding); the response tokens are the scored ones."""
    gen = torch.Generator().manual_seed(1)
    seq = args.prompt_len + args.response_len
    input_ids = torch.randint(10, vocab, (args.rows, seq), generator=gen)
    mask = torch.ones_like(input_ids)
    position_ids = torch.arange(seq).expand(args.rows, seq).contiguous()
    weights = torch.randn(args.rows, args.response_len, generator=gen)
    return [t.to(args.device) for t in (input_ids, mask, position_ids, weights)]


def run_one(args, variant: str, pass_name: str) -> dict:
    """Build the model, time ``pass_name`` under ``variant`` and measure its peak memory (this process)."""
    from verl.utils.model_loading import build_causal_lm_from_config
    from verl.workers.actor.forward import forward_response_log_probs

    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_causal_lm_from_config(
        shape_config(args.shape),
        dtype=args.dtype,
        attn_implementation=args.attn,
        device=args.device,
        gradient_checkpointing=not args.no_grad_ckpt,
        seed=0,
    )
    model.train(pass_name == "update")
    input_ids, mask, position_ids, weights = make_batch(args, model.config.vocab_size)
    kwargs = dict(
        temperature=args.temperature,
        calculate_entropy=pass_name != "ref",
        use_fused_kernels=variant != "unfused",
        fused_chunk_size=int(variant.split("-")[1]) if variant.startswith("chunked-") else args.chunk_size[0],
        fused_backend="triton" if variant == "liger" else "torch",
    )

    def call():
        if pass_name == "update":
            model.zero_grad(set_to_none=True)
            lp, _ = forward_response_log_probs(model, input_ids, mask, position_ids, args.response_len, **kwargs)
            (-(lp * weights).sum() / lp.numel()).backward()
            return lp.detach()
        with torch.no_grad():
            return forward_response_log_probs(model, input_ids, mask, position_ids, args.response_len, **kwargs)[0]

    log_probs = call()  # warm-up
    on_cuda = args.device == "cuda"
    model.zero_grad(set_to_none=True)
    device_sync(args.device)
    if on_cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        peak_method = reset_peak_rss()
        base = rss_mib()
    times = []
    for _ in range(args.repeats):
        device_sync(args.device)
        t0 = time.perf_counter()
        log_probs = call()
        device_sync(args.device)
        times.append(time.perf_counter() - t0)
    if on_cuda:
        peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    else:
        peak = hiwater_rss_mib() if peak_method == "VmHWM" else peak_rss_mib()
        peak_gib = max(0.0, peak - base) / 1024
    scored = int(log_probs.numel())
    seconds = median(times)
    return {
        "variant": variant,
        "pass": pass_name,
        "seconds": seconds,
        "seconds_all": times,
        "scored_tokens": scored,
        "tokens": int(mask.sum()),
        "tokens_per_s": int(mask.sum()) / seconds,
        "peak_gib": peak_gib,
        "peak_method": "cuda max_memory_allocated" if on_cuda else peak_method,
        "log_probs": log_probs.float().cpu().tolist(),
    }


def run_child(args, argv: list[str], variant: str, pass_name: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--only", variant, pass_name]
        cmd += ["--result-file", str(result)]
        # CPU: a fixed mmap threshold makes freed tensors leave the resident set (glibc would otherwise keep
        # reusing its heap), so the peak RSS above the baseline is the pass's own
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"} if args.device == "cpu" else os.environ.copy()
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"{variant}/{pass_name} failed:\n{out.stderr[-3000:]}")
        return json.loads(result.read_text())


def measure(args, argv: list[str]) -> dict:
    """Every requested (variant, pass), each in a fresh process; ratios against ``unfused``."""
    variants = [v for v in args.variants if v != "liger" or liger_usable(args.device)]
    skipped = [v for v in args.variants if v not in variants]
    if len(args.chunk_size) > 1 and "chunked" in variants:  # one chunked variant per chunk size
        at = variants.index("chunked")
        variants[at : at + 1] = [f"chunked-{size}" for size in args.chunk_size]
    results, failed = [], []
    for pass_name in args.passes:
        for variant in variants:
            if variant == "liger" and pass_name != "ref":
                continue  # liger-kernel is used for the ref pass only (see fused_logprob.py)
            try:
                row = run_child(args, argv, variant, pass_name)
            except RuntimeError as error:  # e.g. a liger-kernel version with another signature: keep the others
                if variant == "unfused":
                    raise
                failed.append({"variant": variant, "pass": pass_name, "error": str(error)[-2000:]})
                print(f"{pass_name:6s} {variant:13s} FAILED: {str(error).splitlines()[-1]}", flush=True)
                continue
            results.append(row)
            print(
                f"{pass_name:6s} {variant:13s} {row['seconds']:.4f} s  {row['tokens_per_s']:,.0f} tok/s  "
                f"peak +{row['peak_gib']:.3f} GiB",
                flush=True,
            )
    base = {r["pass"]: r for r in results if r["variant"] == "unfused"}
    base_log_probs = {name: torch.tensor(r["log_probs"]) for name, r in base.items()}
    for row in results:
        log_probs = torch.tensor(row.pop("log_probs"))
        ref = base.get(row["pass"])
        if ref is None:
            continue
        row["max_abs_diff_vs_unfused"] = float((log_probs - base_log_probs[row["pass"]]).abs().max())
        row["speedup_vs_unfused"] = ref["seconds"] / row["seconds"]
        row["peak_ratio_vs_unfused"] = row["peak_gib"] / ref["peak_gib"] if ref["peak_gib"] > 0 else None
    config = {k: getattr(args, k) for k in ("shape", "device", "dtype", "attn", "rows", "prompt_len", "response_len")}
    config.update(chunk_size=args.chunk_size, temperature=args.temperature, grad_ckpt=not args.no_grad_ckpt)
    return {
        "benchmark": "logprob",
        "config": config,
        "vocab_size": int(shape_config(args.shape).vocab_size),
        "skipped_variants": skipped,
        "failed": failed,
        "results": results,
        "environment": environment(),
    }


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.only:
        variant, pass_name = args.only
        Path(args.result_file).write_text(json.dumps(run_one(args, variant, pass_name)))
        return 0
    report = measure(args, argv)
    for row in report["results"]:
        if row["variant"] != "unfused" and "speedup_vs_unfused" in row:
            ratio = row["peak_ratio_vs_unfused"]
            print(
                f"{row['pass']:6s} {row['variant']:13s} vs unfused: {row['speedup_vs_unfused']:.2f}x speed, "
                f"peak memory x{ratio:.2f}, max |dlogp| {row['max_abs_diff_vs_unfused']:.2e}"
                if ratio is not None
                else f"{row['pass']:6s} {row['variant']:13s} vs unfused: {row['speedup_vs_unfused']:.2f}x speed",
                flush=True,
            )
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
