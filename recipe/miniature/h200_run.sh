#!/usr/bin/env bash
# Drive the miniature experiment on a lent single-GPU machine whose commands are limited to ~10
# minutes each: `start` launches recipe/miniature/pipeline.sh in the background (its own session,
# so it outlives the command) and waits; later commands `wait` for it; every command ends by packing
# what exists so far into $OUT/results.tgz (results, logs, metrics, report).
#
#   bash recipe/miniature/h200_run.sh start [SECONDS]    # set up, launch, wait; return SECONDS (540) after starting
#   bash recipe/miniature/h200_run.sh wait [SECONDS]     # wait for the pipeline; return SECONDS (570) after starting
#   bash recipe/miniature/h200_run.sh bench [SECONDS]    # benchmarks/h200_suite.sh into $MINI_ROOT/bench (~5 min)
#   bash recipe/miniature/h200_run.sh bench-eval [SECONDS]  # bench_eval_schedule.py --compare graphs, then schedule
#   bash recipe/miniature/h200_run.sh stop               # SIGTERM the evaluations (they save their memory), pack
#   bash recipe/miniature/h200_run.sh collect            # only pack $OUT/results.tgz
#   bash recipe/miniature/h200_run.sh resume-untrained DIR   # copy DIR's untrained-* records/states into the run
#   bash recipe/miniature/h200_run.sh fetch-model        # only the next parts of the trained model (see below)
#   bash recipe/miniature/h200_run.sh eval-rl [SECONDS]  # after a stop or a failed RL evaluation: run it again in
#                                                        # the background (resuming its saved memories), then report
#
# Once $MINI_ROOT/rl_model exists, every command also packs it (recipe.miniature.pack_model: bf16, 9 MiB
# parts) and returns the next 6 parts not yet returned, beside results.tgz, so the trained model can
# outlive the session (FETCH_MODEL=0: never). A later session resumes its evaluation with the same weights:
#   RL_MODEL_PARTS=DIR RESUME_RL=docs/results/runN/eval TRAIN=0 EVAL_UNTRAINED=0 RL_SHARDS=4 \
#       bash recipe/miniature/h200_run.sh start     # DIR: the carried parts and manifest
#
# Expects PYTHONPATH to hold the packages the machine lacks (ray, hydra, vllm...; see
# docs/results/README.md for the install line). Environment: MINI_ROOT [/tmp/mini], STEPS [60],
# MAX_WALL [360] (training seconds), RESUME_UNTRAINED (an earlier run's eval/ folder: `start` first copies
# its untrained-* files, so the untrained evaluation resumes where it stopped), plus anything pipeline.sh reads
# (EVAL_UNTRAINED=0 when those records are complete, RL_SHARDS=N for N side-by-side RL evaluations,
# TRAIN=0 to evaluate $MINI_ROOT/rl_model as it is), RESUME_RL (like RESUME_UNTRAINED, for the rl-* files:
# only with the same model, i.e. with RL_MODEL_PARTS), RL_MODEL_PARTS (folder of pack_model parts:
# `start` unpacks them into $MINI_ROOT/rl_model).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
MINI_ROOT="${MINI_ROOT:-/tmp/mini}"
CODE="${MINI_CODE:-/tmp/mini_code}"  # `start` copies the tree here; the pipeline runs from the copy
OUT="${OUT:-/tmp/mini_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
export RAY_USAGE_STATS_ENABLED=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MEMAGENT_CACHE="${MEMAGENT_CACHE:-/tmp/memagent_cache}"

