#!/usr/bin/env bash
# MemAgent RL training in miniature: SmolLM2-135M-Instruct on ONE GPU (docs/results/).
# The original run_memory_7B.sh settings where they make sense at this scale (Multi-Conv GRPO without
# std normalisation, KL loss 0.001 low_var_kl, clip 0.2, sequential sampler, thread reward manager),
# scaled to the model: 512-token chunks, 128-token memory, training documents of 1-8 chunks,
# 16 questions x 8 trajectories per step, lr 1e-5. Two deliberate changes for a 135M model (measured,
# docs/results/README.md): rollouts at temperature 0.7 instead of 1 (at 1 its memory updates are
# mostly noise), and the reward of scripts/demo_reward.py: the strict boxed verifier's 1.0, plus 0.5
# when the gold answer appears unboxed (SmolLM2-135M almost never writes \boxed{}, so under the strict
# verifier alone every GRPO group has zero reward variance and nothing is learned).
#
# Required environment:
#   DATA_DIR     folder from `python -m recipe.miniature.make_data` (train.parquet, val.parquet)
#   MODEL_PATH   HF folder of SmolLM2-135M-Instruct (`python -m verl.utils.smollm` prints it)
#   OUT_DIR      checkpoints and logs (global_step_N/, logs/metrics.jsonl, logs/ tensorboard events)
# Optional environment:
#   STEPS (40)          total training steps (the LR schedule is constant after warm-up)
#   MAX_WALL (360)      stop cleanly after the first step past this many seconds, with a checkpoint;
#                       the same command again resumes (trainer.resume_mode=auto)
#   PYTHON (python3)    interpreter command, split on spaces
#   DRY_RUN=1           print the command, one argument per line, and exit
# Extra arguments are appended as Hydra overrides (later ones win), e.g. trainer.device=cpu for a smoke run.
set -euo pipefail

: "${DATA_DIR:?set DATA_DIR to the folder written by python -m recipe.miniature.make_data}"
: "${MODEL_PATH:?set MODEL_PATH to the SmolLM2-135M-Instruct HF folder (python -m verl.utils.smollm)}"
: "${OUT_DIR:?set OUT_DIR to the folder for checkpoints and logs}"
STEPS="${STEPS:-40}"
MAX_WALL="${MAX_WALL:-360}"
PYTHON="${PYTHON:-python3}"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
read -r -a PYTHON_CMD <<< "${PYTHON}"

OVERRIDES=(
    recurrent.enable=memory
    recurrent.memory.config.chunk_size=512
    recurrent.memory.config.max_memorization_length=128
    recurrent.memory.config.max_final_response_length=96
    recurrent.memory.config.max_chunks=8
    recurrent.memory.config.max_prompt_length=128
    algorithm.adv_estimator=grpo
    algorithm.grpo_use_adv=False
    algorithm.kl_ctrl.kl_coef=0.001
    "data.train_files=${DATA_DIR}/train.parquet"
    "data.val_files=${DATA_DIR}/val.parquet"
    data.shuffle=False
    data.train_batch_size=16
    data.truncation=center
    +data.context_key=context
    # vLLM sizing only: a turn is ~950 prompt tokens (512 chunk + 128 memory + question + template)
    data.max_prompt_length=1536
    data.max_response_length=256
    "actor_rollout_ref.model.path=${MODEL_PATH}"
    # padded rows: without flash-attn, packed rows under sdpa build a dense (tokens x tokens) mask,
    # which ran out of the H200's memory at 32K tokens per micro-batch (docs/results/README.md)
    actor_rollout_ref.model.use_remove_padding=False
    actor_rollout_ref.model.enable_gradient_checkpointing=False
    actor_rollout_ref.actor.optim.lr=1e-5
    actor_rollout_ref.actor.optim.lr_warmup_steps=2
    actor_rollout_ref.actor.clip_ratio_high=0.20
    actor_rollout_ref.actor.entropy_coeff=0.0
    actor_rollout_ref.actor.ppo_mini_batch_size=8
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.temperature=0.7
    actor_rollout_ref.rollout.top_p=1.0
    actor_rollout_ref.rollout.seed=0
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.35
    actor_rollout_ref.rollout.enforce_eager=False
    actor_rollout_ref.rollout.free_cache_engine=False
    actor_rollout_ref.rollout.max_num_batched_tokens=32768
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
    # validation samples like the evaluation (temperature 0.7, top-p 0.95)
    actor_rollout_ref.rollout.val_kwargs.temperature=0.7
    actor_rollout_ref.rollout.val_kwargs.top_p=0.95
    actor_rollout_ref.rollout.val_kwargs.n=1
    reward_model.reward_manager=thread
    "custom_reward_function.path=${REPO_ROOT}/scripts/demo_reward.py"
    trainer.nnodes=1
    trainer.n_gpus_per_node=1
    "trainer.total_training_steps=${STEPS}"
    "trainer.max_wall_time_s=${MAX_WALL}"
    trainer.resume_mode=auto
    trainer.save_freq=5
    trainer.test_freq=5
    trainer.val_before_train=True
    trainer.critic_warmup=0
    "trainer.logger=[console,jsonl,tensorboard]"
    trainer.log_val_generations=4
    trainer.project_name=memagent-miniature
    trainer.experiment_name=smollm2-135m
    "trainer.default_local_dir=${OUT_DIR}"
)

CMD=("${PYTHON_CMD[@]}" -m verl.trainer.main_ppo "${OVERRIDES[@]}" "$@")
if [[ "${DRY_RUN:-0}" == "1" ]]; then
    printf '%s\n' "${CMD[@]}"
    exit 0
fi
echo "+ ${CMD[*]}" >&2
exec "${CMD[@]}"
