"""Removal quality of each strategy at equal token budgets, on the real-text benchmark model.

Runs the vanilla control, the P25 recipe (the `realtext` preset: auxiliary loss, EMA σ, fixed
gaps) and each strategy (distillation to the original, gradual removal, adaptive timing) and
their combinations, for several seeds, all for the same number of steps and tokens. Then scores
every model on all held-out realtext sequences (350 × 256 tokens) and writes one table: held-out
CE of the LN-free model, its gap to the original and to the same seed's vanilla control (mean ±
half the range over seeds), mean JSD(original ‖ model) per token, and time per step relative to
the P25 recipe (from the runs' own logs; runs share the machine, `--jobs` at a time).

    python benchmarks/removal_quality.py [--steps 300] [--seeds 0 1] [--jobs 2] [--variants p25 distill ...]

Runs go to `runs/removal_quality/VARIANT-sSEED` and resume when the script is started again (a
finished run is not repeated); results to `benchmarks/results/removal_quality/`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
from functools import partial
from pathlib import Path

ADAPTIVE = 'removal.adaptive={"delta": 0.02, "min_gap": 2, "max_gap": 10, "window": 4}'
#: Each variant: config overrides on top of the `realtext` preset.
VARIANTS: dict[str, list[str]] = {
    "vanilla": ["removal.mode=vanilla"],
    "p25": [],
    "distill": ["train.distill_alpha=0.5"],
    "gradual": ["removal.blend_steps=6"],
    "adaptive": [ADAPTIVE],
    "distill+gradual+adaptive": ["train.distill_alpha=0.5", "removal.blend_steps=6", ADAPTIVE],
}
RESULTS = Path(__file__).parent / "results" / "removal_quality"


def run_one(job: tuple[str, int, int, str]) -> str:
    """Train (or resume) one variant × seed in this process and export it; returns its folder."""
    import torch

    from lnfree.removal.config import load_preset, with_overrides
    from lnfree.forms.export import export_run
    from lnfree.removal.layout import RUN_CONFIG
    from lnfree.removal.train import run

    torch.set_num_threads(1)
    variant, seed, steps, root = job
    out = Path(root) / f"{variant}-s{seed}"
    overrides = [f"train.max_steps={steps}", f"train.seed={seed}", f"output_dir={out}", "train.eval_every=0",
                 "train.save_every=50", *VARIANTS[variant]]
    config = with_overrides(load_preset("realtext"), overrides)
    result = run(config, resume=(out / RUN_CONFIG).is_file(), progress=False)
    if config.removal.mode == "remove" and not (out / "export" / "config.json").is_file():
        export_run(result)
    return str(out)


def finished(root: Path, variant: str, seed: int) -> bool:
    """True when the run has ended (and, for a removal, been exported)."""
    folder = root / f"{variant}-s{seed}"
    log = folder / "log.jsonl"
    ended = log.is_file() and '"event": "end"' in log.read_text()
    return ended and (variant == "vanilla" or (folder / "export" / "config.json").is_file())


def model_source(root: Path, variant: str, seed: int) -> str:
    """What `lnfree.load` reads for a run: its export, or the final checkpoint of a control."""
    folder = root / f"{variant}-s{seed}"
    return str(folder / "export") if (folder / "export").is_dir() else str(folder)


def seconds_per_step(folder: Path) -> float:
    """Training wall time per step from a run's log."""
    records = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
    end = [r for r in records if "seconds" in r and "loss" in r][-1]
    return end["seconds"] / end["step"]


