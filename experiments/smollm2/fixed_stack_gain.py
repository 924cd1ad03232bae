"""How much does an excess of scale grow through SmolLM2's fixed blocks? The loop gain behind the runaway.

    python experiments/smollm2/fixed_stack_gain.py --checkpoint runs/smollm2-135m-massive/ln_free/checkpoints/step_000250 \
        [--out experiments/results/smollm2-135m/fixed_stack_gain]

Every removal attempt on SmolLM2-135M (attempts 4–8 in `experiments/results/smollm2-135m/`) runs smoothly
while the ln_2 of blocks 29 down to ~13 are fixed, and then an ordinary token runs away. A gated MLP
behind a fixed norm answers an input r× too large with an output ~r²× too large, so the fixed stack
amplifies any excess. This measures by how much: the residual stream entering block j is multiplied
by 1 + δ (every token, δ = 0.05), and the RMS at the final norm's input is compared with the
unperturbed run. The gain is log(ratio) / log(1 + δ) per token: below 1 the stack damps an excess
(real norms: the blocks add the same outputs to a larger stream), above 1 it amplifies it.

Measured on the checkpoint given (σ as frozen there), for: the checkpoint as it is, and with the ln_2
of further blocks fixed without training (in the schedule's order, 12 down to 4), and on the original
model (every norm real). Writes gains.csv, tables.md and gains.json to --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import torch

import lnfree
from lnfree.fixedscale import surgery
from lnfree.arch import architecture
from lnfree.removal.config import DataConfig
from lnfree.data.documents import prepare_data
from lnfree.models.base import load_base

DELTA = 0.05
EXTRA = [12, 10, 8, 6, 4]  # fix the ln_2 of blocks down to these, without training


def final_rms(model, ids: torch.Tensor, block: int | None) -> torch.Tensor:
    """Per-token RMS entering the final norm, with block `block`'s input residual scaled by 1 + δ."""
    arch = architecture(model)
    seen = []
    hooks = [model.get_submodule(arch.final_norm).register_forward_pre_hook(
        lambda module, args: seen.append(args[0].detach().double().pow(2).mean(-1).sqrt()))]
    if block is not None:
        def scale(module, args, kwargs):
            return (args[0] * (1 + DELTA), *args[1:]), kwargs
        hooks.append(model.get_submodule(arch.block(block, "")[:-1]).register_forward_pre_hook(scale, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen[0]


def gains(model, ids: torch.Tensor) -> list[dict]:
    base = final_rms(model, ids, None)
    rows = []
    for block in range(architecture(model).n_layers):
        ratio = final_rms(model, ids, block) / base
        gain = (ratio.log() / math.log(1 + DELTA)).flatten()
        gain = gain[torch.isfinite(gain)]
        rows.append({"block": block, "median_gain": float(gain.median()) if len(gain) else float("inf"),
                     "p99_gain": float(gain.quantile(0.99)) if len(gain) else float("inf"),
                     "max_gain": float(gain.max()) if len(gain) else float("inf"),
                     "non_finite_tokens": int(ratio.numel() - len(gain))})
    return rows


def fixed_ln2(model) -> list[int]:
    states = surgery.scale_states(model)
    return sorted(i for i in range(architecture(model).n_layers) if states[f"blocks.{i}.ln_2"].is_fixed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/smollm2-135m/fixed_stack_gain"))
    parser.add_argument("--n-sequences", type=int, default=8)
    args = parser.parse_args()
    original, tokenizer = load_base("smollm2-135m")
    data = prepare_data(DataConfig(source="realtext", context_length=64, eval_sequences=args.n_sequences),
                        tokenizer, 64, original.config.vocab_size)
    ids = data.eval_batch(args.n_sequences)
    results = {"original (every norm real)": gains(original.eval(), ids)}
    model = lnfree.load(str(args.checkpoint)).model.eval()
    states = surgery.scale_states(model)
    label = lambda: f"checkpoint, ln_2 fixed in blocks {min(fixed_ln2(model))}–{max(fixed_ln2(model))}"  # noqa: E731
    results[label()] = gains(model, ids)
    for lowest in EXTRA:
        for i in range(min(fixed_ln2(model)) - 1, lowest - 1, -1):
            states[f"blocks.{i}.ln_2"].switch_to_fixed()
        results[label() + " (no training)"] = gains(model, ids)
        print(label(), results[label() + " (no training)"][0])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gains.json").write_text(json.dumps({"delta": DELTA, "checkpoint": str(args.checkpoint),
                                                     "tokens": ids.numel(), "results": results}, indent=1))
    with (args.out / "gains.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, ["model", "block", "median_gain", "p99_gain", "max_gain", "non_finite_tokens"])
        writer.writeheader()
        for name, rows in results.items():
            for row in rows:
                writer.writerow({"model": name, **row})
    lines = [f"# Gain of an excess of scale through SmolLM2-135M's blocks (δ = {DELTA}, {ids.numel()} held-out tokens)",
             "", "Residual entering block j × (1 + δ); gain = log(RMS ratio at the final norm's input) / log(1 + δ)"
             " per token. Columns: the block whose input is scaled; cells: median / max over tokens.", "",
             "| model | " + " | ".join(f"block {b}" for b in range(0, 30, 4)) + " |",
             "|---|" + "---|" * len(range(0, 30, 4))]
    for name, rows in results.items():
        cells = [f"{rows[b]['median_gain']:.2f} / {rows[b]['max_gain']:.3g}" for b in range(0, 30, 4)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (args.out / "tables.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
