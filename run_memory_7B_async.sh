#!/usr/bin/env bash
# MemAgent RL training, Qwen2.5-7B-Instruct, ASYNC mode (agents as coroutines over server-mode
# rollout): the hyper-parameters of the original run_memory_7B_async.sh (docs/spec.md#hyper-parameters),
# unchanged (including the repeated algorithm.kl_ctrl.kl_coef and no rollout.top_p).
#
# Required environment:
#   DATASET_ROOT    folder with hotpotqa/hotpotqa_train_32k.parquet and hotpotqa/hotpotqa_dev.parquet
#   PROJ_ROOT       folder for checkpoints and logs (written to $PROJ_ROOT/$EXP)
#   MODEL_PATH      HF folder of the base model (original: Qwen/Qwen2.5-7B-Instruct)
# Optional environment:
#   NNODES (4), NGPUS_PER_NODE (8), EXP (memory_agent/7B_async)
#   PYTHON (python3)  interpreter command, split on spaces (e.g. PYTHON=.venv/bin/python)
#   DRY_RUN=1         print the command, one argument per line, and exit without running it
# Extra arguments are appended as Hydra overrides; later overrides win:
#   bash run_memory_7B_async.sh trainer.total_training_steps=10 trainer.logger="['console','jsonl']"
set -euo pipefail

: "${DATASET_ROOT:?set DATASET_ROOT to the folder holding hotpotqa/hotpotqa_train_32k.parquet and hotpotqa/hotpotqa_dev.parquet}"
: "${PROJ_ROOT:?set PROJ_ROOT to the folder where checkpoints and logs are written}"
: "${MODEL_PATH:?set MODEL_PATH to the HF folder of the base model (original: Qwen/Qwen2.5-7B-Instruct)}"
NNODES="${NNODES:-4}"
NGPUS_PER_NODE="${NGPUS_PER_NODE:-8}"
EXP="${EXP:-memory_agent/7B_async}"
PYTHON="${PYTHON:-python3}"

VAL_PATH="${DATASET_ROOT}/hotpotqa/hotpotqa_dev.parquet"
TRAIN_PATH="${DATASET_ROOT}/hotpotqa/hotpotqa_train_32k.parquet"
PROJ_DIR="${PROJ_ROOT}/${EXP}"

# Please note that recurrent framework will use max_length defined in task config.
# These two values are just for vLLM to decide max_model_length.
MAXLEN=8192
MAX_NEW_TOKEN=1024

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
read -r -a PYTHON_CMD <<< "${PYTHON}"

OVERRIDES=(
    actor_rollout_ref.rollout.mode=async
    actor_rollout_ref.rollout.chat_scheduler=recurrent.async_utils.ChatCompletionProxy
    recurrent.enable=memory
    recurrent.memory.config.chunk_size=5000
    algorithm.adv_estimator=grpo
    algorithm.grpo_use_adv=False
    trainer.save_freq=10
    actor_rollout_ref.rollout.n=16
    actor_rollout_ref.rollout.val_kwargs.n=4
    "trainer.logger=['console','wandb']"
    actor_rollout_ref.actor.optim.lr_warmup_steps=20
    actor_rollout_ref.actor.clip_ratio_high=0.20
    actor_rollout_ref.actor.entropy_coeff=0.000
    "data.train_files=${TRAIN_PATH}"
    "data.val_files=${VAL_PATH}"
    data.shuffle=False
    data.filter_overlong_prompts=True
    data.train_batch_size=128
    data.truncation='center'
    +data.context_key='context'
    "data.max_prompt_length=${MAXLEN}"
    "data.max_response_length=${MAX_NEW_TOKEN}"
    reward_model.reward_manager='thread'
    "actor_rollout_ref.model.path=${MODEL_PATH}"
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=8
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=1
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=True
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
    actor_rollout_ref.rollout.enforce_eager=False
    actor_rollout_ref.rollout.free_cache_engine=False
    actor_rollout_ref.actor.fsdp_config.fsdp_size=8
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.temperature=1
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0
    actor_rollout_ref.rollout.val_kwargs.top_p=0.7
    actor_rollout_ref.rollout.max_num_batched_tokens=16384
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.kl_ctrl.kl_coef=0.001
    algorithm.kl_ctrl.kl_coef=0.001
    trainer.critic_warmup=0
    trainer.project_name='verl-hongli'
    "trainer.experiment_name=${EXP}"
    trainer.val_before_train=True
    "trainer.n_gpus_per_node=${NGPUS_PER_NODE}"
    "trainer.nnodes=${NNODES}"
    trainer.test_freq=5
    trainer.default_hdfs_dir=null
    "trainer.default_local_dir=${PROJ_DIR}"
    trainer.total_epochs=30
)

CMD=("${PYTHON_CMD[@]}" -m verl.trainer.main_ppo "${OVERRIDES[@]}" "$@")
if [[ "${DRY_RUN:-0}" == "1" ]]; then
    printf '%s\n' "${CMD[@]}"
    exit 0
fi
echo "+ ${CMD[*]}" >&2
exec "${CMD[@]}"
