"""Where an analysis's memory goes: resident memory after each stage of loading a model and building its
TransformerLens bridge (issue 38's analyze peaks).

In one fresh process per model (one thread): the process's resident set (VmRSS) and its peak (VmHWM)
after `lnfree.analysis.common.load_models`, after building the bridge (`AnalysisModel.bridge`), after a
DLA of 4 × 64 random ids and after releasing the bridge (`release_bridge`, which collects). Writes
`benchmarks/results/bridge_memory.json` / `.txt`. The models' weights must be installed.

    python benchmarks/bridge_memory.py [MODEL ...]   # default: gemma3-270m qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def memory_gb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process, GB."""
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024 / 1e9
    return fields["VmRSS"], fields["VmHWM"]


def measure(name: str) -> dict:
    """The stages of one model, in this process."""
    import torch

    from lnfree.analysis.common import load_models
    from lnfree.analysis.dla import dla_and_direct_effect

    stages = {"start": memory_gb()}
    model = load_models([name])[0]
    parameters = sum(p.numel() for p in {id(p): p for p in model.loaded.model.parameters()}.values())
    stages["model loaded"] = memory_gb()
    bridge = model.bridge()
    stages["bridge built"] = memory_gb()
    ids = torch.randint(0, min(5000, bridge.cfg.d_vocab), (4, 64), generator=torch.Generator().manual_seed(0))
    dla_and_direct_effect(bridge, ids, batch_size=4)
    stages["DLA of 4 × 64 ids"] = memory_gb()
    del bridge
    model.release_bridge()
    stages["bridge released"] = memory_gb()
    return {"model": name, "parameters": parameters, "fp32_weights_gb": 4 * parameters / 1e9,
            "stages": {k: {"rss_gb": r, "peak_gb": h} for k, (r, h) in stages.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["gemma3-270m", "qwen2.5-coder-0.5b"])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/bridge_memory")
    args = parser.parse_args()
    if args.one:
        return print(json.dumps(measure(args.one)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results = []
    for name in args.models:
        done = subprocess.run([sys.executable, __file__, "--one", name], env=env, check=True, capture_output=True, text=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    lines = ["# Resident memory of loading a model and building its TransformerLens bridge (GB; one process per model)",
             "", "| model | parameters (fp32 GB) | stage | resident | peak so far |", "|---|---|---|---|---|"]
    for r in results:
        for stage, m in r["stages"].items():
            lines.append(f"| {r['model']} | {r['parameters'] / 1e6:.0f}M ({r['fp32_weights_gb']:.2f}) | {stage} | "
                         f"{m['rss_gb']:.2f} | {m['peak_gb']:.2f} |")
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
