"""How far a run's in-training validation (`data.eval_sequences` held-out sequences, the first of the validation
half) can read a model pair's gap from the whole validation half's, from two models' per-sequence CE.

    python experiments/robust/in_run_noise.py --dir experiments/results/gemma3-270m/robust/eval-validation \
        --control vanilla --arm ln_free [--sequences 64]

`--dir` is an `lnfree eval` output on the validation half (`--dataset realtext-val`), with one `<label>.csv` per
model (a row per sequence, its mean CE). The gap is the arm's mean CE minus the control's, per sequence. Printed:
the whole half's gap; the gap on its first `--sequences` sequences (what a run evaluates on while it trains); and
the spread of that estimate over every choice of `--sequences` sequences of three kinds: a window of neighbouring
sequences (every start, wrapping around: the in-run set is one of these), evenly spaced sequences (every offset)
and random sequences (2,000 draws, seed 0). Neighbouring sequences come from the same few documents, so a window
reads a gap that depends on which documents it holds. Writes `in-run-noise.md` / `.json` beside `--dir`.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
from pathlib import Path

DRAWS = 2000


def per_sequence_ce(path: Path) -> list[float]:
    """Each sequence's mean CE from an `lnfree eval` per-model CSV."""
    with path.open() as f:
        return [float(row["mean_ce"]) for row in csv.DictReader(f)]


def choices(n: int, k: int) -> dict[str, list[list[int]]]:
    """Every window of `k` neighbouring sequences of `n`, every evenly spaced set of `k`, and `DRAWS` random sets."""
    stride = n / k
    rng = random.Random(0)
    return {"neighbouring (every start)": [[(s + i) % n for i in range(k)] for s in range(n)],
            "evenly spaced (every offset)": [[int(s + i * stride) % n for i in range(k)] for s in range(n)],
            f"random ({DRAWS} draws)": [rng.sample(range(n), k) for _ in range(DRAWS)]}


def summarise(gaps: list[float], k: int) -> dict:
    """The whole gap, the first `k` sequences' and the spread of `k`-sequence estimates by kind of choice."""
    kinds = {}
    for kind, sets in choices(len(gaps), k).items():
        means = [sum(gaps[i] for i in chosen) / k for chosen in sets]
        kinds[kind] = {"sd": statistics.pstdev(means), "min": min(means), "max": max(means)}
    return {"sequences": len(gaps), "chosen": k, "whole": statistics.fmean(gaps), "first": statistics.fmean(gaps[:k]),
            "kinds": kinds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--control", default="vanilla")
    parser.add_argument("--arm", default="ln_free")
    parser.add_argument("--sequences", type=int, default=64)
    args = parser.parse_args()
    control, arm = (per_sequence_ce(args.dir / f"{label}.csv") for label in (args.control, args.arm))
    if len(control) != len(arm):
        parser.error(f"{args.control} has {len(control)} sequences and {args.arm} {len(arm)}")
    result = summarise([a - c for a, c in zip(arm, control)], args.sequences)
    command = f"experiments/robust/in_run_noise.py --dir {args.dir} --control {args.control} --arm {args.arm}"
    lines = [f"# {args.arm} − {args.control}: the gap read on {args.sequences} of {result['sequences']} validation "
             f"sequences (`{command}`)",
             "", f"- whole validation half: **{result['whole']:+.4f}**",
             f"- its first {args.sequences} sequences (the in-run set): **{result['first']:+.4f}**", "",
             f"| {args.sequences} sequences chosen as | sd of the gap read | smallest | largest |", "|---|---|---|---|"]
    lines += [f"| {kind} | {v['sd']:.4f} | {v['min']:+.4f} | {v['max']:+.4f} |" for kind, v in result["kinds"].items()]
    text = "\n".join(lines) + "\n"
    print(text)
    (args.dir.parent / "in-run-noise.md").write_text(text)
    (args.dir.parent / "in-run-noise.json").write_text(json.dumps({**vars(args), "dir": str(args.dir), **result},
                                                                  indent=2) + "\n")


if __name__ == "__main__":
    main()
