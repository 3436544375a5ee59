#!/usr/bin/env bash
# The miniature extrapolation experiment end to end (docs/results/README.md shows what came out):
#   data -> untrained evaluation (in the background) + RL training -> merge -> RL evaluation -> report.
#
#   bash recipe/miniature/pipeline.sh all        # everything, in order (one GPU: ~17 min on an H200)
#   bash recipe/miniature/pipeline.sh STAGE      # one stage: data | eval_untrained | train | merge | eval_rl | report
#
# Environment (defaults in brackets):
#   ROOT [runs/miniature]        experiment folder: data/, train/ (checkpoints, logs/metrics.jsonl),
#                                rl_model/, eval/seed*/, logs/*.log, meta/
#   MODEL_PATH [SmolLM2-135M-Instruct, converted by python -m verl.utils.smollm]
#   PYTHON [python3]
#   DATA_ARGS                    extra make_data flags (e.g. "--eval-n 2 --eval-lengths 1,2" for a smoke run)
#   EVAL_ARGS                    extra evaluate flags for both systems (e.g. "--device cpu --dtype float32")
#   TRAIN_OVERRIDES              extra Hydra overrides for run_memory_smollm2.sh
#   STEPS [40], MAX_WALL [360]   training steps and the training command's wall-clock budget (seconds)
#   REPORT_OUT [docs/results]    where the report goes
#   REPORT_RECORDS               packed runs reported with this one (each run = one trained model; several
#                                training seeds = several runs); this run is packed into $ROOT/records.jsonl.gz
#   TRAIN_SEED                   the training seed recorded in the pack (else $ROOT/meta/train_seed.txt, if any)
#   EVAL_PORT [8100]             port of the untrained model's server (the RL model's uses +1)
#   EVAL_UNTRAINED [1]           0: skip the untrained evaluation (its records already complete, e.g. copied
#                                from an earlier run's eval/); training then starts right after data_train
#   TRAIN [1]                    0: no training and no merge; evaluate the model already in $ROOT/rl_model
#                                (e.g. after an interrupted RL evaluation: it resumes from its saved records)
#   RL_SHARDS [1]                the RL evaluation as N processes side by side (evaluate --shard I/N), each with
#                                its own engine, RL_SHARD_KV_GIB [12] GiB of KV cache and vLLM cache folder
#                                RL_SHARD_CACHE/shardI [/tmp/vllm_cache_rl/shardI]; logs/eval_rl_shardI.log
# Every stage logs to $ROOT/logs/STAGE.log; stage wall times go to $ROOT/meta/stages.tsv; `all` ends
# by writing $ROOT/DONE (or $ROOT/FAILED with the failing stage).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT="${ROOT:-runs/miniature}"
PYTHON="${PYTHON:-python3}"
read -r -a PY <<< "${PYTHON}"
EVAL_PORT="${EVAL_PORT:-8100}"
mkdir -p "$ROOT/logs" "$ROOT/meta"
MODEL_PATH="${MODEL_PATH:-$("${PY[@]}" -m verl.utils.smollm 2>/dev/null | tail -1)}"
[ -f "$MODEL_PATH/config.json" ] || { echo "MODEL_PATH=$MODEL_PATH has no config.json" >&2; exit 2; }
read -r -a DATA_EXTRA <<< "${DATA_ARGS:-}"
read -r -a EVAL_EXTRA <<< "${EVAL_ARGS:-}"
read -r -a TRAIN_EXTRA <<< "${TRAIN_OVERRIDES:-}"

timed() {  # timed STAGE cmd...: run, log to $ROOT/logs/STAGE.log, record the wall time
    local stage=$1; shift
    local t0=$SECONDS
    echo "[pipeline] $(date +%T) start $stage" | tee -a "$ROOT/logs/pipeline.log"
    "$@" >"$ROOT/logs/$stage.log" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\n' "$stage" "$((SECONDS - t0))" "$rc" >>"$ROOT/meta/stages.tsv"
    echo "[pipeline] $(date +%T) end $stage rc=$rc ($((SECONDS - t0)) s)" | tee -a "$ROOT/logs/pipeline.log"
    return $rc
}

