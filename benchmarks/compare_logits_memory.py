"""Peak memory of an export's logit check (`lnfree.removal.losses.probe.compare_logits`) at Gemma 3's vocabulary.

A removal's export compares the exported model's logits with the installed model's on its probe rows. One run's
export was killed for memory at the end of training (issue 37); this measures the check alone, without a model: two
callables return 64-token rows of 262,144 logits, 8 rows compared, in a fresh process each (one thread), once with
every row in one batch (as before `COMPARE_LOGITS`) and once as lnfree does now. Prints the peak resident set
(VmHWM) of each and their ratio; writes `benchmarks/results/compare_logits_memory.json` / `.txt`.

    python benchmarks/compare_logits_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bridge_memory import memory_gb  # this folder's helper (run as a script, its folder is on the path)

ROOT = Path(__file__).resolve().parents[1]
ROWS, LENGTH, VOCAB = 8, 64, 262_144


def measure(setting: str) -> dict:
    """compare_logits on ROWS rows in this process: 'one batch' (the limit lifted) or 'lnfree' (its default)."""
    import torch

    from lnfree.removal.losses import probe

    if setting == "one batch":
        probe.COMPARE_LOGITS = ROWS * LENGTH * VOCAB
    table = torch.randn(LENGTH, VOCAB, generator=torch.Generator().manual_seed(0))
    ids = torch.zeros(ROWS, LENGTH, dtype=torch.long)
    before = memory_gb()[0]
    measured = probe.compare_logits(lambda x: table.expand(len(x), -1, -1) + 1e-3,
                                    lambda x: table.expand(len(x), -1, -1), ids)
    return {"setting": setting, "rss_before_gb": before, "peak_gb": memory_gb()[1],
            "max_abs_diff": measured["max_abs_diff"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one)))
        return
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    results = [json.loads(subprocess.run([sys.executable, __file__, "--one", setting], env=env, check=True,
                                         capture_output=True, text=True).stdout.splitlines()[-1])
               for setting in ("one batch", "lnfree")]
    old, new = results
    lines = [f"compare_logits on {ROWS} rows × {LENGTH} tokens × {VOCAB:,} logits (fp32 in, fp64 inside), one thread",
             *(f"  {r['setting']:>9}: peak RSS {r['peak_gb']:.2f} GB (before the check {r['rss_before_gb']:.2f} GB)"
               for r in results),
             f"  ratio: {old['peak_gb'] / new['peak_gb']:.1f}× less at the peak; the same result "
             f"(max |Δ| {old['max_abs_diff']:.1e} and {new['max_abs_diff']:.1e})"]
    print("\n".join(lines))
    out = ROOT / "benchmarks/results/compare_logits_memory"
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
