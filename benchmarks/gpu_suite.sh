#!/usr/bin/env bash
# Everything we measure on a multi-GPU node, in one go (results and logs land in $OUT).
#   bash benchmarks/gpu_suite.sh            (expects PYTHONPATH to hold ray/hydra/tensordict, see README)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
run() { local name=$1; shift; echo "=== $name: $*"; ( time "$@" ) >"$OUT/$name.log" 2>&1; echo "rc=$?" >>"$OUT/$name.log"; tail -25 "$OUT/$name.log"; }
# 1. update_policy MFU: FSDP2 over all GPUs (NCCL) vs a plain single-GPU transformers fwd+bwd
run update_policy_fsdp torchrun --standalone --nproc_per_node="$NGPU" benchmarks/bench_update_policy.py \
    --shape qwen2.5-1.5b --rows 8 --prompt-len 3072 --response-len 1024 --token-budget 16384 --grad-ckpt \
    --steps 3 --out "$OUT/update_policy.json"
# 2. HF rollout engine vs model.generate on the same batch (Qwen2-0.5B shape)
run hf_engine_b64 python3 benchmarks/bench_hf_engine.py --shape qwen2-0.5b --batch 64 --prompt-len 1024 --new-tokens 128 --device cuda --repeats 2
run hf_engine_b256 python3 benchmarks/bench_hf_engine.py --shape qwen2-0.5b --batch 256 --prompt-len 1024 --new-tokens 128 --device cuda --repeats 1
# 3. GPU-marked tests (NCCL through Ray worker groups; trainer on GPUs)
run gpu_tests python3 -m pytest -q -m gpu tests -p no:cacheprovider
