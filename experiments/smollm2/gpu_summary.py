"""Tables of SmolLM2-135M removal runs from their logs: those run on a lent H100 (experiments/smollm2/gpu_device.sh), or any.

    python experiments/smollm2/gpu_summary.py [--results experiments/results/smollm2-135m/gpu] [--title T --source S]

Each run folder under --results holds what came back from the GPU machine (the weights cannot): the
run's log.jsonl, run_config.json and start.json (and summary.json where the run reached its end
cleanly). Writes tables.md there: per run, the first evaluation at which the model without its scale
ceiling is no longer finite, which ln_2 were fixed by then, and the evaluation curve.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from lnfree.removal.layout import LOG, START
from lnfree.removal.records import read_records


def read_log(folder: Path) -> list[dict]:
    """The run's log.jsonl rows."""
    return read_records(folder / LOG)


def fixed_by(rows: list[dict], step: int) -> list[str]:
    """The slots switched to a fixed σ at or before `step`."""
    return [r["slot"] for r in rows if r.get("event") == "remove" and r["step"] <= step]


def blocks(slots: list[str], kind: str) -> str:
    """'29–11' style summary of the blocks whose `kind` norm is among `slots`, in the order fixed."""
    found = [int(s.split(".")[1]) for s in slots if s.endswith(f".{kind}")]
    return f"{found[0]}–{found[-1]} ({len(found)})" if found else "none"


def run_summary(folder: Path) -> tuple[dict, list[str]]:
    """One run's headline numbers and its evaluation table (a run that stopped early: its last logged step)."""
    rows = read_log(folder)
    config = json.loads((folder / "run_config.json").read_text())
    evals = [r for r in rows if r.get("event") == "eval"]
    train = [r for r in rows if r.get("event") is None]
    broken = next((r for r in evals if not math.isfinite(r["held_out_ce_unguarded"])), None)
    last_finite = max((r["step"] for r in evals if math.isfinite(r["held_out_ce_unguarded"])), default=None)
    seconds = max((r["seconds"] for r in train if "seconds" in r), default=None)  # cumulative training time
    head = {
        "run": folder.name, "description": config.get("description", ""),
        "steps": max(r["step"] for r in rows), "tokens_per_step": config["train"]["tokens_per_step"],
        "seconds_per_step": seconds / max(r["step"] for r in train) if seconds else None,
        "last_finite_eval": last_finite,
        "ln_2_fixed_at_last_finite": blocks(fixed_by(rows, last_finite or -1), "ln_2"),
        "first_non_finite_eval": broken["step"] if broken else None,
        "ln_2_fixed_when_broken": blocks(fixed_by(rows, broken["step"]), "ln_2") if broken else None,
        "final_ce_guarded": evals[-1]["held_out_ce"] if evals else None,
        "max_tail_loss": max(r.get("tail", 0.0) for r in train) if train else None,
    }
    lines = [f"### {folder.name}", "", head["description"], "",
             "| step | held-out CE (ceiling) | without ceiling | outlier scale | position 0 scale | ceiling hits |",
             "|---|---|---|---|---|---|"]
    for r in evals:
        lines.append(f"| {r['step']} | {r['held_out_ce']:.3f} | {r['held_out_ce_unguarded']:.3f} | "
                     f"{r['outlier_scale']:.3g} | {r['position0_scale']:.3g} | {r['ceiling_hits']:,} |")
    return head, lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("experiments/results/smollm2-135m/gpu"))
    parser.add_argument("--title", default="SmolLM2-135M removals on one H100")
    parser.add_argument("--source", default="the GPU machine (`experiments/smollm2/gpu_device.sh`)",
                        help="where the run folders' logs come from, for the page's first line")
    args = parser.parse_args()
    runs = sorted(p for p in args.results.iterdir() if (p / "log.jsonl").is_file())
    if not runs:
        raise SystemExit(f"no run folders with a log.jsonl under {args.results}")
    heads, per_run = zip(*(run_summary(folder) for folder in runs))
    shared = len({h["description"] for h in heads}) == 1  # arms of one config by --set: its description fits none
    details = [line for lines in per_run for i, line in enumerate(lines) if not (shared and i in (2, 3))]
    tokens = {r["held_out_tokens"] for f in runs for r in read_log(f) if r.get("event") == "eval"}
    original = {round(json.loads((f / START).read_text())["held_out_ce"], 3) for f in runs if (f / START).is_file()}
    out = [f"# {args.title}", "",
           f"Written by `experiments/smollm2/gpu_summary.py` from the run logs of {args.source}. Held-out CE on "
           f"{' / '.join(f'{t:,}' for t in sorted(tokens))} scored tokens; the original model scores "
           f"{' / '.join(f'{c:.3f}' for c in sorted(original))} there (each run's start.json). 'Without ceiling' is "
           "the same model with the scale ceiling off: NaN once one held-out token overflows."
           + (f" Every run is one config ('{heads[0]['description']}') with its own settings on top (the script's header lists them)" if shared and heads[0]["description"] else ""), "",
           "| run | steps × tokens | s/step | last finite eval (ln_2 fixed) | first NaN eval (ln_2 fixed) | final CE under the ceiling |",
           "|---|---|---|---|---|---|"]
    for h in heads:
        nan = f"{h['first_non_finite_eval']} ({h['ln_2_fixed_when_broken']})" if h["first_non_finite_eval"] else "never"
        per_step = f"{h['seconds_per_step']:.2f}" if h["seconds_per_step"] else "—"
        out.append(f"| {h['run']} | {h['steps']} × {h['tokens_per_step']:,} | {per_step} | {h['last_finite_eval']} "
                   f"({h['ln_2_fixed_at_last_finite']}) | {nan} | {h['final_ce_guarded']:.3f} |")
    (args.results / "tables.md").write_text("\n".join(out + ["", *details]))
    (args.results / "summary.json").write_text(json.dumps(heads, indent=1))
    print("\n".join(out))


if __name__ == "__main__":
    main()
