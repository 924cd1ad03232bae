"""Paired CE differences over the sequences on which every model is finite, from `lnfree eval`'s per-model CSVs.

    python experiments/robust/paired_finite.py experiments/results/gemma3-270m/robust/teacher1400/paired_finite.md \
        experiments/results/gemma3-270m/robust/teacher1400/{vanilla,ln_free,ln_free_teacher1400}.csv

Where one model is non-finite on some sequence, `lnfree eval`'s means and pairwise table are NaN; this reads the
per-sequence means of each LABEL.csv (the models' rows of the same dataset, from one or several `lnfree eval`
folders), drops the sequences any model fails on (listed), and gives each model's mean and each pair's difference
(later minus earlier) with the 95 % circular moving-block bootstrap of `lnfree eval`
(`lnfree.evaluate.results.bootstrap_ci`, its default block length over the sequences kept, 1,000 resamples, seed 0).
Writes OUT and prints it.
"""

from __future__ import annotations

import argparse
import csv
from itertools import combinations
from pathlib import Path

import numpy as np

from lnfree.evaluate.results import auto_block, bootstrap_ci


def weighted_difference(units: np.ndarray) -> float:
    """b's token-weighted mean CE minus a's, over rows of (a's CE sum, a's tokens, b's CE sum, b's tokens)."""
    return units[:, 2].sum() / units[:, 3].sum() - units[:, 0].sum() / units[:, 1].sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("csvs", type=Path, nargs="+")
    args = parser.parse_args()
    ce = {}
    for path in args.csvs:
        rows = list(csv.DictReader(open(path)))
        ce[path.stem] = [(float(r["mean_ce"]) if r["mean_ce"] else None, int(r["scored_tokens"])) for r in rows]
    labels = list(ce)
    n_all = len(ce[labels[0]])
    if any(len(rows) != n_all for rows in ce.values()):
        raise SystemExit("the CSVs hold different numbers of sequences: not the same dataset")
    keep = [i for i in range(n_all) if all(ce[label][i][0] is not None for label in labels)]
    dropped = sorted(set(range(n_all)) - set(keep))

    def mean(label: str, idx: list[int]) -> float:
        return sum(ce[label][i][0] * ce[label][i][1] for i in idx) / sum(ce[label][i][1] for i in idx)

    lines = [f"Sequences: {len(keep)} of {n_all} (dropped, non-finite in some model: {dropped})", "",
             "| model | mean CE |", "|---|---|"]
    lines += [f"| {label} | {mean(label, keep):.4f} |" for label in labels]
    lines += ["", "| a | b | b − a | 95 % CI |", "|---|---|---|---|"]
    for a, b in combinations(labels, 2):
        # one unit per kept sequence: a's CE sum and tokens, then b's; the statistic is the token-weighted difference
        units = np.array([[ce[m][i][0] * ce[m][i][1], ce[m][i][1]] for i in keep for m in (a, b)]).reshape(-1, 4)
        low, high = bootstrap_ci(units, statistic=weighted_difference, block=auto_block(len(keep)))
        lines.append(f"| {a} | {b} | {mean(b, keep) - mean(a, keep):+.4f} | [{low:+.4f}, {high:+.4f}] |")
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
