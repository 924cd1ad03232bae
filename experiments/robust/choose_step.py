"""Choose a run's end checkpoint on the validation half (issue 37: choices on validation, the number on test).

Within the last fifty steps at the learning-rate floor a removal's CE on the whole validation half moved by up to
0.09 nats while its control's moved by less than 0.01 (the forty-sixth session's pilot): one end step carries
that swing into the test number. This script evaluates every kept checkpoint of one run from `--from-step` on
(`lnfree eval`, fp32, the exact fixed-scale form, no scale ceiling) on the whole validation half and chooses the
one with the lowest mean CE among those that are bounded there (every CE finite, none above 30 nats) and, for a
removal, have every norm fixed and pass the export's probe (no probe row runs away: `lnfree export`'s rule, checked
in CE order until one passes; a control's norms are real, so none of its rows can); when none is bounded, the last
of them, marked unbounded; when no bounded one passes the probe, the lowest, marked so. The LN-free run and its control are chosen by the same rule,
each on its own CE (never on the gap):

    python experiments/robust/choose_step.py RUN --from-step 1450 [--dataset realtext-val] [--context 64] \
        --out DIR [--export EXPORT_DIR]

DIR gets the evaluation (`lnfree eval`'s files) and choice.json / choice.md; `--export` also writes the chosen
checkpoint of a removal as a plain transformers model (refused, and recorded so, where it overflows on a probe
row: `lnfree export`'s rule). The probe joined the rule in the fifty-fourth session, after the seed-1 removal's
lowest checkpoint (step 1450, before the last coverage settings) was one the export refused ('<eos>' three times
without BOS ran away): on CE alone the rule could choose a model that breaks the robustness targets.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

from lnfree.evaluate.stress import CE_LIMIT  # nats: the bound on any token's CE, as `lnfree stress` counts it
from lnfree.removal.layout import RUN_CONFIG, checkpoint_step, checkpoints

PASSES = "passes"  # a probed checkpoint's `export_probe` when no probe row runs away
RULE = (f"the lowest mean CE among the checkpoints with every CE finite and none above {CE_LIMIT:g} nats (a removal's: "
        "with every norm fixed, and the lowest of those that pass the export's probe); else the last")


def candidates(run: Path, from_step: int) -> list[Path]:
    """The run's complete checkpoints at or after `from_step`, oldest first."""
    complete, _ = checkpoints(run)
    found = [c for c in complete if checkpoint_step(c) >= from_step]
    if not found:
        raise SystemExit(f"{run} has no complete checkpoint at or after step {from_step} "
                         f"(it has {[checkpoint_step(c) for c in complete]})")
    return found


def choose(rows: list[dict], removal: bool = False, refusal=None) -> dict:
    """The row with the lowest mean CE among the bounded ones (finite, no token above `CE_LIMIT`); else the last
    row. For a `removal` only rows of a fully LN-free model count (a checkpoint with a norm still real is not the
    product), and with `refusal` (checkpoint -> why its export would be refused, or None) the bounded rows are probed
    in CE order until one passes: each probed row gets `export_probe` ("passes" or the refusal), and where none
    passes the lowest is returned with `passes_probe` False. Each row: step, checkpoint, ce, tokens_over_limit,
    fully_ln_free. Returns the chosen row with `bounded` (and `passes_probe` where probed)."""
    if removal:
        rows = [r for r in rows if r["fully_ln_free"]]
        if not rows:
            raise SystemExit("no candidate checkpoint of this removal has every norm fixed: choose a later --from-step")
    bounded = sorted((r for r in rows if math.isfinite(r["ce"]) and r["tokens_over_limit"] == 0),
                     key=lambda r: (r["ce"], -r["step"]))
    if not bounded:
        return rows[-1] | {"bounded": False}
    if not (removal and refusal):
        return bounded[0] | {"bounded": True}
    for row in bounded:
        row["export_probe"] = refusal(row["checkpoint"]) or PASSES
        if row["export_probe"] == PASSES:
            return row | {"bounded": True, "passes_probe": True}
    return bounded[0] | {"bounded": True, "passes_probe": False}


def export_probe(checkpoint: str) -> str | None:
    """Why `lnfree export` would refuse this checkpoint on its probe rows, or None where it would not."""
    from lnfree.forms.export import load_checkpoint, probe_refusal

    model, tokenizer, _ = load_checkpoint(checkpoint)
    return probe_refusal(model, tokenizer)


