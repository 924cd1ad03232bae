#!/usr/bin/env bash
# Residual norms at position 0 vs the rest, attention sinks, CE/entropy/JSD/ECE between models.
#
#   experiments/residual_sinks/run.sh [--dry-run] [SIZE] [SOURCE]
#     SIZE    gpt2 (default) | gpt2-medium | gpt2-large | gpt2-xl   (or small | medium | large | xl)
#     SOURCE  hub (default: the released P25 checkpoints) | local (experiments/removal/run.sh outputs)
#
# Config: config.toml next to this script. Writes experiments/results/residual_sinks/SIZE-SOURCE/.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../lib.sh"
run_analysis "$here" "$@"
