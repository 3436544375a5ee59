#!/usr/bin/env bash
# The miniature extrapolation experiment end to end (docs/results/README.md shows what came out):
#   data -> untrained evaluation (in the background) -> format warm-up (the untrained model's rollouts on the
#   training split, the SFT conversations, SFT) -> warmed evaluation (in the background) + RL training from the
#   warmed model -> merge -> RL evaluation -> report.
#
#   bash recipe/miniature/pipeline.sh all        # everything, in order; run it again to continue a stopped run
#   bash recipe/miniature/pipeline.sh STAGE      # one stage: data | eval_untrained | warmup_rollouts | warmup_data |
#                                                #   sft | eval_warmed | train | merge | eval_rl | report
#   (several training seeds: recipe/miniature/seeds.sh)
#
# Environment (defaults in brackets):
#   ROOT [runs/miniature]        experiment folder: data/, warmup/ (rollouts/, warmup.parquet), sft/ (SFT
#                                checkpoints), warmed_model/, train/ (RL checkpoints, logs/metrics.jsonl),
#                                rl_model/, eval/seed*/, logs/*.log, meta/
#   MODEL_PATH [SmolLM2-135M-Instruct, converted by python -m verl.utils.smollm]  the untrained model
#   PYTHON [python3]
#   DATA_ARGS                    extra make_data flags (e.g. "--eval-n 2 --eval-lengths 1,2" for a smoke run)
#   EVAL_ARGS                    extra evaluate flags for every system (e.g. "--device cpu --dtype float32")
#   WARMUP [1]                   1: the format warm-up (docs/differences.md) runs and RL starts from its model,
#                                $ROOT/warmed_model; 0: no warm-up, RL starts from MODEL_PATH (the runs of
#                                docs/results/runs.csv)
#   WARMED_MODEL                 an existing warmed model (e.g. another seed's $ROOT/warmed_model): no warm-up
#                                stages here, RL starts from it
#   WARMUP_SAMPLES [2]           rollouts per training row in warmup_rollouts
#   WARMUP_ARGS                  extra `warmup_data rollouts` flags (e.g. "--limit 64 --engine hf")
#   SFT_OVERRIDES                extra Hydra overrides for the SFT (verl/trainer/config/sft_trainer.yaml)
#   EVAL_WARMED [1]              0: skip the warmed model's evaluation (e.g. another seed's run holds it)
#   TRAIN_OVERRIDES              extra Hydra overrides for run_memory_smollm2.sh
#   TRAIN_STEPS [200]            RL steps (STEPS: the older name); TRAIN_SEED [0] the training seed (the
#                                trainer's data, actor and rollout seeds; written to $ROOT/meta/train_seed.txt
#                                and packed); REWARD [strict] strict | demo (run_memory_smollm2.sh says what)
#   MAX_WALL                     stop the RL training after the first step past this many seconds, with a
#                                checkpoint; `all` then writes $ROOT/PAUSED and exits 3: run it again to continue
#   REPORT_OUT [docs/results]    where the report goes
#   REPORT_RECORDS               packed runs reported with this one (each run = one trained model; several
#                                training seeds = several runs); this run is packed into $ROOT/records.jsonl.gz
#   EVAL_PORT [8100]             port of the untrained model's server (the RL model's uses +1, the warmed +50)
#   EVAL_UNTRAINED [1]           0: skip the untrained evaluation (its records already complete, e.g. copied
#                                from an earlier run's eval/); training then starts right after data_train
#   TRAIN [1]                    0: no training and no merge; evaluate the model already in $ROOT/rl_model
#                                (e.g. after an interrupted RL evaluation: it resumes from its saved records)
#   RL_SHARDS [1]                the RL evaluation as N processes side by side (evaluate --shard I/N), each with
#                                its own engine, RL_SHARD_KV_GIB [12] GiB of KV cache and vLLM cache folder
#                                RL_SHARD_CACHE/shardI [/tmp/vllm_cache_rl/shardI]; logs/eval_rl_shardI.log
# Every stage logs to $ROOT/logs/STAGE.log; stage wall times go to $ROOT/meta/stages.tsv; `all` ends
# by writing $ROOT/DONE (or $ROOT/FAILED with the failing stage, or $ROOT/PAUSED when training stopped early).
# Run again, `all` skips what is finished: evaluations and rollouts with a marker $ROOT/meta/done/STAGE (delete
# it to redo one; a new merge or SFT deletes the marker of the evaluation it makes stale), warmup_data when
# warmup.parquet exists, sft when warmed_model/ exists, train when its latest checkpoint reached TRAIN_STEPS
# (else it resumes from it), merge when rl_model/ holds that checkpoint.
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
read -r -a WARMUP_EXTRA <<< "${WARMUP_ARGS:-}"
read -r -a SFT_EXTRA <<< "${SFT_OVERRIDES:-}"
TRAIN_STEPS="${TRAIN_STEPS:-${STEPS:-200}}"
TRAIN_SEED_USED="${TRAIN_SEED:-0}"

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
latest_checkpoint() {  # latest_checkpoint DIR: its complete global_step_N folder with the largest N, if any
    local dir
    while read -r dir; do
        [ -f "$dir/COMPLETE" ] && { echo "$dir"; return 0; }
    done < <(ls -d "$1"/global_step_* 2>/dev/null | sort -V -r)
}
trained_steps() { local last; last=$(latest_checkpoint "$ROOT/train"); echo "${last:+${last##*_}}"; }
train_finished() { local n; n=$(trained_steps); [ -n "$n" ] && [ "$n" -ge "$TRAIN_STEPS" ]; }
warmed_model() {  # the warmed model this run uses (WARMED_MODEL, else $ROOT/warmed_model)
    echo "${WARMED_MODEL:-$ROOT/warmed_model}"
}
uses_warmed_model() { [ -n "${WARMED_MODEL:-}" ] || [ "${WARMUP:-1}" != 0 ]; }
rl_init() {  # the model RL starts from
    if uses_warmed_model; then warmed_model; else echo "$MODEL_PATH"; fi
}

