"""summary.json of a modern model's removal stage, from the runs' and the evaluations' own outputs.

    python experiments/smollm2/summary.py STAGE --runs runs/smollm2-135m-massive \
        --out experiments/results/smollm2-135m/STAGE --command "experiments/smollm2/massive.sh STAGE"

STAGE is ln_f_only or ln_free (SmolLM2-135M, Gemma 3 270M: the model is the run's own). Reads
RUNS/STAGE and RUNS/STAGE-vanilla (log.jsonl, the run config, the latest checkpoint's removal
state), OUT/eval/summary.json (CE on the whole test split, the block-bootstrap CI of the
difference to the vanilla control, JSD) and the analyses under OUT/analysis (DLA; position 0's
residual norm ratio per layer). Copies each run's log and config beside the summary. Nothing is
typed in by hand. While the vanilla control is not finished (no summary.json in its folder) or not
in the evaluation, its numbers are null and `pending` says so.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from lnfree.evaluate.results import ce_headline
from lnfree.removal.records import cpu_hours
from lnfree.removal.layout import RUN_CONFIG, TRAINER_STATE, latest_checkpoint


def _json(path: Path) -> dict:
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run experiments/smollm2/massive.sh first")
    return json.loads(path.read_text())


def dla_nmae(out: Path) -> dict:
    found = sorted(out.glob("analysis/**/dla_summary.json"))
    if not found:
        raise SystemExit(f"no dla_summary.json under {out / 'analysis'}")
    models = _json(found[0])["models"]
    return {label: {"nmae": m["heads"]["nmae"], "ci": [m["heads"]["ci_low"], m["heads"]["ci_high"]],
                    "final_norm": m.get("final_norm")} for label, m in models.items()}


def analyses(out: Path) -> dict:
    """Per model: attention-sink rates, position 0's residual norm over the other positions' at every layer
    (entry 0: the embedding) and its largest after block 0, and attribution vs activation patching NMAE (from
    the index.json of each `lnfree analyze` under OUT/analysis)."""
    found: dict = {}
    for index in sorted(out.glob("analysis/**/index.json")):
        found.update(_json(index)["analyses"])
    residual, patching = found.get("residual", {}).get("models", {}), found.get("patching", {}).get("models", {})
    return {label: {"sink_rate": residual[label]["sink_rate"],
                    "norm_ratio_position_0": residual[label]["norm_ratio_position_0"],
                    "max_norm_ratio_position_0_after_block_0":
                        residual[label]["max_norm_ratio_position_0_after_block_0"],
                    **({"patching_nmae": {kind: agreement["nmae"]["value"] for kind, agreement in
                                          patching[label]["agreement"].items()}} if label in patching else {})}
            for label in residual}


def verified(out: Path) -> dict:
    """`lnfree verify`'s verdict and its checks' largest differences (OUT/verify.json), when it ran."""
    path = out / "verify.json"
    if not path.is_file():
        return {}
    report = _json(path)
    checks = {name: {key: value for key, value in check.items() if key != "note"}
              for name, check in report["checks"].items()}
    return {"verify": {"ok": report["ok"], "checks": checks}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["ln_f_only", "ln_free"])
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--command", required=True, help="the command that reproduces the stage")
    args = parser.parse_args()
    run, control = args.runs / args.stage, args.runs / f"{args.stage}-vanilla"
    checkpoint = latest_checkpoint(run)
    norms = _json(checkpoint / TRAINER_STATE)["removal_state"]
    config = _json(run / RUN_CONFIG)
    evaluation = _json(args.out / "eval" / "summary.json")
    ce = ce_headline(evaluation, args.stage)
    jsd = {p["b"]: p["jsd"]["mean"] for p in evaluation["pairs"] if p["a"] == "original"}
    control_done = (control / "summary.json").is_file() and "vanilla" in ce
    massive = run / "massive_neurons.json"
    summary = {
        "model": config["model"],
        "stage": args.stage,
        # checkpoints of lnfree before the rename say "fake"
        "norms_fixed": sum(state.get("fixed", state.get("fake", False)) for state in norms.values()),
        "norms_total": len(norms),
        "test_ce": ce if control_done else {**ce, "vanilla": None, "delta_vs_reference": None, "ci": None},
        "jsd_to_original": {"ln_free": jsd[args.stage], "vanilla": jsd["vanilla"] if control_done else None},
        "dla_vs_de_head_nmae": dla_nmae(args.out),
        "analyses": analyses(args.out),
        **verified(args.out),
        **({"massive_neurons": json.loads(massive.read_text())} if massive.is_file() else {}),
        "tokens_trained": config["train"]["max_steps"] * config["train"]["tokens_per_step"],
        "cpu_hours": {"ln_free": cpu_hours(run), "vanilla": cpu_hours(control) if control_done else None},
        "checkpoint": checkpoint.name,
        "command": args.command,
        **({} if control_done else {"pending": ["the vanilla control (run the command again to finish it)"]}),
    }
    for source, tag in ((run, args.stage), (control, "vanilla")) if control_done else ((run, args.stage),):
        (args.out / tag).mkdir(parents=True, exist_ok=True)
        for name in ("log.jsonl", RUN_CONFIG, "massive_neurons.json"):
            if (source / name).is_file():
                shutil.copy(source / name, args.out / tag / name)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
