#!/usr/bin/env bash
# Attribution vs activation patching agreement on IOI (per-prompt NMAE and Pearson r, bootstrap CIs).
#
#   experiments/patching/run.sh [--dry-run] [SIZE] [SOURCE]
#     SIZE    gpt2 (default) | gpt2-medium | gpt2-large | gpt2-xl   (or small | medium | large | xl)
#     SOURCE  hub (default: the released P25 checkpoints) | local (experiments/removal/run.sh outputs)
#
# Config: config.toml next to this script. Writes experiments/results/patching/SIZE-SOURCE/.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../lib.sh"
run_analysis "$here" "$@"
