#!/usr/bin/env bash
# The GPU measurements behind benchmarks/RESULTS.md, one GPU or more, in one go. Each run writes its JSON report and
# its log into $OUT; at the end benchmarks/suite_tables.py prints the comparison tables of all reports in $OUT (the
# tables in RESULTS.md are made from them). Random-init Qwen2.5 shapes at MemAgent's real sizes (5,000-token chunks,
# 1,024-token memory), so nothing is downloaded.
#
#   OUT=benchmarks/results/$(date +%F) bash benchmarks/gpu_suite.sh            # everything (about an hour on one H200)
#   ONLY="update_attn train_step" bash benchmarks/gpu_suite.sh                # some sections (names below)
#   DRY_RUN=1 bash benchmarks/gpu_suite.sh                                     # print the commands, run nothing
#
# Sections (ONLY picks; default all, in this order):
#   update_attn   update_policy at the memory-agent layout, side by side: flex_attention, torch_varlen,
#                 torch_varlen + compile_layers, torch_varlen + liger, torch_varlen + checkpointing every 2nd layer,
#                 liger without checkpointing (bench_update_policy.py; MFU per pass; liger off unless named)
#   train_step    the 1.5B step by phase, synchronous vs one-step-off (bench_train_step.py --overlap both), with
#                 checkpointing on and off; one-step-off by SMs kept for the engine, prompts shared or not, and the
#                 split balanced by the trainer (rollout.balance_reserved_sms) against a fixed one
#   small_step    the 135M step: packed rows (automatic attention) vs padded sdpa (the miniature's sizes); the 135M
#                 update by setting (liger, checkpointing, token budget, compile_layers, prompts shared); the step at its fastest,
#                 with prompts shared and not; the BlockMask build at its micro-batch sizes (bench_block_mask.py)
#   vllm_step     where a vLLM decode step's time goes (wall vs GPU kernels per step; async scheduling off; the
#                 trainer's engine thread) at 135M and at the 1.5B memory turn (bench_vllm_step.py); the memory
#                 agent's turns lock-step vs free-running with answers of varied length (bench_turn_scheduling.py)
#   engine_process  generation beside training, the engine in the training process vs in its own, 135M and 1.5B;
#                 at 1.5B with SMs kept free of the training loop for the engine (bench_engine_process.py)
#   weight_sync   weight sync GB/s and sleep/wake at 1.5B and 7B (bench_weight_sync.py)
#   vs_verl       this actor vs upstream verl 0.7.1's (bench_vs_verl.py; needs VERL_WHEEL=path/to/verl-0.7.1 wheel)
#   big_step      the 7B step with optimizer offload, 2 steps (host memory bounded by the startup estimate)
#   rank_spread   the update over all GPUs (2 or more; skipped on one) with each mini-batch's rows dealt to the ranks
#                 vs the rows in their order (bench_rank_spread.py)
#   gpu_tests     the GPU-marked tests
# Needs the project installed with its GPU extras (pip install -e .[gpu]) on a machine with CUDA.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
ONLY=${ONLY:-update_attn train_step small_step vllm_step engine_process weight_sync vs_verl big_step rank_spread gpu_tests}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
want() { [[ " $ONLY " == *" $1 "* ]]; }
run() {  # run NAME CMD...: CMD's output and exit code into $OUT/NAME.log (DRY_RUN=1: print "NAME: CMD" only)
    local name=$1; shift
    if [ "${DRY_RUN:-0}" = 1 ]; then echo "$name: $*"; return 0; fi
    echo "=== $name: $*"; ( time "$@" ) >"$OUT/$name.log" 2>&1; echo "rc=$?" >>"$OUT/$name.log"; tail -15 "$OUT/$name.log"
}
[ "${DRY_RUN:-0}" = 1 ] || nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"

UPDATE="torchrun --standalone --nproc_per_node=1 benchmarks/bench_update_policy.py --shape qwen2.5-1.5b --layout memagent
  --conversations 32 --chunks 3 --chunk 5000 --memory 1024 --final-len 1024 --mini-batches 4 --token-budget 16384
  --steps 1 --no-baseline --grad-ckpt"
UPDATE_135M="torchrun --standalone --nproc_per_node=1 benchmarks/bench_update_policy.py --shape smollm2-135m
  --layout memagent --conversations 128 --chunks 8 --chunk 512 --memory 128 --final-len 128 --mini-batches 16
  --steps 2 --no-baseline --attn torch_varlen"
