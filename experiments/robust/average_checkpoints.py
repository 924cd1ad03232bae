"""Does averaging a removal's last checkpoints lower its validation CE? (issue 37: a weight average, cheaply)

Loads a run's checkpoints (lnfree's exact fixed-scale form), averages their parameters uniformly (buffers,
among them every norm's σ, must agree: the average is refused otherwise) and gives the validation CE of each
checkpoint and of the average, on the sequences the run evaluates on:

    python experiments/robust/average_checkpoints.py CHECKPOINT... [--sequences 64] [--context 64] [--out FILE.md]

Run it on the LN-free run and on its vanilla control alike: what counts is the gap between the two averages.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from pathlib import Path

import torch

from lnfree.data.documents import bos_token, prepare_data
from lnfree.evaluate import load_models
from lnfree.fixedscale.ceiling import set_ceiling
from lnfree.removal.config import DataConfig
from lnfree.removal.records import held_out_ce


def average_into(first: torch.nn.Module, others: list[torch.nn.Module]) -> float:
    """Average every parameter of `others` into `first`, uniformly; returns the largest buffer difference."""
    worst = 0.0
    with torch.no_grad():
        for (name, buffer), *rest in zip(first.named_buffers(), *(m.named_buffers() for m in others)):
            for other_name, other in rest:
                if other_name != name:
                    raise SystemExit(f"the checkpoints differ in structure ({name} against {other_name})")
                if buffer.is_floating_point():
                    worst = max(worst, float((buffer - other).abs().max()) if buffer.numel() else 0.0)
                elif not torch.equal(buffer, other):
                    raise SystemExit(f"buffer {name} differs between checkpoints: no common fixed-scale state")
        for param, *rest in zip(first.parameters(), *(m.parameters() for m in others)):
            param.add_(sum(rest)).div_(1 + len(rest))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="checkpoint folders of one run")
    parser.add_argument("--sequences", type=int, default=64, help="its first sequences (a run's data.eval_sequences)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    loaded = load_models(args.checkpoints, [Path(c).name for c in args.checkpoints], form="hf", dtype="fp32")
    models = [entry.module.eval() for entry in loaded]
    for model in models:
        set_ceiling(model, math.inf)
    tokenizer = loaded[0].tokenizer
    data = prepare_data(DataConfig(source="realtext", context_length=args.context, eval_sequences=args.sequences),
                        tokenizer, args.context, models[0].config.vocab_size, bos_token(models[0], tokenizer))

    def ce(model: torch.nn.Module) -> float:  # the run's own held-out measure, on its validation sequences
        return float(held_out_ce(model, data, args.sequences, 8, contextlib.nullcontext))

    rows = [(entry.label, ce(model)) for entry, model in zip(loaded, models)]
    worst = average_into(models[0], models[1:])
    rows.append((f"uniform average of {len(models)}", ce(models[0])))
    lines = [f"# Validation CE of checkpoints and of their average (realtext validation half, {args.sequences} × "
             f"{args.context} tokens, fp32)", "", f"Run: {Path(args.checkpoints[0]).parent.parent}; largest "
             f"floating-point buffer difference between checkpoints: {worst:.3g}.", "",
             "| model | CE | Δ against the last |", "|---|---|---|"]
    last = rows[len(models) - 1][1]
    lines += [f"| {label} | {value:.4f} | {value - last:+.4f} |" for label, value in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
