"""Is a removal's gap the fixed norms' remaining error, or learning the run has not caught up? (issue 37)

On a checkpoint part-way through a removal, switches the fixed norms of one kind at a time back to real (every
block of that kind; position 0's own σ aside, every token then divides by its real scale) and gives the validation CE
of each, on the sequences the run evaluates on, and its copying of a repeated random span (induction.py's probe: the
mean CE over the repeat, rows with a runaway token left out):

    python experiments/robust/unfix_kinds.py CHECKPOINT [--sequences 64] [--context 64] [--copy-rows 64] [--out FILE.md]

A kind whose norms, back to real, lower the CE by about the gap to the vanilla control is where the gap sits; one
whose real norms raise it has been compensated by the weights around it, and the gap is elsewhere. Likewise a kind
whose real norms bring the copying back is where a removal loses it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from pathlib import Path

# this folder's copying probe (run as a script, its folder is on the path)
from induction import MIN_COUNT, SPAN, copying_ce, rows, token_pool
from lnfree.data.documents import bos_token, prepare_data
from lnfree.evaluate import load_models
from lnfree.fixedscale import surgery
from lnfree.fixedscale.ceiling import set_ceiling
from lnfree.removal.config import DataConfig
from lnfree.removal.records import held_out_ce


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a run's checkpoint folder")
    parser.add_argument("--sequences", type=int, default=64, help="its first sequences (a run's data.eval_sequences)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--copy-rows", type=int, default=64, help="rows of the copying probe (0: none)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    loaded = load_models([args.model], ["model"], form="hf", dtype="fp32")[0]
    model, tokenizer = loaded.module.eval(), loaded.tokenizer
    set_ceiling(model, math.inf)
    data = prepare_data(DataConfig(source="realtext", context_length=args.context, eval_sequences=args.sequences),
                        tokenizer, args.context, model.config.vocab_size, bos_token(model, tokenizer))

    def ce() -> float:  # the run's own held-out measure, on its validation sequences
        return float(held_out_ce(model, data, args.sequences, 8, contextlib.nullcontext))

    pool = token_pool(data.train, set(tokenizer.all_special_ids), MIN_COUNT, model.config.vocab_size)
    copy_ids = rows(pool, max(args.copy_rows, 1), SPAN, bos_token(model, tokenizer), seed=0)

    def copying() -> tuple[float, int]:  # induction.py's measure: the CE over the repeat, and the runaway rows
        return copying_ce(model, copy_ids, SPAN, 8) if args.copy_rows else (math.nan, 0)

    states = surgery.scale_states(model)
    fixed = {slot: s for slot, s in states.items() if s.is_fixed or s.is_blending}
    kinds = list(dict.fromkeys(slot.rsplit(".", 1)[-1] for slot in fixed))
    base, (base_copy, base_runaway) = ce(), copying()
    lines = [f"# {args.model}: validation CE with one kind of its fixed norms back to real (realtext validation "
             f"half, {args.sequences} × {args.context} tokens, fp32), and the copying of {args.copy_rows} repeated "
             f"spans of {SPAN} ids seen ≥ {MIN_COUNT} times in training (CE over the repeat; ln {SPAN} = "
             f"{math.log(SPAN):.2f} "
             "is an even bet over the span)", "",
             "| back to real | norms | CE | Δ CE | copying CE | Δ copying | runaway copy rows |", "|---" * 7 + "|",
             f"| nothing (as trained) | 0 | {base:.4f} | — | {base_copy:.3f} | — | {base_runaway} |"]
    for kind in [*kinds, "every kind"]:
        chosen = [s for slot, s in fixed.items() if kind == "every kind" or slot.endswith("." + kind) or slot == kind]
        fractions = [s.fixed_fraction for s in chosen]
        for s in chosen:
            s.switch_to_real()
        value, (copy, runaway) = ce(), copying()
        for s, fraction in zip(chosen, fractions):
            s.set_fixed_fraction(fraction)
        lines.append(f"| {kind} | {len(chosen)} | {value:.4f} | {value - base:+.4f} | {copy:.3f} | "
                     f"{copy - base_copy:+.3f} | {runaway} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
