#!/usr/bin/env bash
# Direct logit attribution vs direct effect (per-head and global NMAE with bootstrap CIs).
#
#   experiments/dla/run.sh [--dry-run] [SIZE] [SOURCE]
#     SIZE    gpt2 (default) | gpt2-medium | gpt2-large | gpt2-xl   (or small | medium | large | xl)
#     SOURCE  hub (default: the released P25 checkpoints) | local (experiments/removal/run.sh outputs)
#
# Config: config.toml next to this script. Writes experiments/results/dla/SIZE-SOURCE/.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../lib.sh"
run_analysis "$here" "$@"