STEP="python3 benchmarks/bench_train_step.py --device cuda --gpus 1 --rollout vllm"
BIG_SIZES="--batch 4 --n 8 --chunk 5000 --chunks 3 --memory 1024"
BIG_OVERRIDES="actor_rollout_ref.model.use_remove_padding=True
  actor_rollout_ref.rollout.max_model_len=8192 actor_rollout_ref.rollout.enforce_eager=False"
SMALL_SIZES="--batch 16 --n 8 --chunk 512 --chunks 8 --memory 128"
SMALL_OVERRIDES="actor_rollout_ref.rollout.max_model_len=2048 actor_rollout_ref.rollout.gpu_memory_utilization=0.4"

if want update_attn; then
    # attention, compile_layers and checkpointing side by side without liger (--liger off; the trainer's default,
    # use_liger null, turns it on with CUDA); update_liger adds it to update_varlen's run
    run update_flex $UPDATE --attn flex_attention --liger off --out "$OUT/update_policy_flex.json"
    run update_varlen $UPDATE --attn torch_varlen --liger off --out "$OUT/update_policy_torch_varlen.json" \
        --profile "$OUT/update_policy_torch_varlen_profile.txt"
    # compile_layers with flex_attention is refused (inductor fails on it with GQA models: benchmarks/RESULTS.md),
    # and so is compile_layers with liger (dynamo cannot trace liger's RMSNorm: verl/utils/liger.py)
    run update_compile $UPDATE --attn torch_varlen --compile-layers --liger off \
        --out "$OUT/update_policy_varlen_compile_layers.json" \
        --profile "$OUT/update_policy_varlen_compile_layers_profile.txt"
    run update_liger $UPDATE --attn torch_varlen --liger on --out "$OUT/update_policy_varlen_liger.json"
    # selective activation checkpointing (model.gradient_checkpointing_every=2): half the layers recompute
    run update_ckpt_every2 $UPDATE --attn torch_varlen --liger off --ckpt-every 2 \
        --out "$OUT/update_policy_varlen_ckpt_every2.json"
    # the fastest measured: liger with checkpointing off (62 GiB at 1.5B; the start-up hint says when it fits)
    run update_liger_nockpt ${UPDATE/--grad-ckpt/} --attn torch_varlen --liger on \
        --out "$OUT/update_policy_varlen_liger_nockpt.json"
    # 4 questions x 8 trajectories: each question's first turns share their prompt (model.share_prompts packs it
    # once; flex_attention takes the mask), against flex unshared and torch_varlen (sharing impossible) side by side
    run update_shared ${UPDATE/--grad-ckpt/} --group 8 --attn flex_attention --liger on \
        --out "$OUT/update_policy_flex_liger_nockpt_shared.json"
    run update_unshared ${UPDATE/--grad-ckpt/} --group 8 --no-share-prompts --attn flex_attention --liger on \
        --out "$OUT/update_policy_flex_liger_nockpt_unshared.json"
    run update_varlen_group8 ${UPDATE/--grad-ckpt/} --group 8 --attn torch_varlen --liger on \
        --out "$OUT/update_policy_varlen_liger_nockpt_group8.json"
    # the same with documents of 6 chunks (16 questions, about the same tokens): a group's first turns are a smaller
    # share of the tokens (~11% against ~20%; nineteenth run: at 8% a 1.5B model ran ~5% faster unshared on
    # torch_varlen), so whether sharing on flex still pays at MemAgent's usual document lengths
    six_chunks=${UPDATE/--conversations 32 --chunks 3/--conversations 16 --chunks 6}
    for variant in "shared flex_attention" "varlen torch_varlen --no-share-prompts"; do
        set -- $variant
        run update_6chunks_$1 ${six_chunks/--grad-ckpt/} --group 8 --attn $2 ${3:-} --liger on \
            --out "$OUT/update_policy_6chunks_$1.json"
    done
