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

``--compare graphs`` instead runs the cells free-running on two engines side by side: one capturing
CUDA graphs for steps of up to ``--max-num-batched-tokens`` tokens (the evaluation's default), one
with vLLM's default capture limit (512 tokens), beyond which a step that holds a prefill chunk runs
eagerly (GPU only; on CPU both are the same engine configuration):

    python benchmarks/bench_eval_schedule.py --compare graphs --device cuda --items 32 --chunks 8 64 \
        --chunk-tokens 512 --memory-tokens 128 --max-num-batched-tokens 4096

``--out`` writes the JSON report (``speedup`` = median wall time of the baseline, lockstep or vLLM's
default graphs, / that of the first variant).
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


def build(args: argparse.Namespace, model: str, graph_tokens: int | None):
    """An engine as the evaluation builds it; ``graph_tokens``: CUDA graphs up to this step size (None: vLLM's)."""
    from serve.inproc_server import build_engine

    engine_args = argparse.Namespace(
        engine=args.engine, model=model, dtype=args.dtype, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.device != "cuda", seed=0,
        cudagraph_max_tokens=graph_tokens,
    )  # fmt: skip
    return build_engine(engine_args)


# --compare -> (variant name, engine name, schedule) pairs, the baseline last; engine name -> graph tokens
VARIANTS = {
    "schedule": [("items", "graphs", "items"), ("turns", "graphs", "turns")],
    "graphs": [("graphs up to the step budget", "graphs", "items"), ("vLLM default graphs (512)", "vllm", "items")],
}


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
    p.add_argument(
        "--compare",
        choices=sorted(VARIANTS),
        default="schedule",
        help="schedule: free-running vs lockstep; graphs: CUDA graphs up to the step budget vs vLLM's",
    )
    p.add_argument("--out", help="JSON report path")
    args = p.parse_args(argv)
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"

    from transformers import AutoTokenizer

    from taskutils.memory_eval.agents import AgentConfig
    from taskutils.memory_eval.batched import run_batched

    model = args.model or default_tokenizer()
    tok = AutoTokenizer.from_pretrained(model)
    config = AgentConfig(
        chunk_tokens=args.chunk_tokens,
        max_memory_tokens=args.memory_tokens,
        max_final_tokens=16,
        temperature=args.temperature,
        top_p=0.95,
    )
    variants = VARIANTS[args.compare]
    graph_tokens = {"graphs": args.max_num_batched_tokens, "vllm": None}
    t0 = time.perf_counter()
    engines = {name: build(args, model, graph_tokens[name]) for name in dict.fromkeys(e for _, e, _ in variants)}
    ready_s = (time.perf_counter() - t0) / len(engines)
    runs = []
    try:
        for _ in range(args.repeats):
            for variant, engine_name, schedule in variants:
                with tempfile.TemporaryDirectory() as tmp:
                    cells = make_cells(Path(tmp), args.items, args.chunks, args.chunk_tokens, ["recurrent-boxed"])
                    counts = run_batched(cells, engines[engine_name], tok, config, schedule=schedule, force=True,
                                         log_every_s=60.0)  # fmt: skip
                runs.append(
                    {"variant": variant, "schedule": schedule, "graph_tokens": graph_tokens[engine_name], **counts}
                )
                print(f"  {variant}: {counts['generate_s']:.1f} s, {counts['requests']} requests", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    names = [v for v, _, _ in variants]
    wall = {v: bc.median([r["generate_s"] for r in runs if r["variant"] == v]) for v in names}
    rows = [[v, runs[0]["requests"], wall[v], runs[0]["requests"] / wall[v], wall[names[-1]] / wall[v]] for v in names]
    print(
        f"{Path(model).name} on {args.engine}/{args.device} (engines ready in {ready_s:.0f} s each): {args.items} "
        f"documents x {args.chunks} chunks of {args.chunk_tokens} tokens, memory updates of <= {args.memory_tokens} "
        f"tokens at temperature {args.temperature}; median of {args.repeats}"
    )
    print(bc.markdown_table(["variant", "requests", "seconds", "requests/s", f"speed-up vs {names[-1]}"], rows))
    bc.write_json(
        args.out,
        {
            "args": vars(args),
            "runs": runs,
            "engine_ready_s": ready_s,
            "speedup": wall[names[-1]] / wall[names[0]],
            "environment": bc.environment(),
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