PARTS="${PARTS_DIR:-/tmp/rl_model_parts}"
fetch_model() {  # the next 6 parts of the packed RL model into $OUT (packed on first use)
    [ "${FETCH_MODEL:-1}" != 0 ] && [ -f "$MINI_ROOT/rl_model/config.json" ] || return 0
    [ -f "$MINI_ROOT/meta/.rl_model_from_parts" ] && return 0  # it came from parts: nothing to return
    pgrep -f "[r]ecipe/miniature/pipeline.sh" >/dev/null && [ ! -f "$MINI_ROOT/meta/rl_checkpoint.txt" ] \
        && return 0  # merge still writing
    if [ ! -f "$PARTS/rl_model.manifest.json" ]; then
        python3 -m recipe.miniature.pack_model pack --model "$MINI_ROOT/rl_model" --out "$PARTS" \
            --part-mib "${MODEL_PART_MIB:-9}" || return 0
        cp "$MINI_ROOT/meta/rl_checkpoint.txt" "$PARTS/" 2>/dev/null
    fi
    touch "$PARTS/.fetched"
    local part n=0
    for part in "$PARTS"/rl_model.tar.part*; do
        grep -qxF "$(basename "$part")" "$PARTS/.fetched" && continue
        [ "$n" -ge 6 ] && break
        cp "$part" "$OUT/" && basename "$part" >>"$PARTS/.fetched" && n=$((n + 1))
    done
    cp "$PARTS/rl_model.manifest.json" "$OUT/"
    echo "model parts: $n returned now, $(wc -l <"$PARTS/.fetched") of $(ls "$PARTS"/rl_model.tar.part* | wc -l) in all"
}

collect() {
    [ -d "$MINI_ROOT" ] || return 0
    tar -C "$MINI_ROOT" -czf "$OUT/results.tgz" --exclude='*.parquet' --exclude='global_step_*' \
        --exclude='rl_model*' --exclude='data' . 2>/dev/null
    ls -la "$OUT"
}

status() {
    echo "--- pipeline ($(date +%T))"
    tail -n 12 "$MINI_ROOT/logs/pipeline.log" 2>/dev/null
    [ -f "$MINI_ROOT/train/logs/metrics.jsonl" ] && python3 - "$MINI_ROOT/train/logs/metrics.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]).read().splitlines()[-3:]:
    r = json.loads(line)
    keys = [k for k in r if k.startswith(("critic/score/mean", "val-core/", "timing_s/step", "timing_s/gen"))]
    print("step", r.get("step"), {k: round(float(r[k]), 3) for k in keys})
EOF
    for f in "$MINI_ROOT"/logs/eval_*.log; do [ -f "$f" ] && echo "$(basename "$f"): $(tail -n 1 "$f" | cut -c1-200)"; done
    cat "$MINI_ROOT"/meta/eval_*_runs.jsonl 2>/dev/null | tail -n 4
    [ -f "$MINI_ROOT/FAILED" ] && { echo "FAILED at $(cat "$MINI_ROOT/FAILED")"; tail -n 30 "$MINI_ROOT/logs/$(cat "$MINI_ROOT/FAILED").log"; }
    [ -f "$MINI_ROOT/DONE" ] && echo "DONE $(cat "$MINI_ROOT/DONE")"
    return 0
}

wait_for() {  # wait_for SECONDS: until SECONDS after this script started (setup time included)
    local limit=$1
    while [ "$SECONDS" -lt "$limit" ]; do
        [ -f "$MINI_ROOT/DONE" ] || [ -f "$MINI_ROOT/FAILED" ] && break
        pgrep -f "recipe/miniature/pipeline.sh" >/dev/null || { echo "pipeline is not running"; break; }
        sleep 10
    done
    status
}

resume_records() {  # resume_records DIR SYSTEM: DIR/seed*/CELL/SYSTEM-* -> $MINI_ROOT/eval/seed*/CELL/
    local src=$1 system=$2 dst n
    [ -d "$src" ] || { echo "resume-$system: no folder $src" >&2; return 2; }
    dst=$(mkdir -p "$MINI_ROOT/eval" && cd "$MINI_ROOT/eval" && pwd)
    n=$(cd "$src" && find . -type f -name "$system-*" -exec cp --parents {} "$dst/" \; -print | wc -l)
    echo "resume-$system: $n files from $src"
}

