#!/usr/bin/env bash
# Does the CE gap to the control close with more tokens? Both runs of `run.sh MODEL` continued past their end:
#
#   experiments/robust/recovery.sh [--dry-run] MODEL STEPS        MODEL: gemma3; e.g. STEPS 500
#
# 1. each run (the removal and its vanilla control) branched from its last checkpoint by branch.sh, with one
#    difference from it: max_steps grows by STEPS. The learning rate stays at its floor and every loss, replay
#    and mined id goes on as at the end; the removal's scale ceiling is released at its new last step, as the
#    run's was at its own (trained on without it, the finished removal's loss is non-finite at its first step;
#    a vanilla run has no fixed norm for a ceiling to bound). The two train side by side on half the cores
#    each and resume when run again. Weights in runs/robust/MODEL/recovery-STEPS/{ln_free,vanilla}.
# 2. lnfree eval of the four models (each run's end, each continued run's end) on the validation half
#    (realtext-val: selection data, never the test half), into experiments/results/<model>/robust/recovery-STEPS/:
#    pairwise.csv has the gap at the end and after the STEPS more steps, with block-bootstrap CIs. The
#    in-training evaluations (64 validation sequences every eval_every steps) are in each branch's log.jsonl.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
if [[ ${1:-} == --dry-run ]]; then DRY_RUN=1; shift; fi
name=${1:-} steps=${2:-}
case "$name" in
  gemma3) model=gemma3-270m ;;
  *) die "the first argument must be a model of experiments/robust/ (gemma3), got '$name'" ;;
esac
[[ $steps =~ ^[1-9][0-9]*$ ]] || die "the second argument must be a number of steps, got '$steps'"
runs=runs/robust/$name
branches=$runs/recovery-$steps
out=$RESULTS/$model/robust/recovery-$steps
context=$(cd "$REPO_ROOT" && "$(python_bin)" -c "import tomllib,sys; print(tomllib.load(open(sys.argv[1],'rb'))['data']['context_length'])" "experiments/robust/$name.toml")

last_step() {  # last_step RUN: the step of RUN's newest checkpoint (a finished run's last)
  [[ -f $REPO_ROOT/$1/summary.json ]] || die "$1 is not a finished run: run experiments/robust/run.sh $name first"
  local newest
  newest=$(ls "$REPO_ROOT/$1/checkpoints" | sort | tail -n 1)
  echo $((10#${newest#step_}))
}

continue_run() {  # continue_run ARM: branch the run ARM from its end (or resume the branch)
  local arm=$1 from=$runs/$1 step cosine
  if [[ $DRY_RUN == 1 ]]; then
    echo "+ experiments/robust/branch.sh $from LAST $branches/$arm --set train.max_steps=LAST+$steps --set train.cosine_steps=..." \
      "$([[ $arm == ln_free ]] && echo "--set removal.scale_ceiling.release_start=LAST+$((steps - 1))")"
    return 0
  fi
  step=$(last_step "$from")
  [[ -f $REPO_ROOT/$branches/$arm/summary.json ]] && { echo "$branches/$arm is finished"; return 0; }
  # the learning-rate curve to `step` stays the run's: its cosine keeps its length (the run's max_steps if it had none)
  cosine=$(cd "$REPO_ROOT" && "$(python_bin)" -c "import json,sys; t=json.load(open(sys.argv[1]))['train']; \
print(t['cosine_steps'] or t['max_steps'])" "$from/run_config.json")
  local release=()
  [[ $arm == ln_free ]] && release=(--set "removal.scale_ceiling.release_start=$((step + steps - 1))")
  run "$branches/$arm" experiments/robust/branch.sh "$from" "$step" "$branches/$arm" \
    --set "train.max_steps=$((step + steps))" --set "train.cosine_steps=$cosine" "${release[@]}" \
    || [[ -f $REPO_ROOT/$branches/$arm/summary.json ]]
}
continue_ln_free() { continue_run ln_free; }
continue_vanilla() { continue_run vanilla; }
side_by_side "$branches" continue_ln_free continue_vanilla
run "$out" lnfree eval "$runs/vanilla" "$runs/ln_free" "$branches/vanilla" "$branches/ln_free" \
  --labels vanilla ln_free "vanilla+$steps" "ln_free+$steps" --dataset realtext-val --context "$context" \
  --batch-size 4 --out "$out" --overwrite
