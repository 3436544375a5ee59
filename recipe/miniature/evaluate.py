"""Evaluate one model of the miniature experiment on the whole grid (docs/results/).

    python -m recipe.miniature.evaluate --root runs/miniature --system untrained --model MODEL_DIR
    python -m recipe.miniature.evaluate --root runs/miniature --system warmed --model runs/miniature/warmed_model
    python -m recipe.miniature.evaluate --root runs/miniature --system rl --model runs/miniature/rl_model

Systems and what they run (the evaluation harness, ``taskutils.memory_eval``):

* ``untrained``: ``untrained-memory`` (the memory workflow, method ``recurrent-boxed``: the training
  prompts, 512-token chunks, 128-token memory) and ``untrained-direct`` (the whole document in one
  prompt, middle-truncated to the model's window, method ``boxed``);
* ``warmed``: ``warmed-memory`` (the format-warmed model, ``recipe/miniature/warmup_data.py`` + SFT, in the same
  memory workflow: the baseline of the report's claims);
* ``rl``: ``rl-memory`` (the RL-trained model in the same memory workflow).

Two runners, same prompts, sampling, scoring and record files:

* ``--runner batched`` (default): the project's in-process vLLM engine (as in training) and
  :mod:`taskutils.memory_eval.batched`: every unfinished item is in flight at once, each sending its
  next request as soon as its previous one returns (``--schedule items``; ``turns`` = lockstep); the
  memory of unfinished items is saved, so ``--deadline-s`` can stop a run that the next command
  resumes mid-document (exit code 3 while items remain);
* ``--runner http``: one server (``serve.inproc_server``) and the HTTP evaluation harness, all
  seeds, labels, tasks and lengths at once (the path users take against any endpoint).

Results land in ``{root}/eval/seed{S}/{task}_{length}/{label}.jsonl`` (resumable: run again to
finish), timings in ``{root}/meta/eval_{system}.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from recipe.miniature.make_data import EVAL_LENGTHS
from serve.vllm_server import ServerSpec, VLLMServerGroup
from taskutils.memory_data.synthetic_qa import DEFAULT_KINDS
from taskutils.memory_eval.agents import AgentConfig
from taskutils.memory_eval.run import EvalPlan, ModelEntry, TaskEntry, run_plan

logger = logging.getLogger("miniature.eval")

SYSTEMS = {
    "untrained": [("untrained-memory", "recurrent-boxed"), ("untrained-direct", "boxed")],
    "warmed": [("warmed-memory", "recurrent-boxed")],
    "rl": [("rl-memory", "recurrent-boxed")],
}
"""System -> (result label, harness method) pairs."""


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _shard(text: str) -> tuple[int, int]:
    """``I/N`` -> (I, N), with 0 <= I < N."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: expected I/N, e.g. 0/4") from None
    if count < 1 or not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: expected 0 <= I < N")
    return index, count