fi
if want train_step; then
    run train_step_1p5b $STEP --shape qwen2.5-1.5b $BIG_SIZES --steps 3 --overlap both \
        --out "$OUT/train_step_qwen2.5-1.5b_overlap.json" -- $BIG_OVERRIDES actor_rollout_ref.rollout.gpu_memory_utilization=0.45
    # the same with checkpointing off (liger is on by default on CUDA): the update at its fastest measured setting.
    # vLLM gets 0.35 of the GPU: one-step-off keeps its KV cache during the update, which at 0.45 does not fit
    # (the start-up estimate refuses it: 145.6 GiB needed)
    run train_step_1p5b_nockpt $STEP --shape qwen2.5-1.5b $BIG_SIZES --steps 4 --overlap both \
        --out "$OUT/train_step_qwen2.5-1.5b_nockpt_overlap.json" -- $BIG_OVERRIDES \
        actor_rollout_ref.rollout.gpu_memory_utilization=0.35 actor_rollout_ref.model.enable_gradient_checkpointing=False
    # one-step-off: generation beside training ran 2.4x slower than alone; the engine thread on its own
    # high-priority CUDA stream (docs/config.md, "One-step-off training"; a 0.5 ms GIL switch interval measured no
    # change). 4 steps: the last step launches no rollout ahead, so steps 2-3 are the steady state
    run train_step_1p5b_nockpt_stream $STEP --shape qwen2.5-1.5b $BIG_SIZES --steps 4 --overlap on \
        --out "$OUT/train_step_qwen2.5-1.5b_nockpt_overlap_stream.json" -- $BIG_OVERRIDES \
        actor_rollout_ref.rollout.gpu_memory_utilization=0.35 \
        actor_rollout_ref.model.enable_gradient_checkpointing=False actor_rollout_ref.rollout.engine_stream=high_priority
    # bypass mode (algorithm.bypass_mode): the engine's log-probs as PPO's old log-probs, no recompute pass; generation
    # itself is at the GPU's floor here (bench_vllm_step: 4.5 ms a decode step, 4.3 ms of it kernels)
    run train_step_1p5b_bypass $STEP --shape qwen2.5-1.5b $BIG_SIZES --steps 3 --overlap both \
        --out "$OUT/train_step_qwen2.5-1.5b_nockpt_bypass.json" -- $BIG_OVERRIDES \
        actor_rollout_ref.rollout.gpu_memory_utilization=0.35 \
        actor_rollout_ref.model.enable_gradient_checkpointing=False algorithm.bypass_mode=True
    # the 1.5B one-step-off step, bypass mode, no checkpointing, gmu 0.35: one_step_off NAME STEPS REPORT OVERRIDE...
    one_step_off() {
        local name=$1 steps=$2 report=$3
        shift 3
        run "$name" $STEP --shape qwen2.5-1.5b $BIG_SIZES --steps "$steps" --overlap on --out "$OUT/$report" \
            -- $BIG_OVERRIDES actor_rollout_ref.rollout.gpu_memory_utilization=0.35 \
            actor_rollout_ref.model.enable_gradient_checkpointing=False algorithm.bypass_mode=True "$@"
    }
    # 32 of the GPU's SMs kept free of the training passes for the engine thread (rollout.engine_reserved_sms; the
    # split measured by the engine_process section's engine_sms_1p5b), then none kept, side by side (twelfth run:
    # 37.1-38.4 s vs 39.8 s)
    for sms in 32 0; do
        one_step_off train_step_1p5b_bypass_sms$sms 4 train_step_qwen2.5-1.5b_nockpt_bypass_sms$sms.json \
            actor_rollout_ref.rollout.engine_reserved_sms=$sms
    done
    # rows sharing a prompt packed with it once (model.share_prompts, the default, where null attention picks
    # flex_attention), against the same step unshared on flex_attention and on torch_varlen, side by side (thirteenth
    # run: 34.1 / 36.2 s vs 37.6-38.5 s; the update alone 15.8 s vs 19.1 s and 17.4 s)
    for variant in "shared flex_attention True" "unshared_flex flex_attention False" "unshared_varlen torch_varlen False"; do
        set -- $variant
        one_step_off train_step_1p5b_$1 4 train_step_qwen2.5-1.5b_bypass_sms32_$1.json \
            actor_rollout_ref.rollout.engine_reserved_sms=32 actor_rollout_ref.model.attn_implementation=$2 \
            actor_rollout_ref.model.share_prompts=$3
    done
    # the split moved by the trainer each step (rollout.balance_reserved_sms) from 16 and from 48, against 24 fixed,
    # 6 steps each (fourteenth run, fixed: 16 -> the training waited 4.7-5.9 s for the rollout, 32/48 -> the rollout
    # finished first; steps 34.9-42.7 s; seventeenth run: fixed 24 held 33.3-33.9 s, balanced from 16 settled at 32
    # with 32.8-33.6 s there)
    for variant in "balanced_from16 16 True" "balanced_from48 48 True" "fixed24 24 False"; do
        set -- $variant
        one_step_off train_step_1p5b_$1 6 train_step_qwen2.5-1.5b_bypass_shared_$1.json \
            actor_rollout_ref.rollout.engine_reserved_sms=$2 actor_rollout_ref.rollout.balance_reserved_sms=$3 \
            actor_rollout_ref.model.attn_implementation=flex_attention
    done
    # the balanced split with an fp8 KV cache for the engine (rollout.engine_kwargs.kv_cache_dtype=fp8: a decode step
    # reads half the ~6 GB of KV cache; a quality trade-off, so opt-in only), from 24 SMs, 6 steps (seventeenth run,
    # from 16: a decode step 1.04x faster, the step's median unchanged)
    one_step_off train_step_1p5b_balanced_fp8kv 6 train_step_qwen2.5-1.5b_bypass_shared_balanced_fp8kv.json \
        actor_rollout_ref.rollout.engine_reserved_sms=24 actor_rollout_ref.rollout.balance_reserved_sms=True \
        actor_rollout_ref.model.attn_implementation=flex_attention +actor_rollout_ref.rollout.engine_kwargs.kv_cache_dtype=fp8
