#!/usr/bin/env bash
# Mean (and median / percentile) cross-entropy of original, vanilla FT and LN-free GPT-2 (P25 Table 1).
#
#   experiments/eval_table/run.sh [--dry-run] [SIZE] [SOURCE]
#     SIZE    gpt2 (default) | gpt2-medium | gpt2-large | gpt2-xl   (or small | medium | large | xl)
#     SOURCE  hub (default: the released P25 checkpoints) | local (experiments/removal/run.sh outputs)
#
# Config: config.toml next to this script (datasets, sequences, context).
# Writes experiments/results/eval_table/SIZE-SOURCE/DATASET/ (per-model JSON/CSV, markdown table).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../lib.sh"

if [[ ${1:-} == --dry-run ]]; then DRY_RUN=1; shift; fi
preset=$(preset_for "${1:-gpt2}")
source=${2:-hub}
resolve_models "$preset" "$source"
context=$(toml_get "$here/config.toml" context)

datasets=$("$(python_bin)" - "$here/config.toml" <<'PY'
import sys, tomllib
for d in tomllib.load(open(sys.argv[1], "rb"))["datasets"]:
    print(d["name"], d["n_sequences"])
PY
)
mapfile -t rows <<<"$datasets"
for row in "${rows[@]}"; do
  read -r dataset n_sequences <<<"$row"
  out="$RESULTS/eval_table/$preset-$source/$dataset"
  run "$out" lnfree eval "$ORIGINAL" "$VANILLA" "$LN_FREE" --labels original vanilla ln_free \
    --dataset "$dataset" --n-sequences "$n_sequences" --context "$context" --out "$out" --overwrite
done
