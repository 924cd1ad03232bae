#!/usr/bin/env bash
# A real model by name, measured as it is: held-out CE, every analysis, and its norms fixed without
# fine-tuning, kind by kind (fix_by_kind.py). Results in runs/MODEL/results/{original,fix_by_kind}/;
# with --results in experiments/results/MODEL/ (the committed results, which this replaces).
#
#   experiments/modern/original.sh [--dry-run] [--results] MODEL     # gemma3-270m, qwen2.5-coder-0.5b, smollm2-135m, …
#
# The models' wheels: docs/how-to/modern-models.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
root=runs
while [[ ${1:-} == --* ]]; do
  case $1 in
    --dry-run) DRY_RUN=1 ;;
    --results) root=$RESULTS ;;
    *) die "unknown option '$1' (--dry-run, --results)" ;;
  esac
  shift
done
model=${1:?give a model name, e.g. gemma3-270m}
out=$root/$model
[[ $root == runs ]] && out=runs/$model/results
run "$out/original/eval" lnfree eval "$model" --labels original --dataset realtext --context 64 --n-sequences 66 \
  --out "$out/original/eval" --overwrite
run "$out/original/analysis" lnfree analyze all --models "$model" --labels original --dataset realtext --n-sequences 8 \
  --length 64 --n-prompts 8 --n-bootstrap 200 --batch-size 4 --device cpu --out "$out/original/analysis" --overwrite
run "$out/fix_by_kind" "$(python_bin)" experiments/modern/fix_by_kind.py --model "$model" --out "$out/fix_by_kind"