warmup_rollouts() {
    "${PY[@]}" -m recipe.miniature.warmup_data rollouts --data "$ROOT/data/train.parquet" --model "$MODEL_PATH" \
        --out "$ROOT/warmup/rollouts" --samples "${WARMUP_SAMPLES:-2}" "${WARMUP_EXTRA[@]}"
}
warmup_data() {
    "${PY[@]}" -m recipe.miniature.warmup_data build --records "$ROOT/warmup/rollouts" \
        --out "$ROOT/warmup/warmup.parquet"
}
sft() {  # SFT on the warm-up's final turns; the last checkpoint's merged weights become $ROOT/warmed_model
    # batches of 32 conversations, or all of them when the warm-up kept fewer (the trainer refuses a training set
    # smaller than one batch: zero optimizer steps); SFT_OVERRIDES may still set data.train_batch_size
    local data="$ROOT/warmup/warmup.parquet" rows batch=32
    rows=$("${PY[@]}" -c 'import sys, pyarrow.parquet as pq; print(pq.ParquetFile(sys.argv[1]).metadata.num_rows)' \
        "$data") || return
    case $rows in '' | *[!0-9]*) ;; *) [ "$rows" -lt "$batch" ] && batch=$rows ;; esac
    [ "$batch" -ge 1 ] || { echo "sft: $data has no rows: the warm-up kept no conversation" >&2; return 1; }
    "${PY[@]}" -m verl.trainer.main_sft "data.train_files=$data" \
        "model.partial_pretrain=$MODEL_PATH" "trainer.default_local_dir=$ROOT/sft" \
        data.max_length=1024 "data.train_batch_size=$batch" data.micro_batch_size_per_gpu=8 \
        optim.lr=2e-5 trainer.total_epochs=3 trainer.max_ckpt_to_keep=1 "trainer.logger=[console,jsonl]" \
        trainer.progress_bar=false trainer.project_name=memagent-miniature trainer.experiment_name=format-warmup \
        "hydra.run.dir=$ROOT/sft/hydra" "${SFT_EXTRA[@]}" || return
    local last
    last=$(latest_checkpoint "$ROOT/sft")
    [ -f "$last/actor/huggingface/config.json" ] || { echo "no merged model in ${last:-$ROOT/sft}/actor/huggingface" >&2; return 1; }
    rm -rf "$ROOT/warmed_model.tmp" && cp -r "$last/actor/huggingface" "$ROOT/warmed_model.tmp" \
        && rm -rf "$ROOT/warmed_model" && mv "$ROOT/warmed_model.tmp" "$ROOT/warmed_model" \
        && echo "$last" >"$ROOT/meta/warmed_checkpoint.txt" && rm -f "$ROOT/meta/done/eval_warmed"
}
eval_warmed() {
    local model
    model=$(warmed_model)
    [ -f "$model/config.json" ] || { echo "no warmed model in $model: run the warm-up first" >&2; return 1; }
    "${PY[@]}" -m recipe.miniature.evaluate --root "$ROOT" --system warmed --model "$model" \
        --port "$((EVAL_PORT + 50))" --wait-for "$ROOT/data/.eval_ready" --ready-file "$ROOT/meta/.warmed_engine_ready" \
        "${EVAL_EXTRA[@]}"
}
train() {  # RL from rl_init; refuses to resume checkpoints of another seed or starting model
    local init recorded
    init=$(rl_init)
    [ -f "$init/config.json" ] || { echo "RL starts from $init, which has no config.json (run the warm-up, set WARMED_MODEL, or WARMUP=0)" >&2; return 1; }
    if [ -n "$(latest_checkpoint "$ROOT/train")" ]; then
        recorded=$(cat "$ROOT/meta/train_seed.txt" 2>/dev/null)
        [ -z "$recorded" ] || [ "$recorded" = "$TRAIN_SEED_USED" ] || {
            echo "$ROOT/train holds checkpoints of training seed $recorded, not TRAIN_SEED=$TRAIN_SEED_USED: use another ROOT" >&2; return 1; }
        recorded=$(cat "$ROOT/meta/rl_init.txt" 2>/dev/null)
        [ -z "$recorded" ] || [ "$recorded" = "$init" ] || {
            echo "$ROOT/train holds checkpoints of a run from $recorded, not $init: use another ROOT" >&2; return 1; }
    fi
    case "${REWARD:-strict}" in  # meta/reward.txt: the report prints it in its training section
        strict) echo "strict: the strict boxed verifier alone (verl.utils.reward_score routes synthetic_qa to" \
            "hotpotqa.compute_score): 1 when the last \\boxed{} holds a gold answer, else 0" >"$ROOT/meta/reward.txt" ;;
        demo) echo "demo: scripts/demo_reward.py: 1 when the last \\boxed{} holds a gold answer, 0.5 when a gold" \
            "answer appears unboxed, else 0" >"$ROOT/meta/reward.txt" ;;
        *) echo "REWARD=$REWARD: expected strict or demo" >&2; return 2 ;;
    esac
    echo "$TRAIN_SEED_USED" >"$ROOT/meta/train_seed.txt"
    echo "$init" >"$ROOT/meta/rl_init.txt"
    local run=(env DATA_DIR="$ROOT/data" MODEL_PATH="$init" OUT_DIR="$ROOT/train" PYTHON="$PYTHON"
        TRAIN_STEPS="$TRAIN_STEPS" TRAIN_SEED="$TRAIN_SEED_USED" bash recipe/miniature/run_memory_smollm2.sh "${TRAIN_EXTRA[@]}")
    DRY_RUN=1 "${run[@]}" >"$ROOT/meta/train_overrides.txt" || return  # the trainer's exact command, packed
    "${run[@]}" || return
    echo "training at step $(trained_steps) of $TRAIN_STEPS"
}
merged() {  # rl_model/ holds the latest RL checkpoint
    local last
    last=$(latest_checkpoint "$ROOT/train")
    [ -n "$last" ] && [ -f "$ROOT/rl_model/config.json" ] && [ "$(cat "$ROOT/meta/rl_checkpoint.txt" 2>/dev/null)" = "$last" ]
}
merge() {
    local last
    last=$(latest_checkpoint "$ROOT/train")
    [ -n "$last" ] || { echo "no checkpoint under $ROOT/train" >&2; return 1; }
    echo "merging $last"
    "${PY[@]}" scripts/model_merger.py --local_dir "$last/actor" --target_dir "$ROOT/rl_model.tmp" \
        --hf_model_path "$(rl_init)" && rm -rf "$ROOT/rl_model" && mv "$ROOT/rl_model.tmp" "$ROOT/rl_model" \
        && echo "$last" >"$ROOT/meta/rl_checkpoint.txt" && rm -f "$ROOT/meta/done/eval_rl"
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
    local seed=()  # else meta/train_seed.txt, written by `train`
    [ -n "${TRAIN_SEED:-}" ] && seed=(--train-seed "$TRAIN_SEED")
    "${PY[@]}" -m recipe.miniature.pack_records --root "$ROOT" --out "$ROOT/records.jsonl.gz" "${seed[@]}" \
        && "${PY[@]}" -m recipe.miniature.report --records ${REPORT_RECORDS:-} "$ROOT/records.jsonl.gz" \
            --out "${REPORT_OUT:-docs/results}" ${REPORT_ARGS:-}
}

