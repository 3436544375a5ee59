"""The actor update over data-parallel ranks with rows dealt to ranks (``verl/trainer/ppo/rank_spread.py``) against
the rows in their order, side by side in one run.

A memory-agent step's conversations in lock-step order (every trajectory's first memory turn, then the second, ...,
then the short final answers) with global mini-batch ids over contiguous runs of those rows (the multi-turn trainer's
ids before they became question groups, the single-turn trainer's still), through a real Ray worker group's
``update_actor`` (FSDP2 over ``--ranks`` ranks, gloo on CPU, NCCL on CUDA). Settings, each round in turn:

* ``contiguous``: the rows in their order, as the trainer sent them before the spread: ``chunk(ranks)`` puts each
  mini-batch on one or two ranks;
* ``spread_rows``: dealt in their order (``trainer.balance_batch=False``);
* ``spread_tokens``: dealt longest first (``trainer.balance_batch=True``, the default).

Each call is one ``update_policy`` with ``--mini-batches`` optimizer steps; every setting trains the same rows (the
weights move between calls, the work does not). Reported: seconds per call (median over ``--rounds``), the ratio to
``contiguous``, and the split's metrics (``perf/update_rank_tokens_max_over_mean``, ``perf/update_idle_rank_steps``).

    python benchmarks/bench_rank_spread.py --ranks 2 --out rank_spread_cpu.json            # CPU, 2 ranks
    python benchmarks/bench_rank_spread.py --device cuda --ranks 8 --shape qwen2.5-0.5b \\
        --trajectories 64 --chunk 5000 --memory 1024 --final-len 256 --mini-batches 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402
import torch  # noqa: E402

SETTINGS = ("contiguous", "spread_rows", "spread_tokens")


def conversations(args: argparse.Namespace, pad_id: int) -> dict[str, torch.Tensor]:
    """Lock-step order: turn 0 of every trajectory, turn 1, ..., then the final answers (shorter prompts)."""
    from verl.utils.conversation_batch import build_conversation_batch

    g = torch.Generator().manual_seed(0)
    vocab = 2000

    def ids(n: int) -> list[int]:
        return torch.randint(2, vocab, (max(int(n), 1),), generator=g).tolist()

    def around(mean: int) -> int:
        return int(mean * (0.6 + 0.8 * torch.rand((), generator=g)))

    prompts, responses = [], []
    for _ in range(args.chunks):
        for _ in range(args.trajectories):
            prompts.append(ids(args.chunk + around(args.memory) + args.question_len))
            responses.append(ids(around(args.memory)))
    for _ in range(args.trajectories):
        prompts.append(ids(around(args.memory) + args.question_len))
        responses.append(ids(around(args.final_len)))
    return build_conversation_batch(prompts, responses, pad_id)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="cpu-small", choices=sorted(bc.SHAPES))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--trajectories", type=int, default=16)
    p.add_argument("--chunks", type=int, default=3, help="memory turns per trajectory")
    p.add_argument("--chunk", type=int, default=384, help="chunk tokens in each memory turn's prompt")
    p.add_argument("--memory", type=int, default=64, help="memory tokens (mean; prompt and response)")
    p.add_argument("--final-len", type=int, default=16, help="final answer tokens (mean)")
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--mini-batches", type=int, default=4, help="optimizer steps per update call")
    p.add_argument("--token-budget", type=int, default=4096, help="actor.ppo_max_token_len_per_gpu")
    p.add_argument("--rounds", type=int, default=3, help="timed calls per setting (after one warm-up call each)")
    p.add_argument("--out", default=None, help="JSON report")
    args = p.parse_args(argv)
    if args.trajectories % args.mini_batches:
        p.error(f"--trajectories {args.trajectories} must be a multiple of --mini-batches {args.mini_batches}")

    import ray
    from hydra import compose, initialize_config_dir

    import verl.trainer.main_ppo as main_ppo
    from verl.protocol import DataProto
    from verl.single_controller.cluster import init_ray
    from verl.trainer.ppo.rank_spread import spread_metrics, spread_order
    from verl.trainer.ppo.ray_worker_group import build_ray_worker_group
    from verl.trainer.ppo.trainer_core import mini_batch_ids

    model = bc.model_folder(None, args.shape, dtype="bfloat16" if args.device == "cuda" else "float32")
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.name=hf",
        f"data.train_batch_size={args.trajectories}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.trajectories // args.mini_batches}",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.token_budget}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={2 * args.token_budget}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"trainer.device={args.device}",
        f"trainer.n_gpus_per_node={args.ranks}",
    ]
    with initialize_config_dir(config_dir=str(Path(main_ppo.__file__).parent / "config"), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    started = not ray.is_initialized()
    if started:  # a local instance sized for the ranks (a running one, e.g. the tests', is joined as it is)
        init_ray(num_cpus=args.ranks + 1, include_dashboard=False)
    wg = build_ray_worker_group(cfg, args.device)
    try:
        wg.init_model()
        data = DataProto.from_dict(tensors=conversations(args, pad_id=0))
        n = len(data)
        data.batch["mini_batch_id"] = mini_batch_ids(n, args.trajectories, args.trajectories // args.mini_batches)
        data.batch["advantages"] = torch.randn(n, 1).expand_as(data.batch["responses"]).float().contiguous()
        data = data.union(wg.compute_log_prob(data))  # old log-probs: the actor's own
        tokens = data.batch["attention_mask"].sum(dim=-1)
        orders = {
            "contiguous": torch.arange(n),
            "spread_rows": spread_order(data.batch["mini_batch_id"], tokens, args.ranks, by_tokens=False),
            "spread_tokens": spread_order(data.batch["mini_batch_id"], tokens, args.ranks, by_tokens=True),
        }
        seconds: dict[str, list[float]] = {name: [] for name in SETTINGS}
        for name in SETTINGS:  # warm-up (allocator, first calls)
            wg.update_actor(data[orders[name]])
        for _ in range(args.rounds):
            for name in SETTINGS:
                t0 = time.perf_counter()
                wg.update_actor(data[orders[name]])
                seconds[name].append(time.perf_counter() - t0)
    finally:
        wg.shutdown()  # workers and their placement group: a joined cluster gets its CPUs back
        if started:
            ray.shutdown()

    base = bc.median(seconds["contiguous"])
    results = {}
    for name in SETTINGS:
        ids, order = data.batch["mini_batch_id"], orders[name]
        results[name] = {
            "seconds": seconds[name],
            "median_s": bc.median(seconds[name]),
            "speedup_vs_contiguous": base / bc.median(seconds[name]),
            **spread_metrics(ids[order], tokens[order], args.ranks),
        }
    report = {
        "benchmark": "rank_spread",
        "args": vars(args),
        "device": bc.device_name(args.device),
        "conversations": n,
        "tokens": int(tokens.sum()),
        "results": results,
        "env": bc.environment(),
    }
    print(report_table(report))
    bc.write_json(args.out, report)
    return 0


def report_table(report: dict) -> str:
    """The report's table (also ``benchmarks/suite_tables.py``'s for ``rank_spread`` reports)."""
    a = report["args"]
    rows = [
        [
            name,
            f"{r['median_s']:.2f}",
            f"{r['speedup_vs_contiguous']:.2f}x",
            f"{r['perf/update_rank_tokens_max_over_mean']:.2f}",
            int(r["perf/update_idle_rank_steps"]),
        ]
        for name, r in report["results"].items()
    ]
    head = (
        f"update_actor over {a['ranks']} ranks ({report['device']}, {a['shape']}), {report['conversations']} "
        f"conversations, {report['tokens']} tokens, {a['mini_batches']} mini-batches, median of {a['rounds']}:\n\n"
    )
    headers = ["rows to ranks", "s / call", "vs contiguous", "tokens max/mean", "idle rank-steps"]
    return head + bc.markdown_table(headers, rows)


if __name__ == "__main__":
    sys.exit(main())