def shard_groups(seeds: list[int], kinds: list[str], shard: tuple[int, int]) -> list[tuple[int, str]]:
    """The (seed, kind) groups of one shard: group number g (seeds outer, kinds inner) goes to shard
    g % N, so that every shard gets the same mix of lengths (each group holds one cell per length)."""
    index, count = shard
    groups = [(seed, kind) for seed in seeds for kind in kinds]
    return [group for g, group in enumerate(groups) if g % count == index]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipe.miniature.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="experiment folder (data/eval/seed*/ inside, from make_data)")
    p.add_argument("--system", required=True, choices=sorted(SYSTEMS))
    p.add_argument("--model", required=True, help="HF folder of the model to serve")
    p.add_argument("--seeds", type=_ints, default=[1, 2], help="evaluation seeds (data/eval/seed{S}/)")
    p.add_argument("--lengths", type=_ints, default=list(EVAL_LENGTHS), help="document lengths in chunks")
    p.add_argument("--kinds", type=lambda s: [k for k in s.split(",") if k], default=list(DEFAULT_KINDS))
    p.add_argument(
        "--labels", type=lambda s: [k for k in s.split(",") if k], help="only these labels of the system (default: all)"
    )
    p.add_argument(
        "--shard",
        type=_shard,
        default=(0, 1),
        metavar="I/N",
        help="only the (seed, kind) groups g with g %% N == I: N processes side by side, each with its own "
        "engine, share the grid (at this model size one engine leaves most of a GPU idle)",
    )
    g = p.add_argument_group("agent (defaults: the training settings of run_memory_smollm2.sh)")
    g.add_argument("--chunk-tokens", type=int, default=512)
    g.add_argument("--max-memory-tokens", type=int, default=128)
    g.add_argument("--max-final-tokens", type=int, default=96)
    g.add_argument("--max-input-tokens", type=int, default=7900, help="direct baseline: document tokens kept")
    g.add_argument("--temperature", type=float, default=0.7, help="the paper's evaluation sampling")
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--concurrency", type=int, default=64, help="items in flight per cell")
    p.add_argument("--runner", choices=["batched", "http"], default="batched", help="see the module docstring")
    p.add_argument("--deadline-s", type=float, help="batched: stop after this many seconds, saving state (exit 3)")
    p.add_argument(
        "--schedule",
        choices=["items", "turns"],
        default="items",
        help="batched: items = each item sends its next request when the last returns; turns = lockstep",
    )
    p.add_argument(
        "--workers", type=int, help="batched: threads that tokenize documents and prompts (default: all cores)"
    )
    s = p.add_argument_group("server / engine")
    s.add_argument("--port", type=int, default=8100)
    s.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto")
    s.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    s.add_argument("--max-model-len", type=int, default=8192, help="the model's window (SmolLM2: 8192)")
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.15)
    s.add_argument("--max-num-seqs", type=int, default=512)
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=4096,
        help="vLLM: tokens per scheduler step (its in-process default, 2048, makes the ~100K prompt "
        "tokens of 128 memory updates take 50 steps)",
    )
    s.add_argument(
        "--cudagraph-max-tokens",
        type=int,
        help="vLLM on GPU: capture CUDA graphs for steps of up to this many tokens (default: "
        "--max-num-batched-tokens; 0: vLLM's default, 512). Beyond the captured sizes a step "
        "runs eagerly (~20 ms for SmolLM2 on an H200), which every step holding a prefill did",
    )
    s.add_argument("--enforce-eager", action="store_true")
    s.add_argument(
        "--kv-cache-gib",
        type=float,
        help="vLLM on GPU: KV cache size in GiB (kv_cache_memory_bytes); skips vLLM's memory profiling, "
        "so engines started side by side (--shard) cannot disturb each other's measurement",
    )
    s.add_argument("--serve-timeout", type=float, default=900.0)
    s.add_argument("--wait-for", help="after the server is up, wait until this file exists (data still being made)")
    s.add_argument("--wait-timeout", type=float, default=1800.0, help="seconds to wait for --wait-for")
    s.add_argument("--ready-file", help="touch this file once the engine/server is up (others may then start)")
    return p


def _graph_tokens(args: argparse.Namespace) -> int | None:
    """``--cudagraph-max-tokens`` resolved: the step budget by default, None (vLLM's default) for 0."""
    return args.max_num_batched_tokens if args.cudagraph_max_tokens is None else args.cudagraph_max_tokens or None