mark_done() { mkdir -p "$ROOT/meta/done" && date >"$ROOT/meta/done/$1"; }
is_done() { [ -e "$ROOT/meta/done/$1" ]; }
step() {  # step STAGE: run STAGE (timed) unless its done marker exists; mark it done when it succeeds
    if is_done "$1"; then
        echo "[pipeline] $1 already done ($ROOT/meta/done/$1)" | tee -a "$ROOT/logs/pipeline.log"
        return 0
    fi
    timed "$1" "$1" && mark_done "$1"
}

wait_file() {  # wait_file PATH SECONDS PID: until PATH exists, PID exits, or SECONDS pass
    local t0=$SECONDS
    while [ ! -e "$1" ] && [ $((SECONDS - t0)) -lt "$2" ] && kill -0 "$3" 2>/dev/null; do sleep 2; done
    if [ -e "$1" ]; then echo "$(basename "$1") after $((SECONDS - t0)) s"; else echo "no $1 after $((SECONDS - t0)) s"; fi
}

fail() { echo "$1" >"$ROOT/FAILED"; echo "[pipeline] FAILED at $1" | tee -a "$ROOT/logs/pipeline.log"; }

pause() { echo "$1" >"$ROOT/PAUSED"; echo "[pipeline] PAUSED: $1; run the same command again to continue" | tee -a "$ROOT/logs/pipeline.log"; }
failed_or_paused() { [ -f "$ROOT/FAILED" ] || [ -f "$ROOT/PAUSED" ]; }

