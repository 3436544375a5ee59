#!/usr/bin/env bash
# MemAgent RL training in miniature: SmolLM2-135M-Instruct on ONE GPU (docs/results/).
# The original run_memory_7B.sh settings where they make sense at this scale (Multi-Conv GRPO without
# std normalisation, KL loss 0.001 low_var_kl, clip 0.2, sequential sampler, thread reward manager,
# the strict boxed verifier as the reward), scaled to the model: 512-token chunks, 128-token memory,
# training documents of 1-8 chunks, 16 questions x 8 trajectories per step, lr 1e-5. One deliberate
# change for a 135M model (measured, docs/results/README.md): rollouts at temperature 0.7 instead of 1
# (at 1 its memory updates are mostly noise). The model should start from the format warm-up
# (recipe/miniature/pipeline.sh: warmup_rollouts, warmup_data, sft): the untrained SmolLM2-135M almost
# never writes \boxed{}, so under the strict verifier alone nearly every GRPO group has zero reward variance.
#
# Required environment:
#   DATA_DIR     folder from `python -m recipe.miniature.make_data` (train.parquet, val.parquet)
#   MODEL_PATH   HF folder of the starting model: the warmed model ($ROOT/warmed_model), or SmolLM2-135M-Instruct
#                (`python -m verl.utils.smollm` prints it)
#   OUT_DIR      checkpoints and logs (global_step_N/, logs/metrics.jsonl, logs/ tensorboard events)
# Optional environment:
#   TRAIN_STEPS (200)   total training steps (about 1.6 passes over make_data's 2,048 training rows); STEPS is
#                       the older name of the same setting. The LR schedule is constant after warm-up.
#   TRAIN_SEED (0)      the training seed: data.seed, actor_rollout_ref.actor.seed (mini-batch shuffle) and
#                       actor_rollout_ref.rollout.seed (the sampler's seed per step). The data order is the
#                       original's sequential sampler (data.shuffle=False), the same for every seed.
#   REWARD (strict)     strict: the strict boxed verifier alone (verl.utils.reward_score routes synthetic_qa to
#                       hotpotqa.compute_score: 1.0 when the last \boxed{} holds a gold answer, else 0), the
#                       paper's training reward; demo: scripts/demo_reward.py (the strict 1.0, plus 0.5 for a right
#                       unboxed answer), the reward of the earlier runs in docs/results/runs.csv
#   MAX_WALL            stop cleanly after the first step past this many seconds, with a checkpoint (unset: no
#                       limit); the same command again resumes from the latest checkpoint (trainer.resume_mode=auto)
#   PYTHON (python3)    interpreter command, split on spaces
#   DRY_RUN=1           print the command, one argument per line, and exit
# Extra arguments are appended as Hydra overrides (later ones win), e.g. trainer.device=cpu for a smoke run.
set -euo pipefail

: "${DATA_DIR:?set DATA_DIR to the folder written by python -m recipe.miniature.make_data}"
: "${MODEL_PATH:?set MODEL_PATH to the SmolLM2-135M-Instruct HF folder (python -m verl.utils.smollm)}"
: "${OUT_DIR:?set OUT_DIR to the folder for checkpoints and logs}"
TRAIN_STEPS="${TRAIN_STEPS:-${STEPS:-200}}"
TRAIN_SEED="${TRAIN_SEED:-0}"
REWARD="${REWARD:-strict}"
MAX_WALL="${MAX_WALL:-}"
PYTHON="${PYTHON:-python3}"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
read -r -a PYTHON_CMD <<< "${PYTHON}"
[[ "$TRAIN_SEED" =~ ^[0-9]+$ ]] || { echo "TRAIN_SEED=$TRAIN_SEED: expected a non-negative integer" >&2; exit 2; }
[[ "$TRAIN_STEPS" =~ ^[1-9][0-9]*$ ]] || { echo "TRAIN_STEPS=$TRAIN_STEPS: expected a positive integer" >&2; exit 2; }
case "$REWARD" in
    strict) REWARD_OVERRIDES=("custom_reward_function.path=null") ;;
    demo) REWARD_OVERRIDES=("custom_reward_function.path=${REPO_ROOT}/scripts/demo_reward.py") ;;
    *) echo "REWARD=$REWARD: expected strict (the paper's boxed verifier) or demo (scripts/demo_reward.py)" >&2; exit 2 ;;
esac
WALL_OVERRIDES=()
[ -n "$MAX_WALL" ] && WALL_OVERRIDES=("trainer.max_wall_time_s=${MAX_WALL}")

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
    "data.seed=${TRAIN_SEED}"
    data.train_batch_size=16
    data.truncation=center
    +data.context_key=context
    # vLLM sizing only: a turn is ~950 prompt tokens (512 chunk + 128 memory + question + template)
    data.max_prompt_length=1536
    data.max_response_length=256
    "actor_rollout_ref.model.path=${MODEL_PATH}"
    # padded rows, as in the recorded runs (docs/results/README.md): then, packed rows under sdpa built a dense
    # (tokens x tokens) mask and ran out of the H200's memory at 32K tokens per micro-batch. Packed rows now get a
    # varlen/flex kernel on CUDA automatically (model.attn_implementation); not yet measured at these sizes
    actor_rollout_ref.model.use_remove_padding=False
    actor_rollout_ref.model.enable_gradient_checkpointing=False
    "actor_rollout_ref.actor.seed=${TRAIN_SEED}"
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
    "actor_rollout_ref.rollout.seed=${TRAIN_SEED}"
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
    "${REWARD_OVERRIDES[@]}"
    trainer.nnodes=1
    trainer.n_gpus_per_node=1
    "trainer.total_training_steps=${TRAIN_STEPS}"
    "${WALL_OVERRIDES[@]}"
    # a re-run continues from the latest checkpoint (written every 10 steps, at the last step, and when
    # MAX_WALL or SIGTERM stops the run); the two latest are kept
    trainer.resume_mode=auto
    trainer.save_freq=10
    trainer.max_actor_ckpt_to_keep=2
    trainer.test_freq=10
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
