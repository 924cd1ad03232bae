"""SmolLM2-135M's massive-activation neurons, and what damping them does.

    python experiments/smollm2/massive_neurons.py [--run runs/smollm2-135m-massive/ln_free]
        [--out experiments/results/smollm2-135m/massive_neurons]

Measurements on real English text (`realtext`: 16 held-out sequences of 64 tokens score; 32 training
sequences find the neurons, as a run's σ-initialisation batches do):
1. The neurons `lnfree.removal.losses.massive.find_massive_neurons` picks at min_output 10 (the default) and 3.
2. Their output scaled by s, no fine-tuning, every norm real: held-out CE and the position-0 and
   outlier scales at the norm inputs (`lnfree.removal.losses.massive.massive_scales`).
3. The ln_2 norms fixed one after another from block 29 down, no fine-tuning (σ measured on the
   training sequences): held-out CE, the largest residual norm and the training token that grows
   the most (its path through the blocks), on the original model and (with --run) on the run's
   checkpoint where the damping has just ended, before any norm is fixed.
4. With --run: held-out CE and the position-0 / outlier scales at every evaluation of the run (its
   log), as a table and a figure.
Writes results.json, tables.md and scales_over_training.{csv,html} to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from lnfree.fixedscale import surgery
from lnfree.arch import architecture
from lnfree.removal.config import DataConfig
from lnfree.data.documents import prepare_data
from lnfree.forms.export import load_checkpoint
from lnfree.removal.layout import LOG
from lnfree.removal.losses.massive import find_massive_neurons, massive_scales, scale_neurons
from lnfree.models.base import load_base
from lnfree.removal.layout import checkpoints
from lnfree.evaluate.results import write_experiment

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "modern"))
from scales_over_training import figure, scales_over_training  # noqa: E402  (one home for it)

FACTORS = (1.0, 0.3, 0.1, 0.03, 0.01, 0.0)


@torch.no_grad()
def score(model, tokens: torch.Tensor) -> dict:
    """Held-out CE, the largest residual norm anywhere, and the massive-activation scales."""
    out = model(input_ids=tokens, output_hidden_states=True)
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    largest = max(float(h.float().norm(dim=-1).amax()) for h in out.hidden_states[:-1])
    return {"held_out_ce": float(ce), "largest_residual_norm": largest, **massive_scales(model, tokens)}


def damped_without_training(model, neurons, tokens) -> list[dict]:
    rows, saved = [], {k: v.clone() for k, v in model.state_dict().items()}
    for factor in FACTORS:
        scale_neurons(model, neurons, factor)
        rows.append({"factor": factor, **score(model, tokens)})
        model.load_state_dict(saved)
    return rows


@torch.no_grad()
def worst_token(model, tokenizer, tokens: torch.Tensor) -> dict:
    """The token whose residual norm (over the median token's, per block input) grows the most, and its path."""
    states = model(input_ids=tokens, output_hidden_states=True).hidden_states[:-1]
    norms = torch.stack([h.float().norm(dim=-1) for h in states])  # (blocks, sequences, positions)
    ratios = norms / norms[:, :, 1:].flatten(1).median(dim=1).values[:, None, None]
    peak = torch.nan_to_num(ratios, nan=float("inf"))[:, :, 1:].amax(0)
    sequence, position = divmod(int(peak.argmax()), peak.shape[1])
    position += 1
    return {"text": tokenizer.decode(tokens[sequence, max(0, position - 3):position + 1]), "position": position,
            "ratio_by_block": [round(float(r), 1) for r in ratios[:, sequence, position]]}


def ln2_fixed_top_down(model, tokenizer, train: torch.Tensor, tokens: torch.Tensor) -> list[dict]:
    """Fix every ln_2 from the last block down, one at a time, without fine-tuning (until the CE is not finite)."""
    if not surgery.is_installed(model):
        surgery.install(model)
    surgery.initialise_sigmas(model, train.split(8))
    states = surgery.scale_states(model)
    rows = []
    for layer in reversed(range(architecture(model).n_layers)):
        states[f"blocks.{layer}.ln_2"].switch_to_fixed()
        row = score(model, tokens)
        rows.append({"fixed_down_to": layer, **{k: row[k] for k in ("held_out_ce", "largest_residual_norm")},
                     "worst_token": worst_token(model, tokenizer, train)})
        if not torch.isfinite(torch.tensor(row["held_out_ce"])):
            break
    return rows


def end_of_damping_checkpoint(run: Path) -> Path:
    config = json.loads((run / "run_config.json").read_text())
    massive = config["removal"]["massive_neurons"]
    step = massive["start"] + massive["steps"]
    found = [c for c in checkpoints(run)[0] if c.name == f"step_{step:06d}"]
    if not found:
        raise SystemExit(f"{run} has no checkpoint at step {step} (the end of its damping) yet")
    return found[0]


def _runaway(rows: list[dict]) -> list[str]:
    """The fastest-growing token's path, in the last finite state and (if it diverged) one block further."""
    def path(row: dict) -> str:
        worst = row["worst_token"]
        return (f"ln_2 fixed down to block {row['fixed_down_to']}: {worst['text']!r} (position {worst['position']}), "
                "residual norm over the median token's entering each block: "
                + " ".join(str(v) for v in worst["ratio_by_block"]))

    diverged = not math.isfinite(rows[-1]["held_out_ce"])
    shown = rows[-2:] if diverged and len(rows) > 1 else rows[-1:]
    return ["", "The training token that grows the most:", ""] + [f"- {path(row)}" for row in shown]


def tables(result: dict) -> str:
    lines = ["| min_output | neurons (block.neuron: mean absolute activation at position 0 / its 99th percentile "
             "elsewhere, output over the median MLP output) |", "|---|---|"]
    for threshold, found in result["neurons"].items():
        cells = ", ".join(f"{n['layer']}.{n['index']}: {n['position0']:.0f} / {n['elsewhere']:.2f}, "
                          f"{n['output_ratio']:.0f}×" for n in found)
        lines.append(f"| {threshold} | {cells} |")
    lines += ["", "Their output scaled by s, no fine-tuning, every norm real (min_output 3):", "",
              "| s | held-out CE | position 0 scale | outlier scale | largest residual norm |", "|---|---|---|---|---|"]
    lines += [f"| {r['factor']} | {r['held_out_ce']:.3f} | {r['position0_scale']:.1f} | {r['outlier_scale']:.1f} | "
              f"{r['largest_residual_norm']:,.0f} |" for r in result["damped_without_training"]]
    for key, title in (("original", "the original model"), ("end_of_damping", "the run's checkpoint after damping")):
        if key in result["ln2_top_down"]:
            lines += ["", f"ln_2 fixed from block 29 down, no fine-tuning, on {title}:", "",
                      "| fixed down to block | held-out CE | largest residual norm |", "|---|---|---|"]
            lines += [f"| {r['fixed_down_to']} | {r['held_out_ce']:.3f} | {r['largest_residual_norm']:,.0f} |"
                      for r in result["ln2_top_down"][key]]
            lines += _runaway(result["ln2_top_down"][key])
    if "over_training" in result:
        lines += ["", "Over the run (its evaluations):", "",
                  "| step | norms switched | held-out CE | position 0 scale | outlier scale |", "|---|---|---|---|---|"]
        lines += [f"| {r['step']} | {r['norms_switched']} | {r['held_out_ce']:.3f} | {r['position0_scale']:.1f} | "
                  f"{r['outlier_scale']:.1f} |" for r in result["over_training"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a removal run with removal.massive_neurons")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/smollm2-135m/massive_neurons"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_base("smollm2-135m")
    model.eval()
    data = prepare_data(DataConfig(source="realtext", context_length=64), tokenizer, 64, model.config.vocab_size)
    held_out = data.eval_batch(16)
    train = torch.from_numpy(data.train[:32].astype("int64"))
    neurons = {threshold: find_massive_neurons(model, train.split(4), min_output=threshold) for threshold in (10.0, 3.0)}
    result = {"neurons": {str(k): [asdict(n) for n in v] for k, v in neurons.items()},
              "damped_without_training": damped_without_training(model, neurons[3.0], held_out),
              "ln2_top_down": {"original": ln2_fixed_top_down(model, tokenizer, train, held_out)}}
    if args.run is not None:
        checkpoint = end_of_damping_checkpoint(args.run)
        damped, _, _ = load_checkpoint(checkpoint)
        result["ln2_top_down"]["end_of_damping"] = ln2_fixed_top_down(damped, tokenizer, train, held_out)
        result["end_of_damping_checkpoint"] = str(checkpoint)
        result["over_training"] = scales_over_training(args.run / LOG)
    write_experiment(result, tables(result), args.out)
    if "over_training" in result:
        figure(result["over_training"], args.out, "SmolLM2-135M (damped removal)")
    print(tables(result))
    print(f"→ {args.out}")


if __name__ == "__main__":
    main()
