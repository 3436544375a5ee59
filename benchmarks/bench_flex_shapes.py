"""Packed-row log-prob calls under flex_attention over varying lengths: compile count and time, with and without
padding the packed length to whole flex blocks (``verl/workers/actor/forward.py``, ``packed_length_multiple``).

Each mode runs in its own process with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``), so compilation is
paid as on a fresh worker; every call gets rows with a new random packed length. Reported per mode: the total,
first and per-call seconds, dynamo's ``unique_graphs`` (compiled graphs of ``flex_attention``, and of
``create_block_mask`` where transformers builds the mask); the JSON report holds every mode and the time ratios.

``padded`` is the actor's behaviour (lengths padded to whole blocks, the BlockMask built by
``verl/workers/actor/packed_block_mask.py`` without a compile); ``unpadded`` is the packed length as is (the code
before the padding); ``hf_mask`` is ``padded`` with the mask left to transformers (its compiled
``create_block_mask``: the code before ``packed_block_mask``).
``--grad`` also back-propagates the summed log-probs (the update path; flex_attention has no backward on CPU).

Examples:

    # CPU, the tiny model, 12 calls of 60-1500 packed tokens
    python benchmarks/bench_flex_shapes.py --device cpu --calls 12 --json /tmp/flex_shapes.json
    # CPU, lengths that make torch specialise without the padding (one flex block after many)
    python benchmarks/bench_flex_shapes.py --device cpu --lengths 100,140,60,300,700,90,1000,513
    # one GPU, Qwen2.5-1.5B shape, forward + backward, MemAgent-like packed lengths
    python benchmarks/bench_flex_shapes.py --shape qwen2.5-1.5b --device cuda --grad --min-tokens 4000 \\
        --max-tokens 24000 --calls 8 --json /tmp/flex_shapes_gpu.json
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

MODES = ("padded", "unpadded", "hf_mask")


def make_batch(total: int, rows: int, response_length: int, vocab: int, gen: torch.Generator):
    """``rows`` left-padded prompts + right-padded responses with ``total`` valid tokens in all."""
    if total < 2 * rows:
        raise ValueError(f"a packed length of {total} tokens cannot hold {rows} rows of >= 2 tokens")
    spare = total - 2 * rows  # split at random over the rows, each of which gets 2 tokens first
    cuts = sorted(torch.randint(0, spare + 1, (rows - 1,), generator=gen).tolist())
    lengths = [2 + b - a for a, b in zip([0, *cuts], [*cuts, spare])]
    width = max(lengths) + response_length
    input_ids = torch.randint(2, vocab, (rows, width), generator=gen)
    attention_mask = torch.zeros(rows, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        response = min(response_length, max(1, n // 4))
        prompt = n - response
        attention_mask[i, width - response_length - prompt : width - response_length] = 1
        attention_mask[i, width - response_length : width - response_length + response] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def run_mode(args: argparse.Namespace) -> dict:
    """One mode in this process: ``args.calls`` log-prob calls over random packed lengths."""
    from torch._dynamo.utils import counters

    from verl.utils.model_loading import load_causal_lm
    from verl.workers.actor import forward

    if args.mode == "unpadded":
        forward.packed_length_multiple = lambda model: 1  # the packed length as is
    if args.mode == "hf_mask":
        forward.packed_attention_mask = lambda model, position_ids: None  # transformers builds the BlockMask
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    path = bc.model_folder(args.model, args.shape, dtype)
    model = load_causal_lm(path, dtype=dtype, attn_implementation="flex_attention").to(args.device)
    model.train(args.grad)
    vocab = bc.prompt_vocab_limit(path)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    if args.lengths:
        totals = [int(x) for x in args.lengths.split(",")]
    else:
        totals = torch.randint(args.min_tokens, args.max_tokens + 1, (args.calls,), generator=gen).tolist()
    times, checksums = [], []
    for total in totals:
        batch = [t.to(args.device) for t in make_batch(total, args.rows, args.response_length, vocab, gen)]
        bc.device_sync(args.device)
        t0 = time.perf_counter()
        with torch.set_grad_enabled(args.grad):
            log_probs, _ = forward.forward_response_log_probs(
                model, *batch, args.response_length, use_remove_padding=True
            )
            if args.grad:
                log_probs.sum().backward()
        bc.device_sync(args.device)
        times.append(time.perf_counter() - t0)
        checksums.append(float(log_probs.detach().double().sum()))
    model.zero_grad(set_to_none=True)
    return {
        "mode": args.mode,
        "packed_tokens": totals,
        "seconds": times,
        "total_s": sum(times),
        "log_prob_sums": checksums,
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_model_args(p)
    p.add_argument("--mode", choices=(*MODES, "all"), default="all")
    p.add_argument("--calls", type=int, default=12, help="log-prob calls, each with a new packed length")
    p.add_argument("--rows", type=int, default=4, help="rows per call")
    p.add_argument("--min-tokens", type=int, default=60, help="smallest packed length (valid tokens)")
    p.add_argument("--max-tokens", type=int, default=1500, help="largest packed length (valid tokens)")
    p.add_argument("--lengths", help="comma-separated packed lengths, one per call (instead of random ones)")
    p.add_argument("--response-length", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (1: less noise on a shared host)")
    p.add_argument("--grad", action="store_true", help="forward + backward (CUDA only: no flex backward on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    if args.grad and args.device == "cpu":
        p.error("--grad needs --device cuda: flex_attention has no backward on CPU")
    if args.mode != "all":
        result = run_mode(args)
        print(json.dumps(result))
        return result

    results = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--mode", mode]
        cmd = [c for i, c in enumerate(cmd) if not (c == "--json" or (i and cmd[i - 1] == "--json"))]
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    report = {
        "benchmark": "flex_shapes",
        "environment": bc.environment(),
        "device": bc.device_name(args.device),
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "modes": results,
        "unpadded_over_padded_time": results["unpadded"]["total_s"] / results["padded"]["total_s"],
        "hf_mask_over_padded_time": results["hf_mask"]["total_s"] / results["padded"]["total_s"],
    }
    rows = [
        [m, r["unique_graphs"], r["total_s"], r["seconds"][0], max(r["seconds"]), bc.median(r["seconds"])]
        for m, r in results.items()
    ]
    header = ["mode", "graphs compiled", "total s", "first call s", "slowest call s", "median call s"]
    print(bc.markdown_table(header, rows))
    print(f"unpadded / padded total time: {report['unpadded_over_padded_time']:.2f}x")
    print(f"hf_mask / padded total time: {report['hf_mask_over_padded_time']:.2f}x")
    bc.write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
