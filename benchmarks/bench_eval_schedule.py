"""Free-running vs lockstep scheduling of the batched evaluation runner, on a real engine and model.

The miniature experiment's evaluation spends its time in long chains of memory updates: a 512-chunk
document is 513 requests in a row. In lockstep (``schedule="turns"``) every turn lasts as long as
its longest memory update, up to ``--memory-tokens`` decode steps, and every item waits for it;
free-running (``schedule="items"``, the default) each item sends its next request as soon as its
previous one returns, so a chain costs the sum of its own updates. This script runs the same cells
under both schedules on one engine, side by side (alternating, ``--repeats`` times), and prints a
table. The memory text differs between the two (sampling), so compare requests/s, not accuracy.

    python benchmarks/bench_eval_schedule.py                        # SmolLM2-135M if converted, CPU sizes
    python benchmarks/bench_eval_schedule.py --device cuda --items 32 --chunks 8 64 --chunk-tokens 512 \\
        --memory-tokens 128 --max-num-batched-tokens 4096           # the miniature's sizes on a GPU

``--out`` writes the JSON report (``speedup`` = median wall time in lockstep / free-running).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc
from bench_eval_host import default_tokenizer, make_cells


def build(args: argparse.Namespace, model: str):
    from serve.inproc_server import build_engine

    engine_args = argparse.Namespace(
        engine=args.engine, model=model, dtype=args.dtype, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.device != "cuda", seed=0,
        cudagraph_max_tokens=args.max_num_batched_tokens,  # graphs for every step size (see recipe.miniature.evaluate)
    )  # fmt: skip
    return build_engine(engine_args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF model folder (default: SmolLM2-135M-Instruct if converted, else the tiny model)")
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: CUDA graphs, bfloat16")
    p.add_argument("--items", type=int, default=8, help="documents per length")
    p.add_argument("--chunks", type=int, nargs="+", default=[2, 8], help="document lengths in chunks")
    p.add_argument("--chunk-tokens", type=int, default=128)
    p.add_argument("--memory-tokens", type=int, default=48, help="max tokens of a memory update")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--repeats", type=int, default=1, help="runs per schedule (alternating)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--out", help="JSON report path")
    args = p.parse_args(argv)
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"

    from transformers import AutoTokenizer

    from taskutils.memory_eval.agents import AgentConfig
    from taskutils.memory_eval.batched import run_batched

    model = args.model or default_tokenizer()
    tok = AutoTokenizer.from_pretrained(model)
    config = AgentConfig(chunk_tokens=args.chunk_tokens, max_memory_tokens=args.memory_tokens, max_final_tokens=16,
                         temperature=args.temperature, top_p=0.95)
    t0 = time.perf_counter()
    engine = build(args, model)
    ready_s = time.perf_counter() - t0
    runs = []
    try:
        for _ in range(args.repeats):
            for schedule in ("items", "turns"):
                with tempfile.TemporaryDirectory() as tmp:
                    cells = make_cells(Path(tmp), args.items, args.chunks, args.chunk_tokens, ["recurrent-boxed"])
                    counts = run_batched(cells, engine, tok, config, schedule=schedule, force=True,
                                         log_every_s=60.0)  # fmt: skip
                runs.append({"schedule": schedule, **counts})
                print(f"  {schedule}: {counts['generate_s']:.1f} s, {counts['requests']} requests", flush=True)
    finally:
        engine.shutdown()
    wall = {s: bc.median([r["generate_s"] for r in runs if r["schedule"] == s]) for s in ("items", "turns")}
    rows = [[s, runs[0]["requests"], wall[s], runs[0]["requests"] / wall[s], wall["turns"] / wall[s]]
            for s in ("items", "turns")]
    print(f"{Path(model).name} on {args.engine}/{args.device} (engine ready in {ready_s:.0f} s): {args.items} documents "
          f"x {args.chunks} chunks of {args.chunk_tokens} tokens, memory updates of <= {args.memory_tokens} tokens at "
          f"temperature {args.temperature}; median of {args.repeats}")
    print(bc.markdown_table(["schedule", "requests", "seconds", "requests/s", "speed-up vs lockstep"], rows))
    bc.write_json(args.out, {"args": vars(args), "runs": runs, "engine_ready_s": ready_s,
                             "speedup": wall["turns"] / wall["items"], "environment": bc.environment()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