fi
if want small_step; then
    run train_step_135m_packed $STEP --shape smollm2-135m $SMALL_SIZES --steps 3 --out "$OUT/train_step_135m_packed.json" \
        -- $SMALL_OVERRIDES actor_rollout_ref.model.use_remove_padding=True
    run train_step_135m_sdpa $STEP --shape smollm2-135m $SMALL_SIZES --steps 3 --out "$OUT/train_step_135m_padded_sdpa.json" \
        -- $SMALL_OVERRIDES actor_rollout_ref.model.attn_implementation=sdpa actor_rollout_ref.model.use_remove_padding=False
    # where the 135M update's time goes: liger off/on, checkpointing, micro-batch token budget, compile_layers
    run update_135m_base $UPDATE_135M --grad-ckpt --liger off --token-budget 16384 --out "$OUT/update_135m_base.json"
    run update_135m_liger $UPDATE_135M --liger on --token-budget 16384 --out "$OUT/update_135m_liger_nockpt.json"
    run update_135m_liger_64k $UPDATE_135M --liger on --token-budget 65536 --log-prob-token-budget 131072 \
        --out "$OUT/update_135m_liger_nockpt_64k.json" --profile "$OUT/update_135m_liger_nockpt_64k_profile.txt"
    run update_135m_compile_64k $UPDATE_135M --liger off --compile-layers --token-budget 65536 \
        --log-prob-token-budget 131072 --out "$OUT/update_135m_compile_nockpt_64k.json"
    # the 135M step with what the small update needs: no checkpointing, larger micro-batches, one-step-off
    FAST_135M="$SMALL_OVERRIDES actor_rollout_ref.model.use_remove_padding=True
      actor_rollout_ref.model.enable_gradient_checkpointing=False actor_rollout_ref.actor.ppo_max_token_len_per_gpu=65536
      actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=131072 actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=131072"
    run train_step_135m_fast $STEP --shape smollm2-135m $SMALL_SIZES --steps 3 --overlap both \
        --out "$OUT/train_step_135m_fast.json" -- $FAST_135M
    # generation is half of that step: what asking vLLM for log-probs costs per decode step, and the synchronous
    # step without them (rollout.calculate_log_probs=False)
    run rollout_135m_logprobs python3 benchmarks/bench_rollout.py --shape smollm2-135m --device cuda --batch 128 256 \
        --prompt-len 640 --new-tokens 128 --methods vllm_engine vllm_engine_logprobs --out "$OUT/rollout_135m_logprobs.json"
    run train_step_135m_fast_nolp $STEP --shape smollm2-135m $SMALL_SIZES --steps 3 \
        --out "$OUT/train_step_135m_fast_no_rollout_logprobs.json" -- $FAST_135M actor_rollout_ref.rollout.calculate_log_probs=False
    # one-step-off with the engine on its own high-priority stream (at 1.5B: 43-44 s vs 45-46 s without it), 4 steps
    # (the last launches no rollout ahead): generation and the training passes each take ~9 s alone here
    run train_step_135m_fast_overlap_stream $STEP --shape smollm2-135m $SMALL_SIZES --steps 4 --overlap on \
        --out "$OUT/train_step_135m_fast_overlap_stream.json" -- $FAST_135M actor_rollout_ref.rollout.engine_stream=high_priority
    # bypass mode (algorithm.bypass_mode: no old-log-prob pass), synchronous and one-step-off side by side
    run train_step_135m_fast_bypass $STEP --shape smollm2-135m $SMALL_SIZES --steps 4 --overlap both \
        --out "$OUT/train_step_135m_fast_bypass.json" -- $FAST_135M algorithm.bypass_mode=True
    # the same one-step-off with a 0.5 ms GIL switch interval (generation and the update share one process's GIL;
    # the update is what slows beside generation at this size), side by side with the synchronous step
    run train_step_135m_fast_bypass_gil $STEP --shape smollm2-135m $SMALL_SIZES --steps 4 --overlap both \
        --out "$OUT/train_step_135m_fast_bypass_gil05.json" -- $FAST_135M algorithm.bypass_mode=True \
        actor_rollout_ref.rollout.gil_switch_interval_ms=0.5
    # the engine in a child process of the worker (rollout.engine_process=child): one-step-off without the shared GIL,
    # side by side with the synchronous step; graphs up to the step budget as in the tenth run
    run train_step_135m_child $STEP --shape smollm2-135m $SMALL_SIZES --steps 4 --overlap both \
        --out "$OUT/train_step_135m_child.json" -- $FAST_135M algorithm.bypass_mode=True \
        actor_rollout_ref.rollout.cudagraph_max_tokens=8192 actor_rollout_ref.rollout.engine_process=child
    # the BlockMask each packed micro-batch needs at the 135M budgets (update 65,536, log-probs 131,072 tokens), shared
    # prompts vs plain packing vs torch's element-wise create_block_mask; then that step with prompts shared on
    # flex_attention (named: the automatic choice at 135M is torch_varlen, sharing inert) beside the one above
    run block_mask_135m python3 benchmarks/bench_block_mask.py --device cuda --tokens 16384 65536 131072 \
        --reference-max 65536 --json "$OUT/block_mask_135m.json"
    run train_step_135m_child_shared_flex $STEP --shape smollm2-135m $SMALL_SIZES --steps 5 --overlap on \
        --out "$OUT/train_step_135m_child_shared_flex.json" -- $FAST_135M algorithm.bypass_mode=True \
        actor_rollout_ref.rollout.cudagraph_max_tokens=8192 actor_rollout_ref.rollout.engine_process=child \
        actor_rollout_ref.model.attn_implementation=flex_attention
    # issue 16's figure: the automatic attention (torch_varlen at 135M), one-step-off, 5 steps; compare with
    # train_step_135m_sdpa above, same card. (Keeping SMs for the engine, rollout.engine_reserved_sms, does not apply
    # here: with engine_process=child the engine's kernels come from another process, which takes turns with the
    # training process on the GPU instead of sharing its SMs; the trainer says so and ignores the key.)
    run train_step_135m_child_auto $STEP --shape smollm2-135m $SMALL_SIZES --steps 5 --overlap on \
        --out "$OUT/train_step_135m_child_auto.json" -- $FAST_135M algorithm.bypass_mode=True \
        actor_rollout_ref.rollout.cudagraph_max_tokens=8192 actor_rollout_ref.rollout.engine_process=child
    # the 135M passes alone with GRPO groups of 8 (the step's layout): prompts shared on flex_attention vs unshared on
    # torch_varlen and on flex_attention, side by side. (The eighteenth and nineteenth runs' "flex log-prob pass 3x
    # slower" was a compile timed: with one warm-up call, flex's dynamic-shape graph compiled in the timed call;
    # bench_update_policy.py now warms up twice and reports compiled_graphs_timed.)
    for variant in "shared_flex flex_attention" "unshared_varlen torch_varlen --no-share-prompts" \
        "unshared_flex flex_attention --no-share-prompts"; do
        set -- $variant
        run update_135m_group8_$1 ${UPDATE_135M/--attn torch_varlen/--attn $2} --liger on --token-budget 65536 --log-prob-token-budget 131072 \
            --group 8 ${3:-} --out "$OUT/update_135m_group8_$1.json"
    done
    # where the time goes: one log-prob and one update call on ~131K tokens (160 rows), profiled, flex vs varlen
    for attn in flex_attention torch_varlen; do
        run update_135m_group8_profile_$attn ${UPDATE_135M/--attn torch_varlen/--attn $attn} --liger on \
            --token-budget 65536 --log-prob-token-budget 131072 --group 8 --no-share-prompts --steps 1 \
            --profile "$OUT/profile_135m_$attn.txt" --profile-rows 160 --out "$OUT/update_135m_group8_profile_$attn.json"
    done
    # (and Qwen2.5-1.5B at the same layout: whether the short sequences, not the model's size, make flex slow)
    for variant in "0p5b qwen2.5-0.5b shared_flex flex_attention" "0p5b qwen2.5-0.5b unshared_varlen torch_varlen" \
        "1p5b_small qwen2.5-1.5b shared_flex flex_attention" "1p5b_small qwen2.5-1.5b unshared_varlen torch_varlen"; do
        set -- $variant
        bigger=${UPDATE_135M/smollm2-135m/$2 --grad-ckpt}
        run update_$1_group8_$3 ${bigger/--attn torch_varlen/--attn $4} --liger on --token-budget 65536 \
            --log-prob-token-budget 131072 --group 8 $([ $4 = torch_varlen ] && echo --no-share-prompts) \
            --out "$OUT/update_$1_group8_$3.json"
    done
    # the update with layers kept gathered from forward to backward (fsdp_config.reshard_after_forward=False)
    run update_135m_keep_gathered $UPDATE_135M --liger on --token-budget 65536 --log-prob-token-budget 131072 \
        --no-reshard-after-forward --out "$OUT/update_135m_liger_nockpt_64k_keep_gathered.json"
