"""Does an end step chosen on some validation documents hold on others? (issue 37: choose on validation, report test)

`choose_step.py` picks each run's end checkpoint by its CE on the whole validation half; the test half then reads
the chosen pair once. This check uses the per-sequence CE that `lnfree eval` wrote for several checkpoints of both
arms on the validation half: it splits the half many times into two parts by blocks of neighbouring sequences
(neighbours share documents), chooses each arm's step on one part by `choose_step.choose`'s rule, and reads the
gap on the other part, against the gap of the last step read there:

    python experiments/robust/selection_transfer.py \
        --ln-free 1400=EVAL_DIR:LABEL 1500=EVAL_DIR:LABEL ... --vanilla 1400=EVAL_DIR:LABEL ... --out FILE.md

Each STEP=EVAL_DIR:LABEL names the per-sequence table EVAL_DIR/LABEL.csv; the largest STEP is the run's end.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

from lnfree.evaluate.results import auto_block

sys.path.insert(0, str(Path(__file__).resolve().parent))
from choose_step import choose  # noqa: E402


def per_sequence(spec: str) -> tuple[int, np.ndarray, np.ndarray]:
    """STEP=EVAL_DIR:LABEL → (step, per-sequence mean CE, per-sequence scored tokens)."""
    step, where = spec.split("=", 1)
    folder, label = where.rsplit(":", 1)
    with open(Path(folder) / f"{label}.csv") as f:
        rows = list(csv.DictReader(f))
    return int(step), np.array([float(r["mean_ce"]) for r in rows]), np.array([int(r["scored_tokens"]) for r in rows])


def arm(specs: list[str]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(steps, CE per step and sequence (S, N), tokens per sequence (N,)) of one arm, steps ascending."""
    loaded = sorted(per_sequence(s) for s in specs)
    tokens = loaded[0][2]
    if any(len(t) != len(tokens) or (t != tokens).any() for _, _, t in loaded):
        raise SystemExit("the evaluations score different sequences: give tables of the same split and settings")
    return [s for s, _, _ in loaded], np.stack([ce for _, ce, _ in loaded]), tokens


def part_ce(ce: np.ndarray, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Token-weighted mean CE of each step over the sequences in `mask`."""
    return (ce[:, mask] * tokens[mask]).sum(1) / tokens[mask].sum()


def chosen_index(steps: list[int], ce: np.ndarray) -> int:
    rows = [{"step": s, "checkpoint": str(s), "ce": float(c), "tokens_over_limit": 0} for s, c in zip(steps, ce)]
    return steps.index(choose(rows)["step"])


def transfer(removal, control, splits: int, block: int | None, seed: int) -> dict:
    """Over `splits` random halvings by blocks: how often each choice was made on the choosing part, and the
    gap on the other part for the chosen pair against the end pair (mean and 2.5/97.5 percentiles). `block` None:
    `lnfree eval`'s bootstrap block for these sequences (`auto_block`)."""
    (steps_r, ce_r, tokens), (steps_c, ce_c, tokens_c) = removal, control
    if len(tokens) != len(tokens_c) or (tokens != tokens_c).any():
        raise SystemExit("the two arms' evaluations score different sequences")
    n = len(tokens)
    block = block or auto_block(n)
    blocks = np.arange(n) // block
    rng = np.random.default_rng(seed)
    chosen_gap, end_gap, picks = [], [], {}
    for _ in range(splits):
        choosing = np.isin(blocks, rng.permutation(blocks.max() + 1)[: (blocks.max() + 1) // 2])
        i = chosen_index(steps_r, part_ce(ce_r, tokens, choosing))
        j = chosen_index(steps_c, part_ce(ce_c, tokens, choosing))
        pick = f"{steps_r[i]}/{steps_c[j]}"
        picks[pick] = picks.get(pick, 0) + 1
        held = ~choosing
        r, c = part_ce(ce_r, tokens, held), part_ce(ce_c, tokens, held)
        chosen_gap.append(r[i] - c[j])
        end_gap.append(r[-1] - c[-1])
    chosen_gap, end_gap = np.array(chosen_gap), np.array(end_gap)
    whole = np.ones(n, dtype=bool)
    i, j = chosen_index(steps_r, part_ce(ce_r, tokens, whole)), chosen_index(steps_c, part_ce(ce_c, tokens, whole))

    def spread(x: np.ndarray) -> dict:
        return {"mean": float(x.mean()), "p2.5": float(np.percentile(x, 2.5)), "p97.5": float(np.percentile(x, 97.5))}

    return {"sequences": int(n), "block": block, "splits": splits, "seed": seed,
            "removal_ce": dict(zip(map(str, steps_r), part_ce(ce_r, tokens, whole).tolist())),
            "control_ce": dict(zip(map(str, steps_c), part_ce(ce_c, tokens, whole).tolist())),
            "chosen_on_whole": {"removal": steps_r[i], "control": steps_c[j]},
            "picks_removal/control": dict(sorted(picks.items(), key=lambda kv: -kv[1])),
            "held_out_gap_chosen": spread(chosen_gap), "held_out_gap_end": spread(end_gap),
            "held_out_gain": spread(end_gap - chosen_gap)}


def markdown(result: dict) -> str:
    g = result
    rows = [f"# Choosing the end step on one part of the validation half, read on the other ({g['splits']} random "
            f"halvings by blocks of {g['block']} neighbouring sequences, {g['sequences']} sequences)", "",
            "| step | " + " | ".join(g["removal_ce"]) + " |", "|---|" + "---|" * len(g["removal_ce"]),
            "| LN-free CE (whole half) | " + " | ".join(f"{v:.4f}" for v in g["removal_ce"].values()) + " |",
            "| control CE (whole half) | " + " | ".join(f"{v:.4f}" for v in g["control_ce"].values()) + " |", "",
            f"Chosen on the whole half: LN-free step {g['chosen_on_whole']['removal']}, control step "
            f"{g['chosen_on_whole']['control']}.", "",
            "Choices on the choosing part (LN-free/control: splits): "
            + ", ".join(f"{k}: {v}" for k, v in g["picks_removal/control"].items()) + ".", "",
            "| gap on the other part | mean | 2.5 % | 97.5 % |", "|---|---|---|---|"]
    for name, key in (("chosen pair", "held_out_gap_chosen"), ("end pair", "held_out_gap_end"),
                      ("end − chosen", "held_out_gain")):
        s = g[key]
        rows.append(f"| {name} | {s['mean']:+.4f} | {s['p2.5']:+.4f} | {s['p97.5']:+.4f} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ln-free", nargs="+", required=True, metavar="STEP=EVAL_DIR:LABEL")
    parser.add_argument("--vanilla", nargs="+", required=True, metavar="STEP=EVAL_DIR:LABEL")
    parser.add_argument("--splits", type=int, default=1000)
    parser.add_argument("--block", type=int, default=None, help="neighbouring sequences kept together (default: "
                        "lnfree eval's bootstrap block for as many sequences, round(√N))")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="FILE.md (and FILE.json beside it)")
    args = parser.parse_args()
    result = transfer(arm(args.ln_free), arm(args.vanilla), args.splits, args.block, args.seed)
    result["command"] = " ".join(sys.argv)
    args.out.write_text(markdown(result))
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