def score(root: Path, variants: list[str], seeds: list[int], n_sequences: int) -> dict:
    """Held-out CE of every finished model and its JSD with the original, per seed."""
    from lnfree.evaluate import evaluate

    per_seed = {}
    for seed in seeds:
        if not finished(root, "vanilla", seed) or not finished(root, "p25", seed):
            continue  # the table's references
        labels = ["original", *(v for v in variants if finished(root, v, seed))]
        sources = ["realtext", *(model_source(root, v, seed) for v in labels[1:])]
        report = evaluate(sources, "realtext", labels=labels, n_sequences=n_sequences)
        per_seed[seed] = {
            label: {"ce": report.model(label).ce.mean,
                    "jsd_with_original": report.pair("original", label).jsd.mean if label != "original" else 0.0,
                    "seconds_per_step": seconds_per_step(root / f"{label}-s{seed}") if label != "original" else None}
            for label in labels
        }
    return per_seed


def mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and half the range (the spread over seeds)."""
    return statistics.fmean(values), (max(values) - min(values)) / 2


def spread_cell(per_seed: dict, seeds: list[int], quantity, signed: bool = True) -> str:
    """'mean ± half-range' of `quantity(row)` over the seeds' rows."""
    mean, spread = mean_spread([quantity(per_seed[s]) for s in seeds])
    return f"{mean:+.4f} ± {spread:.4f}" if signed else f"{mean:.4f} ± {spread:.4f}"


def table(per_seed: dict, variants: list[str]) -> str:
    """The markdown table of the benchmark."""
    lines = ["| model | seeds | held-out CE | gap to original | gap to vanilla | mean JSD(original ‖ model) | time / step vs p25 |",
             "|---|---|---|---|---|---|---|",
             f"| original | — | {spread_cell(per_seed, list(per_seed), lambda row: row['original']['ce'], False)} | — | — | 0 | — |"]
    for v in variants:
        done = [s for s in per_seed if v in per_seed[s]]
        if not done:
            lines.append(f"| {v} | 0 | not run | | | | |")
            continue
        cell = partial(spread_cell, per_seed, done)
        ce = cell(lambda row: row[v]["ce"], False)
        to_original = cell(lambda row: row[v]["ce"] - row["original"]["ce"])
        to_vanilla = cell(lambda row: row[v]["ce"] - row["vanilla"]["ce"]) if v != "vanilla" else "—"
        jsd = cell(lambda row: row[v]["jsd_with_original"], False)
        ratio = statistics.fmean(per_seed[s][v]["seconds_per_step"] / per_seed[s]["p25"]["seconds_per_step"]
                                 for s in done)
        lines.append(f"| {v} | {len(done)} | {ce} | {to_original} | {to_vanilla} | {jsd} | {ratio:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="optimiser steps of every run (P25's budget: 300)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--n-sequences", type=int, default=350, help="held-out sequences scored (350 = all)")
    parser.add_argument("--runs", default="runs/removal_quality", help="where the runs go")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--score-only", action="store_true", help="train nothing; score the runs that have finished")
    args = parser.parse_args()
    variants = list(dict.fromkeys(["vanilla", "p25", *args.variants]))  # the table's references always run
    root = Path(args.runs)
    # Variant by variant (every seed of one before the next), in the order given: a run cut short
    # leaves whole variants done.
    jobs = [(v, s, args.steps, str(root)) for v in variants for s in args.seeds]
    if not args.score_only:
        with mp.get_context("spawn").Pool(args.jobs, maxtasksperchild=1) as pool:
            for folder in pool.imap_unordered(run_one, jobs):
                print(f"finished {folder}", flush=True)
    per_seed = score(root, variants, args.seeds, args.n_sequences)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = table(per_seed, variants)
    command = "python " + " ".join(sys.argv)
    (out / "results.json").write_text(json.dumps(
        {"command": command, "steps": args.steps, "tokens_per_run": args.steps * 4096, "seeds": args.seeds,
         "variants": {v: VARIANTS[v] for v in variants}, "per_seed": per_seed}, indent=1))
    header = (f"Realtext model, {args.steps} steps × 4,096 tokens per run, seeds {args.seeds}; held-out CE on "
              f"{args.n_sequences} × 256 tokens; mean ± half the range over seeds.\n\n`{command}`\n\n")
    (out / "table.md").write_text(header + md + "\n")
    print(md)


if __name__ == "__main__":
    main()