fi
if want vllm_step; then
    # host-bound at 135M: one call is 0.6-0.9 s and separate processes differ by up to ~20%, so the settings run in
    # turn, twice (--rounds 2, each its median); the engine-thread settings tell the thread, prefix caching and the
    # engine's construction apart
    run vllm_step_135m python3 benchmarks/bench_vllm_step.py --shape smollm2-135m --device cuda --batch 128 256 \
        --prompt-len 512 --new-tokens 128 --repeats 3 --rounds 2 --settings default no_async_scheduling engine_thread \
        engine_thread_no_prefix_cache trainer_engine_bare_loop --out "$OUT/vllm_step_135m.json"
    # one step with the training rollout's requests (seeded, temperature 1, log-probs; then sleep mode with a
    # sleep/wake per call, as between training rollouts, and sleep mode never slept, as in one-step-off) at the
    # miniature's turn size
    run vllm_step_135m_training python3 benchmarks/bench_vllm_step.py --shape smollm2-135m --device cuda --batch 128 \
        --prompt-len 704 --new-tokens 128 --repeats 3 --rounds 2 --settings default engine_thread \
        engine_thread_training_sampling engine_thread_training engine_thread_training_awake \
        --out "$OUT/vllm_step_135m_training.json"
    # the 1.5B memory turn; with the training requests, and with an fp8 KV cache (a decode step there reads ~6 GB
    # of KV cache and ~3 GB of weights)
    run vllm_step_1p5b python3 benchmarks/bench_vllm_step.py --shape qwen2.5-1.5b --device cuda --batch 32 \
        --prompt-len 6000 --new-tokens 1024 --repeats 1 --settings default engine_thread \
        engine_thread_training_sampling engine_thread_training_fp8_kv --out "$OUT/vllm_step_1p5b.json"
    # the memory agent's turns with answers of varied length (each stops on one of the model's 64 most frequent ids):
    # lock step vs free-running (in-process, and one call per request as rollout.async_free_running_calls gives a
    # Ray rank) vs batched calls, at the miniature's sizes with its 1,024-token limit (the shape has the tiny
    # tokenizer: sampled ids beyond its 2,048 decode to nothing in the async agents' text, so their prompts are
    # shorter than lock step's; compare the engine steps)
    run turn_scheduling_135m python3 benchmarks/bench_turn_scheduling.py --shape smollm2-135m --device cuda \
        --batch 128 --chunk 512 --chunks 8 --memory 1024 --stop-ids 64 --repeats 2 --out "$OUT/turn_scheduling_135m.json"
