"""Is a removal's gap the fixed norms' remaining error, or learning the run has not caught up? (issue 37)

On a checkpoint part-way through a removal, switches the fixed norms of one kind at a time back to real (every
block of that kind; position 0's own σ aside, every token then divides by its real scale) and gives the validation CE
of each, on the sequences the run evaluates on:

    python experiments/robust/unfix_kinds.py CHECKPOINT [--dataset realtext-val] [--sequences 64] [--out FILE.md]

A kind whose norms, back to real, lower the CE by about the gap to the vanilla control is where the gap sits; one
whose real norms raise it has been compensated by the weights around it, and the gap is elsewhere.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from lnfree.data.documents import bos_token
from lnfree.evaluate import load_models
from lnfree.evaluate.datasets import load_sequences, resolve_dataset
from lnfree.fixedscale import surgery
from lnfree.fixedscale.ceiling import set_ceiling


def mean_ce(model, tokens: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token CE over every scored token of `tokens` (each row's first token is context only)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for rows in tokens.split(batch_size):
            logits = model(input_ids=rows, use_cache=False).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
            total, count = total + float(loss), count + rows[:, 1:].numel()
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a run's checkpoint folder")
    parser.add_argument("--dataset", default="realtext-val")
    parser.add_argument("--sequences", type=int, default=64, help="its first sequences (a run's data.eval_sequences)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    loaded = load_models([args.model], ["model"], form="hf", dtype="fp32")[0]
    model, tokenizer = loaded.module.eval(), loaded.tokenizer
    set_ceiling(model, math.inf)
    tokens = torch.from_numpy(load_sequences(resolve_dataset(args.dataset), tokenizer, context=args.context,
                                             n_sequences=args.sequences, vocab_size=model.config.vocab_size,
                                             bos_token_id=bos_token(model.config, tokenizer)))
    states = surgery.scale_states(model)
    fixed = {slot: s for slot, s in states.items() if s.is_fixed or s.is_blending}
    kinds = list(dict.fromkeys(slot.rsplit(".", 1)[-1] for slot in fixed))
    base = mean_ce(model, tokens)
    lines = [f"# {args.model}: validation CE with one kind of its fixed norms back to real ({args.dataset}, "
             f"{tokens.shape[0]} × {tokens.shape[1]} tokens, fp32)", "",
             "| back to real | norms | CE | Δ CE |", "|---|---|---|---|", f"| nothing (as trained) | 0 | {base:.4f} | — |"]
    for kind in [*kinds, "every kind"]:
        chosen = [s for slot, s in fixed.items() if kind == "every kind" or slot.endswith("." + kind) or slot == kind]
        fractions = [1.0 if s.is_fixed else 1.0 - float(s.mix) for s in chosen]
        for s in chosen:
            s.switch_to_real()
        value = mean_ce(model, tokens)
        for s, fraction in zip(chosen, fractions):
            s.set_fixed_fraction(fraction)
        lines.append(f"| {kind} | {len(chosen)} | {value:.4f} | {value - base:+.4f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
