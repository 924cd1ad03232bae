"""Validation CE of removal arms against a matched vanilla control, evaluation by evaluation, from their logs.

    python experiments/robust/gaps.py --control experiments/results/gemma3-270m/robust/first-run/vanilla/log.jsonl \
        --arm recipe=experiments/results/gemma3-270m/robust/first-run/ln_free/log.jsonl \
        --arm per_head=experiments/results/gemma3-270m/robust/pilots/perhead-log.jsonl \
        --out experiments/results/gemma3-270m/robust/pilots/perhead-gaps.md

Each log is a run's log.jsonl (its in-training evaluations on the validation half). Per evaluation step the
table gives each arm's CE (under the run's training-time ceiling, as logged), its gap to the control, each
later arm's difference from the first, and the norms the first arm-with-removals fixed since the previous
evaluation. A value whose model without the ceiling is not finite (or differs by more than 0.01) is marked †.
With --windows, also each arm's mean gap per window of steps, and (with --shares) per window and run how often
each capped gradient term (`margin_share`, `cov_share`, `first_share` in the training records: the term's gradient
over the gradient before it, uncapped) exceeded its cap, and its median: how much of each update the auxiliary
terms took. Writes the tables to --out and prints them.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from lnfree.removal.records import read_records

UNGUARDED_TOLERANCE = 0.01  # nats: the ceiling changed the evaluation beyond rounding


def read(path: Path) -> tuple[dict[int, dict], list[dict]]:
    """(the evaluations by step, the `remove` events) of one log.jsonl."""
    rows = read_records(path)
    evals = {r["step"]: r for r in rows if r.get("event") == "eval"}
    return evals, [r for r in rows if r.get("event") == "remove"]


def cell(record: dict | None) -> tuple[str, float | None]:
    """The CE as written in the table (with † where the ceiling mattered) and its value."""
    if record is None:
        return "", None
    ce, unguarded = record["held_out_ce"], record.get("held_out_ce_unguarded", record["held_out_ce"])
    mark = "" if math.isfinite(unguarded) and abs(unguarded - ce) <= UNGUARDED_TOLERANCE else "†"
    return f"{ce:.3f}{mark}", ce


def fixed_between(removals: list[dict], after: int, upto: int) -> str:
    """'k_norm ×6, post_attn ×2' for the norms switched in (after, upto]."""
    counts: dict[str, int] = {}
    for r in removals:
        if after < r["step"] <= upto:
            kind = r["slot"].rsplit(".", 1)[-1]
            counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{kind} ×{n}" for kind, n in counts.items())


def table(control: dict[int, dict], arms: dict[str, tuple[dict[int, dict], list[dict]]]) -> list[str]:
    """The markdown table: one row per step that the control and at least one arm evaluated."""
    names = list(arms)
    steps = sorted(s for s in control if any(s in arms[n][0] for n in names))
    removals = next((arms[n][1] for n in names if arms[n][1]), [])
    head = (["step", "control"] + [f"{n} (gap)" for n in names] + [f"{n} − {names[0]}" for n in names[1:]]
            + ["fixed since the previous evaluation"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    previous = 0
    for step in steps:
        base_text, base = cell(control[step])
        values, cols = {}, [str(step), base_text]
        for n in names:
            text, values[n] = cell(arms[n][0].get(step))
            cols.append(f"{text} ({values[n] - base:+.3f})" if values[n] is not None else "")
        first = values[names[0]]
        cols += [f"{values[n] - first:+.3f}" if values[n] is not None and first is not None else "" for n in names[1:]]
        cols.append(fixed_between(removals, previous, step))
        lines.append("| " + " | ".join(cols) + " |")
        previous = step
    return lines


def windows(control: dict[int, dict], arms: dict[str, tuple[dict[int, dict], list[dict]]],
            edges: list[int]) -> list[str]:
    """Per window (a, b] of `edges`, each arm's mean gap to the control over the evaluations in it (single
    evaluations of 64 sequences swing by several hundredths of a nat; a window's mean by less)."""
    names = list(arms)
    lines = ["| steps | evaluations | " + " | ".join(f"{n}: mean gap" for n in names) + " |",
             "|" + "---|" * (len(names) + 2)]
    for a, b in zip(edges, edges[1:]):
        steps = [s for s in control if a < s <= b and all(s in arms[n][0] for n in names)]
        if not steps:
            continue
        gaps = [sum(arms[n][0][s]["held_out_ce"] - control[s]["held_out_ce"] for s in steps) / len(steps)
                for n in names]
        lines.append(f"| {a + 1}–{b} | {len(steps)} | " + " | ".join(f"{g:+.3f}" for g in gaps) + " |")
    return lines


SHARES = ("cov_share", "first_share", "margin_share")


def shares(logs: dict[str, Path], edges: list[int], cap: float) -> list[str]:
    """Per window (a, b] and run, each capped term's share of the steps logged with it above `cap`, and its median
    over those steps (a term a run does not log, or logs as 0 throughout the window, is left blank)."""
    lines = ["| steps | run | " + " | ".join(f"{t}: above {cap} (median)" for t in SHARES) + " |",
             "|" + "---|" * (len(SHARES) + 2)]
    records = {label: read_records(path) for label, path in logs.items()}
    for a, b in zip(edges, edges[1:]):
        for label, rows in records.items():
            window = [r for r in rows if "loss" in r and a < r["step"] <= b]
            cells = []
            for term in SHARES:
                values = sorted(r[term] for r in window if term in r)
                active = values and values[-1] > 0
                cells.append(f"{sum(v > cap for v in values) / len(values):.0%} ({values[len(values) // 2]:.3g})"
                             if active else "")
            lines.append(f"| {a + 1}–{b} | {label} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--control", type=Path, required=True, help="the vanilla control's log.jsonl")
    parser.add_argument("--arm", action="append", required=True, metavar="LABEL=LOG",
                        help="an arm's log (repeatable; the first is the reference)")
    parser.add_argument("--windows", default=None, metavar="A,B,...",
                        help="step edges: also the mean gap per window (A, B], over the evaluations every arm has")
    parser.add_argument("--shares", type=float, default=None, metavar="CAP",
                        help="with --windows: also how often each capped gradient term exceeded CAP (the configs' "
                        "max_grad_share), per window and run")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    arms, logs = {}, {"control": args.control}
    for spec in args.arm:
        label, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"--arm takes LABEL=LOG, got '{spec}'")
        arms[label] = read(Path(path))
        logs[label] = Path(path)
    control = read(args.control)[0]
    lines = [f"Validation CE against the control `{args.control}` (the ceiling's effect: †)", "", *table(control, arms)]
    if args.windows:
        edges = [int(e) for e in args.windows.split(",")]
        lines += ["", *windows(control, arms, edges)]
        if args.shares is not None:
            lines += ["", *shares(logs, edges, args.shares)]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