fi
if want engine_process; then
    # generation beside training with the engine in the training process (a thread) and in its own process
    # (rollout.engine_process=child): each side's slowdown, at 135M (host-bound) and 1.5B (GPU-bound)
    run engine_process_135m python3 benchmarks/bench_engine_process.py --shape smollm2-135m --device cuda --batch 128 \
        --prompt-len 704 --new-tokens 128 --train-rows 8 --train-len 4096 --train-iters 20 \
        --out "$OUT/engine_process_135m.json"
    run engine_process_1p5b python3 benchmarks/bench_engine_process.py --shape qwen2.5-1.5b --device cuda --batch 32 \
        --prompt-len 6000 --new-tokens 1024 --train-rows 1 --train-len 8192 --train-iters 10 --repeats 1 \
        --out "$OUT/engine_process_1p5b.json"
    # the 1.5B memory turn beside the 1.5B training loop in one process (the engine on its high-priority stream, as
    # with one-step-off), with 0-64 of the GPU's SMs kept free of the training loop for the engine
    # (rollout.engine_reserved_sms: the training kernels in a CUDA green context of the other SMs)
    run engine_sms_1p5b python3 benchmarks/bench_engine_process.py --shape qwen2.5-1.5b --device cuda --batch 32 \
        --prompt-len 6000 --new-tokens 256 --train-rows 1 --train-len 8192 --train-iters 12 --repeats 1 \
        --placements worker --engine-stream high_priority --engine-reserved-sms 0 16 32 48 64 \
        --gpu-memory-utilization 0.35 --out "$OUT/engine_sms_1p5b.json"
