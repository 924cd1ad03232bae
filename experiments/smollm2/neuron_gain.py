"""Each MLP neuron's gain in weight space (`lnfree.removal.losses.gain`), against its block's median.

    python experiments/smollm2/neuron_gain.py [MODEL_OR_CHECKPOINT ...] [--labels ...] [--out DIR]

A gated neuron with a fixed input norm writes s² × its gain for an input of scale s in its worst direction
(|gate|·|up|·(1 + |cos|)/2·|down|, the input norm's weight folded in). This lists, per block and model, the
largest gains over the block's median and where the neurons that the SmolLM2 diagnostics name stand:
block 2's 90 and 430 (writers of the tokens that run away once ln_2 are fixed, `runaway_origin/`), block 1's 83,
2's 701 and 3's 667 (what rebuilt that path when 90 and 430 were damped), and the massive-activation writers
and erasers of position 0 (11: 1229, 1487; 27: 903; 28: 678). Default model: the original SmolLM2-135M.
Writes results.json and tables.md to --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lnfree.forms.load import load
from lnfree.removal.losses.gain import GainWeights
from lnfree.evaluate.results import write_experiment

NAMED = {1: [83], 2: [90, 430, 701], 3: [667], 11: [1229, 1487], 27: [903], 28: [678]}


@torch.no_grad()
def gain_table(model, top: int) -> list[dict]:
    """Per block: the median gain, the `top` largest over it, and the named neurons' ratio and rank."""
    rows = []
    for layer, gain in enumerate(GainWeights(model).gains()):
        median = gain.median()
        ratio = gain / median
        order = torch.argsort(ratio, descending=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order))
        rows.append({"block": layer, "median": float(median),
                     "top": [[int(i), round(float(ratio[i]), 2)] for i in order[:top]],
                     "named": {str(i): {"ratio": round(float(ratio[i]), 2), "rank": int(rank[i])}
                               for i in NAMED.get(layer, [])}})
    return rows


def markdown(label: str, rows: list[dict]) -> list[str]:
    lines = [f"## {label}", "", "| block | largest gains / block median (neuron: ratio) | named neurons (ratio, rank) |",
             "|---|---|---|"]
    for row in rows:
        top = ", ".join(f"{i}: {r:.1f}" for i, r in row["top"])
        named = ", ".join(f"{i}: {v['ratio']:.1f} (#{v['rank'] + 1})" for i, v in row["named"].items())
        lines.append(f"| {row['block']} | {top} | {named} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["smollm2-135m"])
    parser.add_argument("--labels", nargs="*")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/smollm2-135m/neuron_gain"))
    args = parser.parse_args()
    labels = args.labels or args.models
    if len(labels) != len(args.models):
        parser.error("give one label per model")
    results = {label: gain_table(load(name).model, args.top) for label, name in zip(labels, args.models)}
    lines = ["# MLP neuron gains over their block's median", "",
             "By `experiments/smollm2/neuron_gain.py`: gain = |gate|·|up|·(1 + |cos(gate, up)|)/2·|down| with the "
             "MLP-input norm's weight folded in (what a neuron writes per squared input scale in its worst "
             "direction once that norm is fixed). Ranks count from 1 within the block.", ""]
    for label, rows in results.items():
        lines += markdown(label, rows)
    write_experiment(results, lines, args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
