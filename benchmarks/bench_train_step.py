"""One full Multi-Conv GRPO training step, broken down by phase (rollout, reward, log-probs, update,
weight sync), through the real launch path (``verl.trainer.main_ppo`` with Hydra overrides).

    python benchmarks/bench_train_step.py --tiny                       # CPU smoke run
    python benchmarks/bench_train_step.py --model /models/SmolLM2 --device cuda --rollout vllm \
        --batch 16 --n 8 --chunk 512 --chunks 8 --steps 3

Prints a table of seconds per phase for each step and tokens/s; extra arguments after ``--`` are
passed as Hydra overrides.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="random tiny Qwen2 model")
    p.add_argument("--model", help="HF model folder (default: SmolLM2-135M converted locally)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--gpus", type=int, default=1, help="ranks (GPUs, or processes on CPU)")
    p.add_argument("--rollout", default="hf", choices=["hf", "vllm"])
    p.add_argument("--batch", type=int, default=2, help="questions per step")
    p.add_argument("--n", type=int, default=4, help="trajectories per question")
    p.add_argument("--chunk", type=int, default=64, help="chunk size in tokens")
    p.add_argument("--chunks", type=int, default=3, help="chunks per document")
    p.add_argument("--memory", type=int, default=32, help="max memory tokens")
    p.add_argument("--steps", type=int, default=2)
    args, overrides = p.parse_known_args(argv)
    overrides = [o for o in overrides if o != "--"]

    import pandas as pd
    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer

    import verl.trainer.main_ppo as main_ppo
    from taskutils.memory_data.synthetic_qa import make_needle_qa_dataset

    if args.tiny:
        from verl.utils.tiny_model import tiny_model_cached

        model = tiny_model_cached()
    elif args.model:
        model = Path(args.model)
    else:
        from verl.utils.smollm import smollm2_path

        model = smollm2_path()
    work = Path(tempfile.mkdtemp(prefix="bench_step_"))
    tok = AutoTokenizer.from_pretrained(model)
    rows = make_needle_qa_dataset(args.batch * args.steps, (args.chunks, args.chunks), args.chunk, tok,
                                  seed=0, kinds=("niah_single",), data_source="hotpotqa")
    pd.DataFrame(rows).to_parquet(work / "train.parquet")
    cfg_overrides = [
        f"data.train_files={work / 'train.parquet'}", f"data.val_files={work / 'train.parquet'}", f"data.train_batch_size={args.batch}",
        "data.truncation=center", f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.rollout.name={args.rollout}", f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.seed=0", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.prompt_length={args.chunk + args.memory + 512}",
        f"actor_rollout_ref.rollout.response_length={args.memory}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.model.use_remove_padding=True",
        "algorithm.adv_estimator=grpo", "algorithm.grpo_use_adv=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=8",
        "recurrent.enable=memory", f"recurrent.memory.config.chunk_size={args.chunk}",
        f"recurrent.memory.config.max_memorization_length={args.memory}",
        f"recurrent.memory.config.max_final_response_length={args.memory}",
        f"recurrent.memory.config.max_chunks={args.chunks}",
        f"trainer.device={args.device}", "trainer.nnodes=1", f"trainer.n_gpus_per_node={args.gpus}",
        f"trainer.total_training_steps={args.steps}", "trainer.save_freq=-1", "trainer.test_freq=-1",
        "trainer.val_before_train=False", "trainer.logger=[jsonl]", "trainer.progress_bar=False",
        f"trainer.default_local_dir={work / 'ckpt'}", "trainer.resume_mode=disable",
        *overrides,
    ]
    with initialize_config_dir(config_dir=str(Path(main_ppo.__file__).parent / "config"), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=cfg_overrides)
    history = main_ppo.run(cfg)

    phases = ["gen", "reward", "old_log_prob", "ref", "update_actor", "sync_weights", "step"]
    print(f"\nmodel={model} device={args.device} ranks={args.gpus} rollout={args.rollout} "
          f"batch={args.batch}x{args.n} chunks={args.chunks}x{args.chunk} memory={args.memory}")
    print("step " + " ".join(f"{p:>13}" for p in phases) + "   tokens   tok/s")
    for h in history:
        if h["step"] == 0:
            continue
        cells = " ".join(f"{h.get(f'timing_s/{p}', 0.0):13.3f}" for p in phases)
        tokens = h.get("perf/total_num_tokens", 0)
        print(f"{h['step']:>4} {cells} {tokens:>8} {tokens / max(h.get('timing_s/step', 1e-9), 1e-9):7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