fi
if want weight_sync; then
    run weight_sync_1p5b python3 benchmarks/bench_weight_sync.py --shape qwen2.5-1.5b --device cuda --rollout vllm \
        --out "$OUT/weight_sync_qwen2.5-1.5b.json"
    run weight_sync_7b python3 benchmarks/bench_weight_sync.py --shape qwen2.5-7b --device cuda --rollout vllm \
        --out "$OUT/weight_sync_qwen2.5-7b.json"
fi
if want vs_verl; then
    if [ -n "${VERL_WHEEL:-}" ]; then
        run vs_verl python3 benchmarks/bench_vs_verl.py --shape qwen2.5-1.5b --device cuda --attn flex_attention \
            --upstream-wheel "$VERL_WHEEL" --out "$OUT/vs_verl_qwen2.5-1.5b.json"
        # each side at its best without flash-attn: ours packed through torch_varlen (its default there), upstream
        # padded sdpa with its fused head (its packed rows need flash-attn; through flex they ran 3.5x slower)
        run vs_verl_best python3 benchmarks/bench_vs_verl.py --shape qwen2.5-1.5b --device cuda \
            --ours-attn torch_varlen --upstream-attn sdpa --upstream-no-remove-padding --upstream-fused-kernels \
            --upstream-wheel "$VERL_WHEEL" --out "$OUT/vs_verl_qwen2.5-1.5b_best_each.json"
    else
        echo "=== vs_verl skipped: set VERL_WHEEL to a verl-0.7.1 wheel (pip download verl==0.7.1 --no-deps)"
    fi
fi
if want big_step; then
    run train_step_7b $STEP --shape qwen2.5-7b $BIG_SIZES --steps 2 --out "$OUT/train_step_qwen2.5-7b_optim_offload.json" \
        -- $BIG_OVERRIDES actor_rollout_ref.rollout.gpu_memory_utilization=0.5 actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
fi
if want rank_spread; then
    GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
    if [ "${DRY_RUN:-0}" = 1 ] || [ "$GPUS" -ge 2 ]; then
        RANKS=$([ "$GPUS" -ge 2 ] && echo "$GPUS" || echo 2)
        run rank_spread_0p5b python3 benchmarks/bench_rank_spread.py --device cuda --ranks "$RANKS" --shape qwen2.5-0.5b \
            --trajectories 64 --chunks 3 --chunk 5000 --memory 1024 --final-len 256 --mini-batches 16 \
            --token-budget 16384 --out "$OUT/rank_spread_0.5b.json"
    else
        echo "=== rank_spread: skipped (needs 2 GPUs or more; $GPUS here)"
    fi
fi
if want gpu_tests; then
    run gpu_tests python3 -m pytest -q -m gpu tests -p no:cacheprovider
fi
# the comparison tables of every report in $OUT, whichever sections ran (also kept in $OUT/tables.md)
if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "tables: python3 benchmarks/suite_tables.py $OUT"
else
    echo "=== tables"; python3 benchmarks/suite_tables.py "$OUT" | tee "$OUT/tables.md"
fi
