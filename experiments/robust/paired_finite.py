"""Paired CE differences over the sequences on which every model is finite, from `lnfree eval`'s per-model CSVs.

    python experiments/robust/paired_finite.py experiments/results/gemma3-270m/robust/teacher1400/paired_finite.md \
        experiments/results/gemma3-270m/robust/teacher1400/{vanilla,ln_free,ln_free_teacher1400}.csv

Where one model is non-finite on some sequence, `lnfree eval`'s means and pairwise table are NaN; this reads the
per-sequence means of each LABEL.csv (the models' rows of the same dataset, from one or several `lnfree eval`
folders; `NAME=PATH` names a table whose file name another one shares), drops the sequences any model fails on
(listed), and gives each model's mean and each pair's difference (later minus earlier) with the 95 % circular
moving-block bootstrap of `lnfree eval` (`lnfree.evaluate.results.bootstrap_ci`, its default block length over the
sequences kept, 1,000 resamples, seed 0). With `--gaps CONTROL:MODEL ...`, also each gap (MODEL − CONTROL) and
each pair of gaps' difference, resampled together: whether one removal config's gap to its own control is smaller
than another's on the same sequences; with two gaps or more also their mean (for one recipe's seeds, its gap over
runs). Writes OUT and prints it.
"""

from __future__ import annotations

import argparse
import csv
from functools import partial
from itertools import combinations
from pathlib import Path

import numpy as np

from lnfree.evaluate.results import auto_block, bootstrap_ci


def signed_means(units: np.ndarray, signs: tuple[float, ...]) -> float:
    """Σ sign × token-weighted mean CE, over rows of (CE sum, tokens) per model, one model after another."""
    return sum(s * units[:, 2 * k].sum() / units[:, 2 * k + 1].sum() for k, s in enumerate(signs))


def read_tables(specs: list[str]) -> dict[str, list[tuple[float | None, int]]]:
    """{label: [(mean CE or None, scored tokens) per sequence]} of `lnfree eval` CSVs given as PATH or NAME=PATH."""
    ce = {}
    for spec in specs:
        name, _, path = spec.rpartition("=")
        label = name or Path(path).stem
        if label in ce:
            raise SystemExit(f"two tables are named '{label}': name one as NAME=PATH")
        rows = list(csv.DictReader(open(path)))
        ce[label] = [(float(r["mean_ce"]) if r["mean_ce"] else None, int(r["scored_tokens"])) for r in rows]
    if len({len(rows) for rows in ce.values()}) > 1:
        raise SystemExit("the CSVs hold different numbers of sequences: not the same dataset")
    return ce


def compare(ce: dict, gaps: list[tuple[str, str]]) -> str:
    """The markdown report: means, pairwise differences and (for `gaps`) gaps and their differences."""
    labels = list(ce)
    n_all = len(ce[labels[0]])
    keep = [i for i in range(n_all) if all(ce[label][i][0] is not None for label in labels)]
    dropped = sorted(set(range(n_all)) - set(keep))

    def mean(label: str) -> float:
        return sum(ce[label][i][0] * ce[label][i][1] for i in keep) / sum(ce[label][i][1] for i in keep)

    def interval(models: list[str], signs: tuple[float, ...]) -> str:
        # one unit per kept sequence: each model's CE sum and tokens; the statistic is the signed sum of their means
        units = np.array([[ce[m][i][0] * ce[m][i][1], ce[m][i][1]] for i in keep for m in models])
        units = units.reshape(len(keep), -1)
        low, high = bootstrap_ci(units, statistic=partial(signed_means, signs=signs), block=auto_block(len(keep)))
        return f"{sum(s * mean(m) for m, s in zip(models, signs)):+.4f} | [{low:+.4f}, {high:+.4f}]"

    lines = [f"Sequences: {len(keep)} of {n_all} (dropped, non-finite in some model: {dropped})", "",
             "| model | mean CE |", "|---|---|"]
    lines += [f"| {label} | {mean(label):.4f} |" for label in labels]
    lines += ["", "| a | b | b − a | 95 % CI |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {interval([a, b], (-1, 1))} |" for a, b in combinations(labels, 2)]
    if gaps:
        lines += ["", "| control | model | gap (model − control) | 95 % CI |", "|---|---|---|---|"]
        lines += [f"| {c} | {m} | {interval([c, m], (-1, 1))} |" for c, m in gaps]
        lines += ["", "| gap a | gap b | gap b − gap a | 95 % CI |", "|---|---|---|---|"]
        lines += [f"| {m1} − {c1} | {m2} − {c2} | {interval([c1, m1, c2, m2], (1, -1, -1, 1))} |"
                  for (c1, m1), (c2, m2) in combinations(gaps, 2)]
    if len(gaps) > 1:  # e.g. one recipe's seeds: their mean gap, the sequences resampled together
        k = len(gaps)
        pooled = interval([label for pair in gaps for label in pair], (-1 / k, 1 / k) * k)
        lines += ["", f"Mean of the {k} gaps (the CI resamples the sequences only: it says nothing of the spread "
                  "between runs, which the gaps' differences above show): " + pooled.replace(" | ", " ")]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("csvs", nargs="+", metavar="[NAME=]PATH")
    parser.add_argument("--gaps", nargs="+", default=[], metavar="CONTROL:MODEL",
                        help="gaps to report and compare, by the tables' labels")
    args = parser.parse_args()
    ce = read_tables(args.csvs)
    gaps = [tuple(g.split(":", 1)) for g in args.gaps]
    unknown = sorted({label for pair in gaps for label in pair} - set(ce))
    if any(len(g) != 2 for g in gaps) or unknown:
        raise SystemExit(f"--gaps takes CONTROL:MODEL with labels of the tables ({list(ce)}); unknown: {unknown}")
    text = compare(ce, gaps)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