def evaluated(run: Path, from_step: int, args: argparse.Namespace) -> list[dict]:
    """Evaluate each candidate checkpoint of `run` on `args.dataset`; the evaluation is written to `args.out`."""
    from lnfree.evaluate import evaluate, write_report

    found = candidates(run, from_step)
    labels = [f"step_{checkpoint_step(c)}" for c in found]
    report = evaluate([str(c) for c in found], args.dataset, labels=labels, dtype="fp32", device=args.device,
                      context=args.context, batch_size=args.batch_size, n_sequences=args.n_sequences,
                      progress=True, threshold=CE_LIMIT, pairwise=False)
    write_report(report, args.out, overwrite=True)
    summary = report.to_dict()
    by_label = {m["label"]: m for m in summary["models"]}
    return [{"step": checkpoint_step(c), "checkpoint": str(c), "ce": by_label[label]["ce"]["mean"],
             "tokens_over_limit": by_label[label]["tokens_above_threshold"],
             "fully_ln_free": bool(by_label[label]["fully_ln_free"])} for c, label in zip(found, labels)]


def export_chosen(checkpoint: str, out: Path) -> dict:
    """Export a removal's chosen checkpoint (`lnfree export`'s rule); {'export': path} or {'export_refused': why}.
    A refused export leaves no folder at `out`: an earlier choice's export there is removed, never verified as this one."""
    from lnfree.forms.export import ExportError, load_checkpoint, write_export

    model, tokenizer, cfg = load_checkpoint(checkpoint)
    if cfg.removal.mode != "remove":
        raise SystemExit(f"{checkpoint} is a vanilla-control run: nothing to export")
    try:
        write_export(model, tokenizer, out, {"run_config": json.loads(cfg.model_dump_json()),
                                             "checkpoint": str(checkpoint)}, overwrite=True)
    except ExportError as err:
        shutil.rmtree(out, ignore_errors=True)
        return {"export_refused": str(err)}
    return {"export": str(out)}


def table(choice: dict) -> str:
    """choice.md: each candidate's validation CE, the chosen one marked."""
    lines = [f"# {choice['run']}: the end checkpoint chosen on {choice['dataset']}", "",
             f"Rule: {choice['rule']}", "", "| step | mean CE | tokens > 30 nats | every norm fixed | export probe | |",
             "|---|---|---|---|---|---|"]
    for row in choice["candidates"]:
        mark = "**chosen**" if row["step"] == choice["chosen_step"] else ""
        fixed = "yes" if row["fully_ln_free"] else "no"
        probe = row.get("export_probe", "not probed")
        probe = probe if probe == PASSES or probe == "not probed" else "refused: " + probe.split(". ")[0]
        lines.append(f"| {row['step']} | {row['ce']:.4f} | {row['tokens_over_limit']} | {fixed} | {probe} | {mark} |")
    if not choice["bounded"]:
        lines += ["", "No candidate is bounded on this split: the last checkpoint is kept."]
    elif choice.get("passes_probe") is False:
        lines += ["", "No bounded candidate passes the export's probe: the lowest is kept, and cannot be exported."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a run folder (lnfree remove)")
    parser.add_argument("--from-step", type=int, required=True, help="the earliest checkpoint that may be chosen")
    parser.add_argument("--dataset", default="realtext-val", help="where to choose: never the split that is reported")
    parser.add_argument("--context", type=int, default=None)
    parser.add_argument("--n-sequences", type=int, default=None, help="default: the whole split")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--export", type=Path, help="also export the chosen checkpoint (a removal) here")
    args = parser.parse_args()
    rows = evaluated(args.run, args.from_step, args)
    removal = json.loads((args.run / RUN_CONFIG).read_text())["removal"]["mode"] == "remove"
    chosen = choose(rows, removal=removal, refusal=export_probe if removal else None)
    choice = {"run": str(args.run), "dataset": args.dataset, "from_step": args.from_step, "rule": RULE,
              "candidates": rows, "chosen_step": chosen["step"], "chosen": chosen["checkpoint"],
              "bounded": chosen["bounded"]} | ({"passes_probe": chosen["passes_probe"]} if "passes_probe" in chosen else {})
    if args.export is not None:
        choice.update(export_chosen(chosen["checkpoint"], args.export))
    (args.out / "choice.json").write_text(json.dumps(choice, indent=1) + "\n")
    (args.out / "choice.md").write_text(table(choice))
    print(table(choice))


if __name__ == "__main__":
    main()
