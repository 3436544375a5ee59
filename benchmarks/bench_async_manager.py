"""Async manager concurrency: wall time of one batch versus the sum of the samples run one by one.

    python benchmarks/bench_async_manager.py                        # tiny model, CPU, 64 samples
    python benchmarks/bench_async_manager.py --model /path/to/Qwen2.5-0.5B-Instruct --device cuda

Runs the async memory agent (several memory-update turns + a final answer per sample) through the
real HFRolloutEngine behind a ChatCompletionProxy:

* ``async batch``: all samples at once through ``AsyncLLMGenerationManager.run_llm_loop``;
* ``one by one``: the same manager on batches of one sample, back to back (the sum of per-sample times);
* ``sync batch``: the lock-step sync manager (MemoryAgent) on the same data, for reference.

The ratio ``async batch / one by one`` is the point: far below 1 means the coroutines really run
concurrently and the engine batches their requests. Sampling is seeded; ``tokens`` counts the
generated (response-mask) tokens. On a shared CPU box keep ``--threads 1``: with several torch
threads competing for busy cores, big batches slow down far more than one-row batches and the
comparison measures the box, not the manager.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_dataset(args, tokenizer, cls, folder: Path):
    from recurrent.impls.memory import MemoryConfig

    rows = []
    for i in range(args.samples):
        facts = 4 + (i * 7) % (args.max_facts - 3)  # varied context lengths -> varied turn counts
        context = " ".join(f"Note {j}: shelf {j} of room {i} stores {j * 3 + i} blue jars." for j in range(facts))
        rows.append(
            {
                "data_source": "bench",
                "prompt": [{"role": "user", "content": f"How many jars on shelf 2 of room {i}?"}],
                "context": context,
                "reward_model": {"style": "rule", "ground_truth": ["0"]},
                "extra_info": {"index": i},
            }
        )
    path = folder / f"{cls.__name__}.parquet"
    pd.DataFrame(rows).to_parquet(path)
    cfg = MemoryConfig(
        chunk_size=args.chunk_size,
        max_chunks=args.max_chunks,
        max_memorization_length=args.mem_tokens,
        max_final_response_length=args.final_tokens,
    )
    return cfg, cls(cfg, str(path), tokenizer, {"truncation": "center", "max_prompt_length": 256})


def gen_batch(ds, seed: int):
    from verl.protocol import DataProto
    from verl.utils.dataset.rl_dataset import collate_fn

    batch = DataProto.from_single_dict(collate_fn([ds[i] for i in range(len(ds))]))
    tensor_keys, non_tensor_keys = ds.get_batch_keys()
    gen = batch.pop(batch_keys=tensor_keys, non_tensor_batch_keys=non_tensor_keys)
    gen.meta_info["sampling"] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": seed}
    return gen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF checkpoint folder (default: the tiny test model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--max-chunks", type=int, default=4)
    parser.add_argument("--max-facts", type=int, default=20)
    parser.add_argument("--mem-tokens", type=int, default=24)
    parser.add_argument("--final-tokens", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1 avoids OpenMP oversubscription on a shared CPU box)",
    )
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from recurrent.async_generation_manager import AsyncLLMGenerationManager
    from recurrent.async_utils import ChatCompletionProxy
    from recurrent.generation_manager import LLMGenerationManager
    from recurrent.impls.async_memory import AsyncMemoryAgent, AsyncMemoryDataset
    from recurrent.impls.memory import MemoryAgent, MemoryDataset
    from verl.workers.rollout.hf_engine import HFRolloutEngine

    if args.model:
        model_path = Path(args.model)
    else:
        from verl.utils.tiny_model import tiny_model_cached

        model_path = tiny_model_cached(Path(tempfile.gettempdir()) / "memagent-bench")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine = HFRolloutEngine(
        model_path,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_model_len=2048,
        seed=args.seed,
    )
    proxy = ChatCompletionProxy(engine, tokenizer)
    folder = Path(tempfile.mkdtemp(prefix="bench-async-"))
    cfg, ads = make_dataset(args, tokenizer, AsyncMemoryDataset, folder)
    _, sds = make_dataset(args, tokenizer, MemoryDataset, folder)
    manager = AsyncLLMGenerationManager(tokenizer, proxy, AsyncMemoryAgent(proxy, tokenizer, cfg))
    results = []
    try:
        manager.run_llm_loop(gen_batch(ads, args.seed)[:2])  # warm-up

        t0 = time.perf_counter()
        conv, _, index = manager.run_llm_loop(gen_batch(ads, args.seed))
        wall = time.perf_counter() - t0
        results.append(("async batch", wall, len(conv), int(conv.batch["response_mask"].sum())))

        full = gen_batch(ads, args.seed)
        total, n_conv, n_tok = 0.0, 0, 0
        for i in range(len(full)):
            t0 = time.perf_counter()
            conv_i, _, _ = manager.run_llm_loop(full[i : i + 1])
            total += time.perf_counter() - t0
            n_conv, n_tok = n_conv + len(conv_i), n_tok + int(conv_i.batch["response_mask"].sum())
        results.append(("one by one (sum)", total, n_conv, n_tok))

        sync = LLMGenerationManager(tokenizer, engine, MemoryAgent(tokenizer, cfg))
        t0 = time.perf_counter()
        conv_s, _, _ = sync.run_llm_loop(gen_batch(sds, args.seed))
        results.append(("sync batch", time.perf_counter() - t0, len(conv_s), int(conv_s.batch["response_mask"].sum())))
    finally:
        proxy.close()
        engine.shutdown()

    print(
        f"model={model_path.name} device={args.device} samples={args.samples} "
        f"turns/sample={int(torch.bincount(index).min())}..{int(torch.bincount(index).max())} "
        f"engine batches={engine.num_batches_run}"
    )
    print(f"{'mode':<18}{'seconds':>10}{'convs':>8}{'tokens':>9}{'tok/s':>10}")
    for name, secs, convs, toks in results:
        print(f"{name:<18}{secs:>10.2f}{convs:>8}{toks:>9}{toks / secs:>10.0f}")
    ratio = results[0][1] / results[1][1]
    print(f"async batch wall / sum of per-sample times = {ratio:.3f}  ({1 / ratio:.1f}x concurrency gain)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