stop_evaluations() {  # SIGTERM: no new requests; the batched runner saves the memory of unfinished items
    pkill -TERM -f "[r]ecipe.miniature.evaluate" || { echo "no evaluation running"; return 0; }
    local t0=$SECONDS
    while pgrep -f "[r]ecipe.miniature.evaluate" >/dev/null && [ $((SECONDS - t0)) -lt 60 ]; do sleep 2; done
    echo "evaluations stopped after $((SECONDS - t0)) s"
    local t1=$SECONDS  # the pipeline then writes its report
    while pgrep -f "[r]ecipe/miniature/pipeline.sh" >/dev/null && [ $((SECONDS - t1)) -lt 30 ]; do sleep 2; done
}

start() {
    mkdir -p "$MINI_ROOT/meta" "$MINI_ROOT/logs"
    [ -n "${RESUME_UNTRAINED:-}" ] && { resume_records "$RESUME_UNTRAINED" untrained || return 1; }
    if [ -n "${RL_MODEL_PARTS:-}" ]; then
        python3 -m recipe.miniature.pack_model unpack --parts "$RL_MODEL_PARTS" --out "$MINI_ROOT/rl_model" || return 1
        cp "$RL_MODEL_PARTS/rl_checkpoint.txt" "$MINI_ROOT/meta/" 2>/dev/null
        touch "$MINI_ROOT/meta/.rl_model_from_parts"
    fi
    if [ -n "${RESUME_RL:-}" ]; then
        [ -n "${RL_MODEL_PARTS:-}" ] || { echo "RESUME_RL needs RL_MODEL_PARTS (the same model)" >&2; return 1; }
        resume_records "$RESUME_RL" rl || return 1
    fi
    rm -rf "$CODE" && mkdir -p "$CODE" && cp -r . "$CODE/"  # the pipeline runs from a copy: later syncs can't touch it
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        echo "CPU cores: $(nproc); $(python3 -c 'import sys, torch, transformers, vllm; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")' 2>&1 | tail -1)"
        echo "started: $(date -u +%FT%TZ)"
    } >"$MINI_ROOT/meta/hardware.txt"
    cat "$MINI_ROOT/meta/hardware.txt"
    local t0=$SECONDS
    MODEL_PATH=$(cd "$CODE" && python3 -m verl.utils.smollm 2>"$MINI_ROOT/logs/convert.log" | tail -1)
    echo "model: $MODEL_PATH (converted in $((SECONDS - t0)) s)"
    [ -f "$MODEL_PATH/config.json" ] || { tail -20 "$MINI_ROOT/logs/convert.log"; return 1; }
    cat >"$MINI_ROOT/meta/commands.txt" <<EOF