def _labels(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (label, method) pairs of ``--system``, filtered by ``--labels``."""
    labels = [(label, method) for label, method in SYSTEMS[args.system] if not args.labels or label in args.labels]
    if not labels:
        raise SystemExit(f"--labels {args.labels}: none of {[lab for lab, _ in SYSTEMS[args.system]]}")
    return labels


def _data_root(args: argparse.Namespace, seed: int) -> Path:
    data_root = Path(args.root) / "data" / "eval" / f"seed{seed}"
    if not data_root.is_dir():
        raise SystemExit(
            f"{data_root} is missing: run python -m recipe.miniature.make_data --out {data_root.parents[1]}"
        )
    return data_root


def data_files(args: argparse.Namespace) -> dict[tuple[int, str, int], Path]:
    """The data file of every ``(seed, kind, length)`` cell of this shard; exits naming the first one missing."""
    from taskutils.memory_eval.data import EvalDataError
    from taskutils.memory_eval.run import data_file_for

    files = {}
    for seed, kind in shard_groups(args.seeds, args.kinds, args.shard):
        data_root = _data_root(args, seed)
        for length in args.lengths:
            try:
                files[seed, kind, length] = data_file_for(TaskEntry(kind, [length]), length, str(data_root))
            except EvalDataError as err:
                raise SystemExit(f"{err} (python -m recipe.miniature.make_data writes them)") from None
    return files


def preflight(args: argparse.Namespace) -> None:
    """Before any engine or server starts (a minute or more): ``--model`` is a local folder and every cell of this
    shard has its data file (``data_files``); otherwise exit naming what is missing."""
    if not Path(args.model).is_dir():
        raise SystemExit(f"--model {args.model}: not a local model folder (the miniature loads models by path)")
    data_files(args)


def _agent_config(args: argparse.Namespace) -> AgentConfig:
    """The agent settings (both runners); the direct baseline answers within the final-answer budget."""
    return AgentConfig(
        chunk_tokens=args.chunk_tokens,
        max_memory_tokens=args.max_memory_tokens,
        max_final_tokens=args.max_final_tokens,
        max_input_tokens=args.max_input_tokens,
        max_output_tokens=args.max_final_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
    )


def plans_for(args: argparse.Namespace, base_url: str, name: str) -> list[EvalPlan]:
    """One harness plan per (seed, label): every task x length cell at once."""
    root = Path(args.root)
    agent = asdict(_agent_config(args))
    groups = shard_groups(args.seeds, args.kinds, args.shard)
    plans = []
    for seed in args.seeds:
        kinds = [kind for s, kind in groups if s == seed]
        if not kinds:
            continue
        data_root = _data_root(args, seed)
        for label, method in _labels(args):
            model = ModelEntry(
                model=name,
                methods=[method],
                label=label,
                base_url=base_url,
                tokenizer=args.model,
                concurrency=args.concurrency,
                agent=agent,
            )
            tasks = [TaskEntry(kind, list(args.lengths)) for kind in kinds]
            plans.append(
                EvalPlan(
                    models=[model],
                    tasks=tasks,
                    out=str(root / "eval" / f"seed{seed}"),
                    data_root=str(data_root),
                    progress=False,
                    parallel_cells=len(tasks) * len(args.lengths),
                )
            )
    return plans


async def _run_all(plans: list[EvalPlan]) -> int:
    return sum(await asyncio.gather(*(run_plan(plan) for plan in plans)))


def batched_cells(args: argparse.Namespace, name: str) -> list:
    """Every (seed, label, kind, length) cell of the system, with its validated items."""
    from taskutils.memory_eval.batched import BatchCell
    from taskutils.memory_eval.data import load_eval_items
    from taskutils.memory_eval.runner import CellInfo

    root = Path(args.root)
    cells = []
    files = data_files(args)
    items = {key: load_eval_items(path)[0] for key, path in files.items()}  # each file read once, for every label
    for seed, kind in shard_groups(args.seeds, args.kinds, args.shard):
        for label, method in _labels(args):
            for length in args.lengths:
                info = CellInfo(kind, length, label, name, method, str(files[seed, kind, length]))
                cells.append(BatchCell(info, items[seed, kind, length], root / "eval" / f"seed{seed}"))
    return cells


def _touch(path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).touch()


def _wait_for(args: argparse.Namespace, started: float, alive=lambda: True) -> None:
    while args.wait_for and not Path(args.wait_for).exists():
        if time.time() - started > args.wait_timeout:
            raise SystemExit(f"{args.wait_for} did not appear within {args.wait_timeout:.0f} s")
        if not alive():
            raise SystemExit(f"the server exited while waiting for {args.wait_for} (see {Path(args.root) / 'logs'})")
        time.sleep(2.0)


def main_batched(args: argparse.Namespace) -> int:
    """The batched runner: one in-process engine, every unfinished item in flight at once."""
    from transformers import AutoTokenizer

    from serve.inproc_server import build_engine
    from taskutils.memory_eval.batched import run_batched

    root, started = Path(args.root), time.time()
    name = f"miniature-{args.system}"
    engine_args = argparse.Namespace(
        engine=args.engine, model=str(args.model), dtype=args.dtype, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager, seed=0,
        engine_kwargs={"kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30)} if args.kv_cache_gib else None,
        cudagraph_max_tokens=_graph_tokens(args),
    )  # fmt: skip
    engine = build_engine(engine_args)
    ready_s = time.time() - started
    logger.info("%s engine ready after %.0f s", name, ready_s)
    _touch(args.ready_file)
    _wait_for(args, started)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    deadline = started + args.deadline_s if args.deadline_s else None
    stop = threading.Event()  # SIGTERM: no new requests, memory saved, exit 3
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    t0 = time.time()
    try:
        counts = run_batched(
            batched_cells(args, name),
            engine,
            tokenizer,
            _agent_config(args),
            deadline=deadline,
            stop=stop,
            workers=args.workers,
            schedule=args.schedule,
        )
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
    eval_s = time.time() - t0
    meta = {"system": args.system, "runner": "batched", "model": str(args.model), "engine_ready_s": round(ready_s, 1),
            "eval_wall_s": round(eval_s, 1), **counts, "seeds": args.seeds, "lengths": args.lengths,
            "kinds": args.kinds, "shard": "{}/{}".format(*args.shard)}  # fmt: skip
    (root / "meta").mkdir(parents=True, exist_ok=True)
    with (root / "meta" / f"eval_{args.system}_runs.jsonl").open("a") as fh:
        fh.write(json.dumps(meta) + "\n")
    print(
        f"[miniature.eval] {args.system} (shard {meta['shard']}): {eval_s:.0f} s, {counts['finished']} finished, {counts['failed']} failed, "
        f"{counts['resumed']} resumed, {counts['remaining']} remaining after {counts['requests']} requests (at most {counts['turns']} per item)"
    )
    return 3 if counts["remaining"] else 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "openai", "httpcore"):  # one INFO line per request otherwise (GBs at 512 chunks)
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    if not shard_groups(args.seeds, args.kinds, args.shard):
        raise SystemExit(
            f"--shard {args.shard[0]}/{args.shard[1]}: no (seed, kind) group falls in it "
            f"({len(args.seeds) * len(args.kinds)} groups)"
        )
    preflight(args)
    if args.runner == "batched":
        return main_batched(args)
    root = Path(args.root)
    name = f"miniature-{args.system}"
    spec = ServerSpec(
        model_path=str(args.model), served_model_name=name, port=args.port, device=args.device,
        max_model_len=args.max_model_len, dtype=args.dtype, enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization if args.device != "cpu" else None,
        backend="inproc", extra_args=["--engine", args.engine, "--max-num-seqs", str(args.max_num_seqs),
                                       "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                                       *(["--cudagraph-max-tokens", str(graphs)] if (graphs := _graph_tokens(args)) else [])],
        env={"VLLM_USE_FLASHINFER_SAMPLER": "0"},
    )  # fmt: skip
    started = time.time()
    group = VLLMServerGroup(spec, root / "logs" / f"server_{args.system}")
    group.start()
    try:
        ready_s = group.wait_ready(args.serve_timeout)
        logger.info("%s ready after %.0f s at %s", name, ready_s, group.base_urls[0])
        _touch(args.ready_file)
        _wait_for(args, started, alive=lambda: all(proc.poll() is None for proc in group.processes))
        plans = plans_for(args, group.base_urls[0], name)
        t0 = time.time()
        failed = asyncio.run(_run_all(plans))
        eval_s = time.time() - t0
    finally:
        group.stop()
    meta = {"system": args.system, "model": str(args.model), "server_ready_s": round(ready_s, 1),
            "eval_wall_s": round(eval_s, 1), "total_wall_s": round(time.time() - started, 1), "failed_items": failed,
            "seeds": args.seeds, "lengths": args.lengths, "kinds": args.kinds,
            "settings": {k: v for k, v in vars(args).items() if k not in ("root",)}}  # fmt: skip
    (root / "meta").mkdir(parents=True, exist_ok=True)
    suffix = "" if args.shard[1] == 1 else f"_shard{args.shard[0]}"
    (root / "meta" / f"eval_{args.system}{suffix}.json").write_text(json.dumps(meta, indent=1, default=str))
    print(f"[miniature.eval] {args.system}: {eval_s:.0f} s of evaluation, {failed} failed item(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