data_train() { "${PY[@]}" -m recipe.miniature.make_data --tokenizer "$MODEL_PATH" --out "$ROOT/data" --only-train "${DATA_EXTRA[@]}"; }
data_eval() {
    "${PY[@]}" -m recipe.miniature.make_data --tokenizer "$MODEL_PATH" --out "$ROOT/data" "${DATA_EXTRA[@]}" \
        && touch "$ROOT/data/.eval_ready"
}
eval_untrained() {
    "${PY[@]}" -m recipe.miniature.evaluate --root "$ROOT" --system untrained --model "$MODEL_PATH" \
        --port "$EVAL_PORT" --wait-for "$ROOT/data/.eval_ready" --ready-file "$ROOT/meta/.untrained_engine_ready" \
        "${EVAL_EXTRA[@]}"
}
train() {
    DATA_DIR="$ROOT/data" MODEL_PATH="$MODEL_PATH" OUT_DIR="$ROOT/train" PYTHON="$PYTHON" \
        bash recipe/miniature/run_memory_smollm2.sh "${TRAIN_EXTRA[@]}"
}
merge() {
    local last
    last=$(ls -d "$ROOT"/train/global_step_* 2>/dev/null | sort -V | tail -1)
    [ -n "$last" ] || { echo "no checkpoint under $ROOT/train" >&2; return 1; }
    echo "merging $last"
    "${PY[@]}" scripts/model_merger.py --local_dir "$last/actor" --target_dir "$ROOT/rl_model.tmp" \
        --hf_model_path "$MODEL_PATH" && rm -rf "$ROOT/rl_model" && mv "$ROOT/rl_model.tmp" "$ROOT/rl_model" \
        && echo "$last" >"$ROOT/meta/rl_checkpoint.txt"
}
eval_rl() {
    local shards="${RL_SHARDS:-1}"
    if [ "$shards" -le 1 ]; then
        "${PY[@]}" -m recipe.miniature.evaluate --root "$ROOT" --system rl --model "$ROOT/rl_model" \
            --port "$((EVAL_PORT + 1))" "${EVAL_EXTRA[@]}"
        return
    fi
    local i rc=0 pids=() workers=$(( $(nproc) / shards > 1 ? $(nproc) / shards : 1 ))
    for ((i = 0; i < shards; i++)); do
        # each shard compiles into its own vLLM cache: the model is new, so nothing is lost, and engines that
        # start together never write one cache folder at once (vllm-project/vllm#24601)
        VLLM_CACHE_ROOT="${RL_SHARD_CACHE:-/tmp/vllm_cache_rl}/shard$i" \
            "${PY[@]}" -m recipe.miniature.evaluate --root "$ROOT" --system rl --model "$ROOT/rl_model" \
            --port "$((EVAL_PORT + 1 + i))" --shard "$i/$shards" --workers "$workers" \
            --kv-cache-gib "${RL_SHARD_KV_GIB:-12}" "${EVAL_EXTRA[@]}" >"$ROOT/logs/eval_rl_shard$i.log" 2>&1 &
        pids+=($!)
    done
    echo "eval_rl: $shards shards, pids ${pids[*]}"
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"; local r=$?
        echo "shard $i/$shards: rc=$r"; [ "$r" -gt "$rc" ] && rc=$r
    done
    return $rc
}
report() {  # pack the run into one file, then report it (with REPORT_RECORDS: other runs' packs, e.g. other seeds)
    local seed=()
    [ -n "${TRAIN_SEED:-}" ] && seed=(--train-seed "$TRAIN_SEED")
    "${PY[@]}" -m recipe.miniature.pack_records --root "$ROOT" --out "$ROOT/records.jsonl.gz" "${seed[@]}" \
        && "${PY[@]}" -m recipe.miniature.report --records ${REPORT_RECORDS:-} "$ROOT/records.jsonl.gz" \
            --out "${REPORT_OUT:-docs/results}" ${REPORT_ARGS:-}
}

wait_file() {  # wait_file PATH SECONDS PID: until PATH exists, PID exits, or SECONDS pass
    local t0=$SECONDS
    while [ ! -e "$1" ] && [ $((SECONDS - t0)) -lt "$2" ] && kill -0 "$3" 2>/dev/null; do sleep 2; done
    if [ -e "$1" ]; then echo "untrained model's engine up after $((SECONDS - t0)) s"; else echo "no $1 after $((SECONDS - t0)) s"; fi
}

fail() { echo "$1" >"$ROOT/FAILED"; echo "[pipeline] FAILED at $1" | tee -a "$ROOT/logs/pipeline.log"; }

all() {
    rm -f "$ROOT/DONE" "$ROOT/FAILED"
    timed data_train data_train || { fail data_train; return 1; }
    # the untrained model's engine starts first, so that the training engine profiles GPU memory
    # after it (vLLM refuses to start while another process frees memory during its profiling)
    rm -f "$ROOT/meta/.untrained_engine_ready"
    (timed data_eval data_eval) &
    local data_eval=$! untrained=""
    if [ "${EVAL_UNTRAINED:-1}" != 0 ]; then
        (timed eval_untrained eval_untrained) &
        untrained=$!
        wait_file "$ROOT/meta/.untrained_engine_ready" 900 "$untrained" | tee -a "$ROOT/logs/pipeline.log"
    else
        echo "[pipeline] EVAL_UNTRAINED=0: no untrained evaluation" | tee -a "$ROOT/logs/pipeline.log"
    fi
    if [ "${TRAIN:-1}" != 0 ]; then
        timed train train || fail train
        if [ ! -f "$ROOT/FAILED" ]; then
            timed merge merge || fail merge
        fi
    elif [ -f "$ROOT/rl_model/config.json" ]; then
        echo "[pipeline] TRAIN=0: evaluating $ROOT/rl_model ($(cat "$ROOT/meta/rl_checkpoint.txt" 2>/dev/null))" \
            | tee -a "$ROOT/logs/pipeline.log"
    else
        echo "TRAIN=0 but $ROOT/rl_model has no config.json" | tee -a "$ROOT/logs/pipeline.log"; fail train
    fi
    wait "$data_eval" || fail data_eval
    if [ ! -f "$ROOT/FAILED" ]; then
        timed eval_rl eval_rl || fail eval_rl
    fi
    if [ -n "$untrained" ]; then
        wait "$untrained" || echo "eval_untrained ended with an error (see $ROOT/logs/eval_untrained.log)"
    fi
    wait
    timed report report || fail report
    [ -f "$ROOT/FAILED" ] || date >"$ROOT/DONE"
}

stage="${1:-all}"
case "$stage" in
    all) all ;;
    data) timed data_train data_train && timed data_eval data_eval ;;
    data_train|data_eval|eval_untrained|train|merge|eval_rl|report) timed "$stage" "$stage" ;;
    *) echo "unknown stage $stage; expected all | data | data_train | data_eval | eval_untrained | train | merge | eval_rl | report" >&2; exit 2 ;;
esac