# on the GPU machine, after installing the wheels (docs/results/README.md):
export PYTHONPATH=/tmp/site:\$PWD VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
MODEL_PATH=\$(python3 -m verl.utils.smollm)
${RESUME_UNTRAINED:+bash recipe/miniature/h200_run.sh resume-untrained $RESUME_UNTRAINED  # untrained-* records and memories of an earlier run}
${RL_MODEL_PARTS:+python3 -m recipe.miniature.pack_model unpack --parts $RL_MODEL_PARTS --out $MINI_ROOT/rl_model  # the RL model of an earlier session}
${RESUME_RL:+MINI_ROOT=$MINI_ROOT bash recipe/miniature/h200_run.sh resume-rl $RESUME_RL  # its rl-* records and memories}
${TRAIN:+TRAIN=$TRAIN }${EVAL_UNTRAINED:+EVAL_UNTRAINED=$EVAL_UNTRAINED }${RL_SHARDS:+RL_SHARDS=$RL_SHARDS }ROOT=$MINI_ROOT STEPS=${STEPS:-60} MAX_WALL=${MAX_WALL:-360} bash recipe/miniature/pipeline.sh all
#   = make_data; evaluate --system untrained (background); run_memory_smollm2.sh (training);
#     model_merger; evaluate --system rl; report
EOF
    launch_pipeline "$MODEL_PATH"
    echo "pipeline launched"
}

launch_pipeline() {  # launch_pipeline BASE_MODEL: pipeline.sh all from $CODE, in its own session (outlives the command)
    (cd "$CODE" && ROOT="$MINI_ROOT" MODEL_PATH="$1" STEPS="${STEPS:-60}" MAX_WALL="${MAX_WALL:-360}" \
        REPORT_OUT="$MINI_ROOT/report" \
        REPORT_ARGS="--commands $MINI_ROOT/meta/commands.txt --hardware $MINI_ROOT/meta/hardware.txt" \
        setsid nohup bash recipe/miniature/pipeline.sh all >>"$MINI_ROOT/logs/pipeline.out" 2>&1 </dev/null &)
    sleep 5
}

eval_rl_again() {  # pipeline.sh all with TRAIN=0 EVAL_UNTRAINED=0: the RL evaluation (resuming its memories), report
    pgrep -f "[r]ecipe/miniature/pipeline.sh" >/dev/null && { echo "the pipeline is still running" >&2; return 1; }
    [ -f "$MINI_ROOT/rl_model/config.json" ] || { echo "no $MINI_ROOT/rl_model" >&2; return 1; }
    [ -d "$CODE" ] || CODE=$PWD
    local model log
    model=${MODEL_PATH:-$(cd "$CODE" && python3 -m verl.utils.smollm 2>/dev/null | tail -1)}
    for log in "$MINI_ROOT"/logs/eval_rl*.log; do  # keep the earlier attempt's logs
        [ -f "$log" ] && mv "$log" "${log%.log}.before-$(date +%H%M%S).log"
    done
    echo "# then, again: ${EVAL_ARGS:+EVAL_ARGS='$EVAL_ARGS' }${RL_SHARDS:+RL_SHARDS=$RL_SHARDS }TRAIN=0 EVAL_UNTRAINED=0 bash recipe/miniature/pipeline.sh all" \
        >>"$MINI_ROOT/meta/commands.txt"
    TRAIN=0 EVAL_UNTRAINED=0 launch_pipeline "$model"
    echo "RL evaluation relaunched"
}

bench() {  # bench SECONDS: the benchmark suite, its JSON reports and logs packed with the results
    local model
    model=$(python3 -m verl.utils.smollm 2>/dev/null | tail -1)
    mkdir -p "$MINI_ROOT/bench"
    OUT="$MINI_ROOT/bench" timeout -k 10 "$(( $1 - SECONDS ))" bash benchmarks/h200_suite.sh "$model" \
        2>&1 | tee "$MINI_ROOT/bench/suite.log" | tail -n 80
}

bench_eval() {  # bench_eval SECONDS: the evaluation engine's graph limit, then its schedule, side by side
    local model cmp
    model=$(python3 -m verl.utils.smollm 2>/dev/null | tail -1)
    mkdir -p "$MINI_ROOT/bench"
    for cmp in graphs schedule; do
        [ $(( $1 - SECONDS )) -gt 60 ] || { echo "bench-eval: no time left for --compare $cmp"; break; }
        timeout -k 10 "$(( $1 - SECONDS ))" python3 benchmarks/bench_eval_schedule.py --compare "$cmp" \
            --device cuda --model "$model" --items 32 --chunks 8 64 --chunk-tokens 512 --memory-tokens 128 \
            --max-num-batched-tokens 4096 --out "$MINI_ROOT/bench/eval_$cmp.json" \
            >"$MINI_ROOT/bench/eval_$cmp.log" 2>&1
        echo "--compare $cmp: rc=$?"; tail -n 6 "$MINI_ROOT/bench/eval_$cmp.log"
    done
}

case "${1:-wait}" in
    start) start && wait_for "${2:-540}" ;;
    wait) wait_for "${2:-570}" ;;
    bench) bench "${2:-570}" ;;
    bench-eval) bench_eval "${2:-570}" ;;
    stop) stop_evaluations; status ;;
    collect) status ;;
    eval-rl) eval_rl_again && wait_for "${2:-570}" ;;
    fetch-model) ;;
    resume-untrained) resume_records "${2:?resume-untrained DIR}" untrained || exit 2 ;;
    resume-rl) resume_records "${2:?resume-rl DIR}" rl || exit 2 ;;
    *) echo "usage: $0 start|wait|eval-rl|bench|bench-eval|stop|collect|fetch-model [SECONDS] | resume-untrained|resume-rl DIR" >&2
       exit 2 ;;
esac
fetch_model
collect
