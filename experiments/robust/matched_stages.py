"""The gap to each arm's own control, stage by stage, for an arm that does the recipe's stages later.

    python experiments/robust/matched_stages.py \
        --recipe experiments/results/gemma3-270m/robust/pilots/randmine-log.jsonl \
                 experiments/results/gemma3-270m/robust/pilots/vanilla-rerun15-log.jsonl \
        --arm experiments/results/gemma3-270m/robust/pilots/pause200full-log.jsonl \
              experiments/results/gemma3-270m/robust/pilots/pause200full-vanilla-log.jsonl \
        --pause 398 200 --out experiments/results/gemma3-270m/robust/pilots/pause200full-stages.md

Each pair is a removal's log.jsonl and its own vanilla control's (validation CE at every evaluation, and the
run's last step). `--pause START STEPS`: the arm does every step of the recipe from START on STEPS later (so its
steps START to START+STEPS-1 only fine-tune). Per stage of `gemma3.toml`: the mean gap over the evaluations in it,
for each; and the gap at the stages' ends. Writes the tables to --out and prints them.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

# the stages of experiments/robust/gemma3.toml by its step numbers (first, last), the name of what is fixed
STAGES = [("ln_1qk, ln_2, q_norm, ln_1v", 1, 250), ("k_norm", 251, 397),
          ("post_attn, post_mlp 17–7 (0–6 from 650)", 398, 700), ("post_mlp 6–0, ln_f", 701, 1000),
          ("position 0's σ faded", 1001, 1400), ("mined replay, ceiling released", 1401, 1551)]
KNORM_END = 400  # the evaluation after the key norms (the recipe fixes one post_attn at 398)
ENDS = [("end of the fade", 1400), ("end of the run", 1551)]


def evaluations(path: Path) -> dict[int, float]:
    """Validation CE by step: the in-training evaluations and the run's end record."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["held_out_ce"] for r in rows if r.get("event") in ("eval", "end") and "held_out_ce" in r}


def mean_gap(run: dict, control: dict, first: int, last: int) -> tuple[float, int]:
    """Mean of run − control over the steps in [first, last] that both evaluated, and how many."""
    gaps = [run[s] - control[s] for s in sorted(run) if first <= s <= last and s in control]
    return (sum(gaps) / len(gaps) if gaps else math.nan), len(gaps)


def gap_text(run: dict, control: dict, step: int | None) -> str:
    """'CE − control = gap' at `step`, or why there is none."""
    if step is None:
        return "—"
    if step not in run or step not in control:
        return "(not reached)"
    return f"{run[step]:.3f} − {control[step]:.3f} = {run[step] - control[step]:+.3f}"


def later(step: int, start: int, steps: int) -> int:
    """A recipe step as the paused arm does it."""
    return step if step < start else step + steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", nargs=2, type=Path, required=True, metavar=("LOG", "CONTROL_LOG"))
    parser.add_argument("--arm", nargs=2, type=Path, required=True, metavar=("LOG", "CONTROL_LOG"))
    parser.add_argument("--pause", nargs=2, type=int, required=True, metavar=("START", "STEPS"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    recipe, recipe_control = map(evaluations, args.recipe)
    arm, arm_control = map(evaluations, args.arm)
    start, steps = args.pause

    def cell(run, control, first, last):
        gap, n = mean_gap(run, control, first, last)
        return "—" if not n else f"{gap:+.3f} ({n})"

    lines = ["| stage | recipe: steps | mean gap (evaluations) | arm: steps | mean gap (evaluations) |",
             "|---|---|---|---|---|",
             f"| (the pause: fine-tuning only) | — | — | {start}–{start + steps - 1} | "
             f"{cell(arm, arm_control, start, start + steps - 1)} |"]
    for name, first, last in STAGES:
        a, b = later(first, start, steps), later(last, start, steps)
        lines.append(f"| {name} | {first}–{last} | {cell(recipe, recipe_control, first, last)} | {a}–{b} | "
                     f"{cell(arm, arm_control, a, b)} |")
    lines += ["", "| point | recipe: step | CE − control | arm: step | CE − control |", "|---|---|---|---|---|"]
    pause_end = min((s for s in arm if s >= start + steps - 1), default=start + steps)  # its first evaluation after
    points = [("end of the k_norm stage", KNORM_END, KNORM_END), ("end of the pause", None, pause_end)]
    points += [(name, step, later(step, start, steps)) for name, step in ENDS]
    for name, r, a in points:
        lines.append(f"| {name} | {r or '—'} | {gap_text(recipe, recipe_control, r)} | {a} | "
                     f"{gap_text(arm, arm_control, a)} |")
    table = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
