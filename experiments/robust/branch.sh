#!/usr/bin/env bash
# Branch a pilot arm from a checkpoint of another run (issue 37: one difference from the run it leaves):
#
#   experiments/robust/branch.sh FROM_RUN STEP NEW_RUN [--set key=value ...]
#
# NEW_RUN gets FROM_RUN's run config, start record, tokenizer and log, its step-STEP checkpoint
# (hard-linked: no copy of the weights) and the ids its coverage mined by STEP, then resumes with the
# --set amendments, which `lnfree.amend` accepts only where they change steps from STEP on (a
# step-dependent loss with start >= STEP, a later schedule, a learning-rate restart). Until STEP the new
# run *is* the old one; its log says so (a `resume` and an `amend` record).
# Running it again resumes NEW_RUN where it stopped (the amendments are then already its config).
# Example (the neuron-range arm of experiments/results/gemma3-270m/robust/):
#   experiments/robust/branch.sh runs/robust/gemma3/ln_free 950 runs/robust/gemma3/range950 \
#       --set 'train.neuron_range={"ratio": 8, "weight": 1.0, "start": 950}'
set -euo pipefail
from=${1:?FROM_RUN} step=${2:?STEP} new=${3:?NEW_RUN}
shift 3
checkpoint=$(printf "step_%06d" "$step")
if [[ ! -d $new/checkpoints ]]; then
  [[ -d $from/checkpoints/$checkpoint ]] || { echo "no $from/checkpoints/$checkpoint" >&2; exit 2; }
  mkdir -p "$new/checkpoints"
  cp -r "$from/run_config.json" "$from/start.json" "$from/tokenizer" "$from/log.jsonl" "$new/"
  cp -al "$from/checkpoints/$checkpoint" "$new/checkpoints/$checkpoint"
  if [[ -f $from/mined_ids.json ]]; then  # what train.coverage.mine found by STEP is the branch's own past: a
    # setting starting at STEP mines before that step's training, from the weights the checkpoint holds, unless
    # the branch amends train.coverage (then its own settings mine again when it resumes there)
    last=$step
    [[ "$*" == *train.coverage* ]] && last=$((step - 1))
    python - "$from/mined_ids.json" "$new/mined_ids.json" "$last" <<'PY'
import json, sys
found = json.load(open(sys.argv[1]))
json.dump({start: ids for start, ids in found.items() if int(start) <= int(sys.argv[3])}, open(sys.argv[2], "w"))
PY
  fi
  exec lnfree remove --config "$new/run_config.json" -o "$new" --resume "$@"
fi
exec lnfree remove --config "$new/run_config.json" -o "$new" --resume
