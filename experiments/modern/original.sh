#!/usr/bin/env bash
# A real model by name, measured as it is: held-out CE, every analysis, and its norms fixed without
# fine-tuning, kind by kind (fix_by_kind.py). Results in experiments/results/MODEL/{original,fix_by_kind}/.
#
#   experiments/modern/original.sh [--dry-run] MODEL     # gemma3-270m, qwen2.5-coder-0.5b, smollm2-135m, …
#
# The models' wheels: README ("SmolLM2-135M offline", "Gemma 3 270M and Qwen2.5-Coder-0.5B offline").
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
if [[ ${1:-} == --dry-run ]]; then DRY_RUN=1; shift; fi
model=${1:?give a model name, e.g. gemma3-270m}
out=$RESULTS/$model
run "$out/original/eval" lnfree eval "$model" --labels original --dataset realtext --context 64 --n-sequences 66 \
  --out "$out/original/eval"
run "$out/original/analysis" lnfree analyze all --models "$model" --labels original --data realtext --n-sequences 8 \
  --length 64 --n-prompts 8 --n-bootstrap 200 --batch-size 4 --device cpu --out "$out/original/analysis"
run "$out/fix_by_kind" "$(python_bin)" experiments/modern/fix_by_kind.py --model "$model"
