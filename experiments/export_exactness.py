"""How exact is the eps-trick export for every family? Worst-token relative error through plain transformers.

    python experiments/export_exactness.py [--out experiments/results/export_exactness]

For each family (tiny random models built from configs): measure σ on a probe batch, fix every norm
(no fine-tuning: the exactness of the file format is what is measured), export, and run
`lnfree verify` on the export. For SmolLM2-135M, fixing every norm without fine-tuning makes the
activations explode (to ~1e42), so its row verifies the LN-free export of
`experiments/smollm2/run.sh` instead (`--smollm2-export`), when it exists. Reports the
eps the export chose from the largest norm-input variance / mean square it measured, and the worst
token's relative logit error of plain `AutoModelForCausalLM.from_pretrained` (position 0 included)
against lnfree's exact fixed-scale model, plus the folded and bridge differences. Writes
`exactness.json` and `exactness.md`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from families import FAMILIES, tiny_family  # noqa: E402

from lnfree.fixedscale import surgery  # noqa: E402
from lnfree.forms.export import write_export  # noqa: E402
from lnfree.forms.verify import verify  # noqa: E402


def fixed_export(model, tokenizer, probe: torch.Tensor, folder: Path) -> dict:
    """Fix every norm of `model` at σ measured on `probe`, export it to `folder`, verify it."""
    surgery.install(model)
    surgery.initialise_sigmas(model, probe.split(4))
    for state in surgery.scale_states(model).values():
        state.switch_to_fixed()
    write_export(model, tokenizer, folder, {"note": "export exactness: σ measured, no fine-tuning"}, probe=probe)
    return exactness(folder)


def exactness(folder: Path) -> dict:
    """The eps an export chose, what it measured, and `lnfree verify`'s differences."""
    record = json.loads((folder / "lnfree_removal.json").read_text())
    report = verify(folder)
    plain = report["checks"]["transformers.from_pretrained"]
    return {
        "eps": record["eps"],
        "peak_norm_input": record["eps_choice"]["peak_norm_input"],
        "predicted_worst_relative_error": record["eps_choice"]["bound_relative_error"],
        "plain_max_abs_diff": plain["max_abs_diff"],
        "plain_worst_token_relative_error": plain["worst_token_relative_error"],
        "plain_worst_token_position": plain["worst_token"]["position"],
        "folded_max_abs_diff": report["checks"].get("folded", {}).get("max_abs_diff"),
        "bridge_max_abs_diff": report["checks"].get("transformer_lens_bridge", {}).get("max_abs_diff"),
        "verify_ok": report["ok"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/export_exactness"))
    parser.add_argument("--smollm2-export", type=Path, default=Path("runs/smollm2-135m-cpu/ln_free/export"))
    args = parser.parse_args()
    from lnfree.data.tiny import PRETRAIN_SEED, build_tokenizer, generate_documents

    tokenizer = build_tokenizer(generate_documents(200, PRETRAIN_SEED))
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            model = tiny_family(family, vocab_size=len(tokenizer))
            probe = torch.randint(1, len(tokenizer), (8, 32), generator=torch.Generator().manual_seed(0))
            rows[f"{family} (tiny random)"] = fixed_export(model, tokenizer, probe, Path(tmp) / family)
            print(family, rows[f"{family} (tiny random)"], flush=True)
    if (args.smollm2_export / "lnfree_removal.json").is_file():
        rows["SmolLM2-135M LN-free (experiments/smollm2)"] = exactness(args.smollm2_export)
    else:
        print(f"SmolLM2 skipped: no export at {args.smollm2_export} (run experiments/smollm2/run.sh)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "exactness.json").write_text(json.dumps(rows, indent=1))
    lines = ["| model | eps chosen | peak norm input (var / mean square) | worst-token rel. error, plain transformers "
             "(position) | max abs Δ plain / folded / bridge | verify |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['eps']:.0e} | {r['peak_norm_input']:.4g} | {r['plain_worst_token_relative_error']:.2e} "
            f"({r['plain_worst_token_position']}) | {r['plain_max_abs_diff']:.1e} / {r['folded_max_abs_diff']:.1e} / "
            f"{r['bridge_max_abs_diff']:.1e} | {'ok' if r['verify_ok'] else 'FAIL'} |")
    (args.out / "exactness.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
