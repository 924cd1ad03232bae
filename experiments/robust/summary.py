"""summary.json of a robust removal (experiments/robust/run.sh), from the runs' and the checks' own outputs.

    python experiments/robust/summary.py --runs runs/robust/gemma3 --out experiments/results/gemma3-270m/robust \
        --command "experiments/robust/run.sh gemma3"

Reads RUNS/ln_free and RUNS/vanilla (log.jsonl, run config), OUT/choice/{ln_free,vanilla}/choice.json (each run's
end checkpoint chosen on the validation half, experiments/robust/choose_step.py: its removal state, its export),
OUT/eval/summary.json (test CE on the whole test split, block-bootstrap CI of the difference),
OUT/stress/stress.json (`lnfree stress`), OUT/copying/copying.json (the copying probe,
experiments/robust/induction.py), OUT/temperature/results.json (calibration on the validation half,
experiments/robust/temperature.py), OUT/verify.json and OUT/analysis/index.json (per-block position-0 residual
norm ratios). Copies each run's log and config beside the summary. Nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from lnfree.evaluate.results import ce_headline
from lnfree.removal.records import cpu_hours, read_records
from lnfree.removal.layout import LOG, RUN_CONFIG, TRAINER_STATE

STRESS_FIELDS = ("test_nonfinite_sequences", "test_tokens_over_30_nats", "test_overflow_tokens", "repeated_overflow",
                 "repeated_probes", "vocab_overflow", "vocab_covered", "vocab_size", "max_growth_vs_first",
                 "overflow_total")


def _json(path: Path) -> dict:
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run experiments/robust/run.sh first")
    return json.loads(path.read_text())


def position0(out: Path) -> dict:
    """Per model, position 0's residual norm over the other positions' at every layer (entry 0: the embedding)."""
    models = _json(out / "analysis" / "index.json")["analyses"]["residual"]["models"]
    return {label: {"per_layer": m["norm_ratio_position_0"],
                    "max_after_block_0": m["max_norm_ratio_position_0_after_block_0"]} for label, m in models.items()}


def calibration(out: Path) -> dict:
    """Each model's best softmax temperature on the validation half, and the LN-free model's gap to the control at
    T = 1 and with each model at its own best T (experiments/robust/temperature.py)."""
    result = _json(out / "temperature" / "results.json")
    return {"split": result["split"], "tokens": result["tokens"],
            "best_temperature": {m: r["best_temperature"] for m, r in result["models"].items()},
            "gap": dict(result["gaps"]["ln_free"]["all"])}


def choices(out: Path) -> dict:
    """Per run, the end checkpoint chosen on the validation half and every candidate's CE there (choose_step.py)."""
    found = {arm: _json(out / "choice" / arm / "choice.json") for arm in ("ln_free", "vanilla")}
    return {arm: {"step": c["chosen_step"], "checkpoint": c["chosen"], "bounded_on_validation": c["bounded"],
                  "passes_export_probe": c.get("passes_probe"),  # None: not probed (a control, or an older choice)
                  "dataset": c["dataset"], "validation_ce": {str(r["step"]): r["ce"] for r in c["candidates"]}}
            for arm, c in found.items()}


def machine(run: Path) -> dict:
    """The precision a run resolved to and its CPU, from its start record, and the CPUs it resumed on, from its
    resume records (None and none in a log that predates these records)."""
    records = read_records(run / LOG)
    start = next(r for r in records if r.get("event") == "start")
    resumed_on = [r["cpu"] for r in records if r.get("event") == "resume" and "cpu" in r]
    return {"precision": start["precision"], "cpu": start.get("cpu"), "resumed_on": sorted(set(resumed_on))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--command", required=True, help="the command that reproduces the model")
    args = parser.parse_args()
    run, control = args.runs / "ln_free", args.runs / "vanilla"
    chosen = choices(args.out)
    choice = _json(args.out / "choice" / "ln_free" / "choice.json")
    norms = _json(Path(choice["chosen"]) / TRAINER_STATE)["removal_state"]
    config = _json(run / RUN_CONFIG)
    stress = _json(args.out / "stress" / "stress.json")
    verify = json.loads((args.out / "verify.json").read_text()) if (args.out / "verify.json").is_file() else None
    refused = choice.get("export_refused")
    summary = {
        "model": config["model"],
        "norms_fixed": sum(state.get("fixed", False) for state in norms.values()),
        "norms_total": len(norms),
        "chosen": chosen,
        "test_ce": ce_headline(_json(args.out / "eval" / "summary.json"), "ln_free"),
        "stress": {label: {k: record[k] for k in STRESS_FIELDS} for label, record in stress["models"].items()},
        "stress_settings": stress["settings"] | {"repeated_probe_ids": len(stress["settings"]["repeated_probe_ids"])
                                                 if isinstance(stress["settings"]["repeated_probe_ids"], list)
                                                 else stress["settings"]["repeated_probe_ids"]},
        "copying": _json(args.out / "copying" / "copying.json"),
        "calibration": calibration(args.out),
        "export": choice.get("export"),
        **({"export_refused": refused} if refused else {}),
        "verify_ok": None if verify is None else verify["ok"],
        "runaway_rows_in_verify": None if verify is None else len(verify["probe"]["runaway_rows"]),
        "position0_norm_ratio": position0(args.out),
        "tokens": config["train"]["max_steps"] * config["train"]["tokens_per_step"],
        "cpu_hours": {"ln_free": cpu_hours(run), "vanilla": cpu_hours(control)},
        "machine": {tag: machine(folder) for tag, folder in (("ln_free", run), ("vanilla", control))},
        "command": args.command,
    }
    for source, tag in ((run, "ln_free"), (control, "vanilla")):
        (args.out / tag).mkdir(parents=True, exist_ok=True)
        for name in ("log.jsonl", RUN_CONFIG):
            shutil.copy(source / name, args.out / tag / name)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
