# Shared by the experiments/*/run.sh scripts (sourced, not run). Bash only.
#
# Every script takes positional arguments only:  [--dry-run] SIZE [SOURCE ...]
#   SIZE    gpt2 | gpt2-medium | gpt2-large | gpt2-xl   (or small | medium | large | xl; default gpt2)
#   SOURCE  hub   : the released checkpoints of P25 (schaeff/gpt2-*_vanilla*, schaeff/gpt2-*_LNFree*)
#           local : your own runs of experiments/removal/run.sh (experiments/results/removal/...)
# --dry-run prints the commands without running them.
# Commands run from the repository root, with repository-relative paths.

EXPERIMENTS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$EXPERIMENTS_DIR/.." && pwd)"
RESULTS="experiments/results"
DRY_RUN=0

die() { echo "error: $*" >&2; exit 2; }

python_bin() { command -v python || command -v python3 || die "no python on PATH (activate the venv)"; }

# preset_for SIZE -> the lnfree preset name
preset_for() {
  case "${1:-gpt2}" in
    gpt2 | small) echo gpt2 ;;
    gpt2-medium | medium) echo gpt2-medium ;;
    gpt2-large | large) echo gpt2-large ;;
    gpt2-xl | xl) echo gpt2-xl ;;
    *) die "unknown size '$1' (gpt2 | gpt2-medium | gpt2-large | gpt2-xl, or small | medium | large | xl)" ;;
  esac
}

# Names of the released P25 checkpoints: schaeff/gpt2-<tag>_{vanilla,LNFree}<step>.
hub_tag() { case "$1" in gpt2) echo small ;; gpt2-medium) echo medium ;; gpt2-large) echo large ;; gpt2-xl) echo xl ;; esac; }
release_step() { case "$1" in gpt2) echo 300 ;; gpt2-medium) echo 500 ;; gpt2-large) echo 600 ;; gpt2-xl) echo 800 ;; esac; }

# resolve_models PRESET SOURCE -> sets ORIGINAL, VANILLA, LN_FREE (labels: original vanilla ln_free)
resolve_models() {
  local preset=$1 source=$2
  ORIGINAL="openai-community/$preset"
  case "$source" in
    hub)
      VANILLA="schaeff/gpt2-$(hub_tag "$preset")_vanilla$(release_step "$preset")"
      LN_FREE="schaeff/gpt2-$(hub_tag "$preset")_LNFree$(release_step "$preset")"
      ;;
    local)
      VANILLA="$RESULTS/removal/$preset-vanilla"           # run folder: its latest checkpoint is loaded
      LN_FREE="$RESULTS/removal/$preset-lnfree/export"     # the eps-trick export of the LN-free run
      if [[ $DRY_RUN == 0 ]]; then
        [[ -f $REPO_ROOT/$VANILLA/summary.json ]] || die "$VANILLA is not a finished run: run experiments/removal/run.sh $preset first"
        [[ -d $REPO_ROOT/$LN_FREE ]] || die "$LN_FREE does not exist: run experiments/removal/run.sh $preset first"
      fi
      ;;
    *) die "unknown model source '$source' (hub | local)" ;;
  esac
}

# toml_get FILE KEY -> the value (lists space-separated; missing key -> empty)
toml_get() {
  "$(python_bin)" - "$1" "$2" <<'PY'
import sys, tomllib
value = tomllib.load(open(sys.argv[1], "rb")).get(sys.argv[2])
if value is not None:
    print(" ".join(map(str, value)) if isinstance(value, list) else value)
PY
}

# run OUT CMD... : print the command, run it from the repository root, then record it in OUT/command.txt
run() {
  local out=$1
  shift
  echo "+ $*"
  [[ $DRY_RUN == 1 ]] && return 0
  # `|| return`: called as `run … || …` (set -e is off there) a failed command would otherwise go unnoticed
  (cd "$REPO_ROOT" && "$@") || return
  mkdir -p "$REPO_ROOT/$out"
  { printf '%q ' "$@"; echo; } >"$REPO_ROOT/$out/command.txt"
}

# run_analysis FOLDER [--dry-run] [SIZE] [SOURCE]: one `lnfree analyze` run configured by FOLDER/config.toml
run_analysis() {
  local folder=$1
  shift
  if [[ ${1:-} == --dry-run ]]; then DRY_RUN=1; shift; fi
  local preset source name config
  preset=$(preset_for "${1:-gpt2}")
  source=${2:-hub}
  resolve_models "$preset" "$source"
  name=$(basename "$folder")
  config="$folder/config.toml"
  local out="$RESULTS/$name/$preset-$source"
  local args=(lnfree analyze "$(toml_get "$config" analysis)"
    --models "$ORIGINAL" "$VANILLA" "$LN_FREE" --labels original,vanilla,ln_free)
  local key value
  for key in data n_sequences length n_prompts batch_size seed; do
    value=$(toml_get "$config" "$key")
    [[ -n $value ]] && args+=("--${key//_/-}" "$value")
  done
  args+=(--out "$out" --overwrite)  # a rerun replaces the analysis there (run() records command.txt beside it)
  run "$out" "${args[@]}"
}

# side_by_side LOGS FUNCTION...: run shell functions at once, each on an equal share of the cores
# (OMP_NUM_THREADS) and with its output in LOGS/FUNCTION.log (LOGS relative to the repository root): two torch
# processes that each take every core slow each other several-fold. One after the other, output to the
# terminal, on a machine with fewer cores than functions or in a dry run. Fails if any of them fails; no
# function, nothing to do.
side_by_side() {
  local logs=$1
  shift
  (( $# )) || return 0
  local share=$(( $(nproc) / $# )) pids=() f status=0
  if (( share < 1 )) || [[ $DRY_RUN == 1 ]]; then
    for f in "$@"; do "$f"; done
    return 0
  fi
  mkdir -p "$REPO_ROOT/$logs"
  for f in "$@"; do
    echo "$f: $share thread(s), output in $logs/$f.log"
    OMP_NUM_THREADS=$share "$f" >"$REPO_ROOT/$logs/$f.log" 2>&1 &
    pids+=($!)
  done
  for f in "${pids[@]}"; do wait "$f" || status=1; done
  return $status
}
