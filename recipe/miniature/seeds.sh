#!/usr/bin/env bash
# The miniature study: one RL-trained model per training seed, each in its own run folder, all evaluated on the
# same questions against the same baselines, then one report over all of them (docs/results/README.md).
#
#   bash recipe/miniature/seeds.sh 1        # seed 1: data, the untrained evaluation, the format warm-up (rollouts,
#                                           #   SFT data, SFT), the warmed evaluation, RL, merge, RL evaluation, report
#   bash recipe/miniature/seeds.sh 2        # seed 2: RL from seed 1's warmed model on seed 1's data, merge, RL
#   bash recipe/miniature/seeds.sh 3        #   evaluation, report over every seed packed so far (same for 3)
#   bash recipe/miniature/seeds.sh all      # the seeds in turn; stops at the first one that does not finish
#   bash recipe/miniature/seeds.sh report   # only the report over every seed's pack
#
# Each command continues where the last one stopped (pipeline.sh all skips finished stages and resumes the RL
# training from its latest checkpoint): run it again until $STUDY/seedN/DONE exists. Exit codes: 0 done, 3 paused
# (training stopped by MAX_WALL: run again), 2 usage or a missing prerequisite, 1 a failed stage.
#
# Environment (defaults in brackets):
#   STUDY [runs/study]     the study folder: seed{N}/ (a pipeline.sh ROOT each), report/
#   SEEDS [1 2 3]          the training seeds (for all and report); the first one is the base seed, whose run
#                          holds the data, the baselines (untrained-memory, untrained-direct, warmed-memory) and the
#                          warmed model that every seed's RL starts from
#   REPORT_OUT [$STUDY/report]  where the report goes
# Everything else is passed on to pipeline.sh (MODEL_PATH, PYTHON, TRAIN_STEPS, MAX_WALL, RL_SHARDS, EVAL_ARGS, ...).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
STUDY="${STUDY:-runs/study}"
read -r -a SEED_LIST <<< "${SEEDS:-1 2 3}"
BASE="${SEED_LIST[0]}"
export REPORT_OUT="${REPORT_OUT:-$STUDY/report}"

packs() {  # packs [EXCEPT_SEED]: every seed's pack that exists, one a line
    local s
    for s in "${SEED_LIST[@]}"; do
        [ "$s" != "${1:-}" ] && [ -f "$STUDY/seed$s/records.jsonl.gz" ] && echo "$STUDY/seed$s/records.jsonl.gz"
    done
}

run_seed() {  # run_seed SEED: pipeline.sh all in $STUDY/seed$SEED
    local seed=$1 root="$STUDY/seed$1" base_root="$STUDY/seed$BASE"
    [[ "$seed" =~ ^[0-9]+$ ]] || { echo "seed $seed: expected a non-negative integer" >&2; return 2; }
    mkdir -p "$root"
    echo "[seeds] $(date +%T) seed $seed in $root" >&2
    local others
    others=$(packs "$seed" | tr '\n' ' ')
    if [ "$seed" = "$BASE" ]; then
        ROOT="$root" TRAIN_SEED="$seed" REPORT_RECORDS="$others" bash recipe/miniature/pipeline.sh all
    else
        later_seed "$seed" "$root" "$base_root" "$others"
    fi
    local rc=$?
    [ "$rc" = 0 ] && [ -f "$root/FAILED" ] && rc=1
    return "$rc"
}

later_seed() {  # later_seed SEED ROOT BASE_ROOT OTHERS: a seed after the base one
    local seed=$1 root=$2 base_root=$3 others=$4
    [ -f "$base_root/warmed_model/config.json" ] || {
        echo "seed $seed starts from seed $BASE's warmed model, and $base_root/warmed_model has none yet:" \
            "run recipe/miniature/seeds.sh $BASE first (at least up to its sft stage)" >&2
        return 2
    }
    [ -e "$root/data" ] || ln -s "$(cd "$base_root/data" && pwd)" "$root/data"  # the same questions
    ROOT="$root" TRAIN_SEED="$seed" WARMED_MODEL="$(cd "$base_root/warmed_model" && pwd)" EVAL_UNTRAINED=0 \
        EVAL_WARMED=0 REPORT_RECORDS="$others" bash recipe/miniature/pipeline.sh all
}

report() {
    local all_packs
    all_packs=$(packs | tr '\n' ' ')
    [ -n "$all_packs" ] || { echo "no packed seed under $STUDY (seed*/records.jsonl.gz)" >&2; return 2; }
    read -r -a PY <<< "${PYTHON:-python3}"
    # shellcheck disable=SC2086  # one path a word
    "${PY[@]}" -m recipe.miniature.report --records $all_packs --out "$REPORT_OUT"
}

case "${1:-}" in
    all)
        for seed in "${SEED_LIST[@]}"; do
            run_seed "$seed" || exit $?
        done
        ;;
    report) report ;;
    "") echo "usage: seeds.sh SEED | all | report (see the header of $0)" >&2; exit 2 ;;
    *) run_seed "$1" ;;
esac