background() {  # background STAGE READY_FILE: start STAGE (step) in the background unless done; wait for its engine
    is_done "$1" && { echo "[pipeline] $1 already done" | tee -a "$ROOT/logs/pipeline.log"; return 1; }
    rm -f "$2"
    (step "$1") &
    BG_PID=$!
    # an evaluation's engine starts before the next GPU stage's, so that the later engine profiles GPU memory
    # after it (vLLM refuses to start while another process frees memory during its profiling)
    wait_file "$2" 900 "$BG_PID" | tee -a "$ROOT/logs/pipeline.log"
}

warm_up() {  # the format warm-up's stages, each skipped when its output exists
    step warmup_rollouts || { fail warmup_rollouts; return 1; }
    if [ -f "$ROOT/warmup/warmup.parquet" ]; then echo "[pipeline] warmup_data: $ROOT/warmup/warmup.parquet exists" | tee -a "$ROOT/logs/pipeline.log"
    else timed warmup_data warmup_data || { fail warmup_data; return 1; }; fi
    if [ -f "$ROOT/warmed_model/config.json" ]; then echo "[pipeline] sft: $ROOT/warmed_model exists" | tee -a "$ROOT/logs/pipeline.log"
    else timed sft sft || { fail sft; return 1; }; fi
}

all() {
    rm -f "$ROOT/DONE" "$ROOT/FAILED" "$ROOT/PAUSED"
    timed data_train data_train || { fail data_train; return 1; }
    (timed data_eval data_eval) &
    local data_eval=$! untrained="" warmed=""
    if [ "${EVAL_UNTRAINED:-1}" != 0 ]; then
        background eval_untrained "$ROOT/meta/.untrained_engine_ready" && untrained=$BG_PID
    else
        echo "[pipeline] EVAL_UNTRAINED=0: no untrained evaluation" | tee -a "$ROOT/logs/pipeline.log"
    fi
    if [ -z "${WARMED_MODEL:-}" ] && [ "${WARMUP:-1}" != 0 ]; then
        warm_up
    elif [ -n "${WARMED_MODEL:-}" ]; then
        echo "[pipeline] WARMED_MODEL=$WARMED_MODEL: no warm-up here" | tee -a "$ROOT/logs/pipeline.log"
    else
        echo "[pipeline] WARMUP=0: no warm-up; RL starts from $MODEL_PATH" | tee -a "$ROOT/logs/pipeline.log"
    fi
    if ! failed_or_paused && uses_warmed_model && [ "${EVAL_WARMED:-1}" != 0 ]; then
        background eval_warmed "$ROOT/meta/.warmed_engine_ready" && warmed=$BG_PID
    fi
    if failed_or_paused; then
        :
    elif [ "${TRAIN:-1}" != 0 ]; then
        if train_finished; then
            echo "[pipeline] train: $(latest_checkpoint "$ROOT/train") reached TRAIN_STEPS=$TRAIN_STEPS" | tee -a "$ROOT/logs/pipeline.log"
        else
            timed train train || fail train
        fi
        if [ -f "$ROOT/FAILED" ]; then
            :
        elif ! train_finished; then
            pause "train at step $(trained_steps) of $TRAIN_STEPS"
        elif merged; then
            echo "[pipeline] merge: $ROOT/rl_model holds $(cat "$ROOT/meta/rl_checkpoint.txt")" | tee -a "$ROOT/logs/pipeline.log"
        else
            timed merge merge || fail merge
        fi
    elif [ -f "$ROOT/rl_model/config.json" ]; then
        echo "[pipeline] TRAIN=0: evaluating $ROOT/rl_model ($(cat "$ROOT/meta/rl_checkpoint.txt" 2>/dev/null))" \
            | tee -a "$ROOT/logs/pipeline.log"
    else
        echo "TRAIN=0 but $ROOT/rl_model has no config.json" | tee -a "$ROOT/logs/pipeline.log"; fail train
    fi
    wait "$data_eval" || fail data_eval
    if ! failed_or_paused; then
        step eval_rl || fail eval_rl
    fi
    if [ -n "$untrained" ]; then
        wait "$untrained" || echo "eval_untrained ended with an error (see $ROOT/logs/eval_untrained.log)"
    fi
    if [ -n "$warmed" ]; then
        wait "$warmed" || echo "eval_warmed ended with an error (see $ROOT/logs/eval_warmed.log)"
    fi
    wait
    if [ -f "$ROOT/PAUSED" ]; then
        return 3
    fi
    timed report report || fail report
    [ -f "$ROOT/FAILED" ] || date >"$ROOT/DONE"
}

stage="${1:-all}"
case "$stage" in
    all) all ;;
    data) timed data_train data_train && timed data_eval data_eval ;;
    eval_untrained|warmup_rollouts|eval_warmed|eval_rl) timed "$stage" "$stage" && mark_done "$stage" ;;
    data_train|data_eval|warmup_data|sft|train|merge|report) timed "$stage" "$stage" ;;
    *) echo "unknown stage $stage; expected all | data | data_train | data_eval | eval_untrained | warmup_rollouts |" \
        "warmup_data | sft | eval_warmed | train | merge | eval_rl | report" >&2; exit 2 ;;
esac
