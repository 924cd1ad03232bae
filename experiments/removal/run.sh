#!/usr/bin/env bash
# LayerNorm removal for one GPT-2 size plus its vanilla fine-tuning control (P25 Table 1).
#
#   experiments/removal/run.sh [--dry-run] [SIZE] [NPROC] [WHICH]
#     SIZE   gpt2 (default) | gpt2-medium | gpt2-large | gpt2-xl   (or small | medium | large | xl)
#     NPROC  GPUs on this node (default 1; >1 launches torchrun DDP)
#     WHICH  both (default) | lnfree | vanilla
#
# Config: the shipped preset lnfree/presets/SIZE.toml, unchanged, for the LN-free run. The control is
# the same preset with --mode vanilla: identical data, optimiser, schedule length and auxiliary loss,
# nothing removed (lnfree's control; see experiments/README.md).
# Writes experiments/results/removal/SIZE-lnfree/ (LN-free export in export/) and SIZE-vanilla/.
# A run that stopped part-way is continued with --resume; a finished one (summary.json) is skipped.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

if [[ ${1:-} == --dry-run ]]; then DRY_RUN=1; shift; fi
preset=$(preset_for "${1:-gpt2}")
nproc=${2:-1}
which=${3:-both}
[[ $nproc =~ ^[1-9][0-9]*$ ]] || die "NPROC must be a positive integer, got '$nproc'"
[[ $which =~ ^(both|lnfree|vanilla)$ ]] || die "WHICH must be both, lnfree or vanilla, got '$which'"

if ((nproc > 1)); then
  launch=(torchrun --nproc_per_node "$nproc" -m lnfree)
else
  launch=(lnfree)
fi

removal_run() {  # removal_run TAG EXTRA_ARGS...
  local out="$RESULTS/removal/$preset-$1"
  shift
  local resume=()
  if [[ -f $REPO_ROOT/$out/summary.json ]]; then
    echo "$out is finished (summary.json); delete it to run again"
    return 0
  elif [[ -f $REPO_ROOT/$out/run_config.json ]]; then
    resume=(--resume)
  fi
  run "$out" "${launch[@]}" remove --preset "$preset" "$@" -o "$out" "${resume[@]}"
}

if [[ $which != vanilla ]]; then
  removal_run lnfree
fi
if [[ $which != lnfree ]]; then
  removal_run vanilla --mode vanilla
fi
