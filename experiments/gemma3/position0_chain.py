"""Position 0 through every norm of a removal checkpoint, without its scale ceiling.

    python experiments/gemma3/position0_chain.py CHECKPOINT --out DIR [--n-sequences 6]

For each norm (forward order, per-head norms aside): position 0's scale over the median token's at
its input, what position 0 leaves it with (its scale over the divisor it uses: its real scale, its
own frozen σ or the general σ, or a fade between them) and that over what the median token leaves
it with, and the most extreme other token (scale over the median, and its position). Says where position 0 runs away and whether the other tokens follow. Writes results.json
and tables.md.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from post_mlp_runaway import checkpoint_parser, held_out, write_results  # noqa: E402

from lnfree.fixedscale import surgery  # noqa: E402
from lnfree.arch import architecture  # noqa: E402


def position0_divisor(state, x0_scale: float) -> tuple[float, str]:
    """The divisor position 0 uses at this state, a partial fade included, and its name."""
    divisor = float(state.position0_divisor(torch.tensor(x0_scale)))
    if not state.pos0_on:
        return divisor, "σ"
    name, fade = ("real" if state.pos0_real_on else "σ_pos0"), float(state.pos0_fade)
    return divisor, name if fade == 0 else f"{name} faded {fade:.0%}"


def main() -> None:
    parser = checkpoint_parser(__doc__, n_sequences=6)
    args = parser.parse_args()
    model, tokenizer, _, tokens = held_out(args.checkpoint, args.n_sequences)
    states = surgery.scale_states(model)
    rows = []

    def keep(slot: str):
        def hook(module, inputs):
            scale = inputs[0].float().pow(2).mean(-1).sqrt()  # (batch, positions)
            rest = scale[:, 1:].nan_to_num(nan=-math.inf, posinf=math.inf)  # NaN only follows an overflow
            median, worst = float(scale[:, 1:].median()), int(rest.flatten().argmax())
            x0 = float(scale[:, 0].mean())
            divisor, kind = position0_divisor(states[slot], x0)
            rows.append({"norm": slot, "position0_over_median": x0 / median, "position0_out": x0 / divisor,
                         "position0_out_over_typical": (x0 / divisor) / (median / float(states[slot].sigma)),
                         "position0_divisor": kind, "other_max_over_median": float(rest.flatten()[worst]) / median,
                         "other_position": worst % rest.shape[1] + 1,
                         "other_token": tokenizer.decode([int(tokens[worst // rest.shape[1], worst % rest.shape[1] + 1])])})
        return hook

    for site in architecture(model).sites():
        if not site.per_head:
            model.get_submodule(site.module).register_forward_pre_hook(keep(site.slots[-1]))
    with torch.no_grad():
        ce = float(model(input_ids=tokens, labels=tokens).loss)
    lines = [f"# Position 0 through every norm of {args.checkpoint.name}, no ceiling", "",
             f"{args.n_sequences} held-out sequences; CE {ce:.4g}. Position 0 leaves a norm with its input scale over "
             "the divisor it uses (1 at its real scale).", "",
             "| norm (its V path for ln_1) | position 0 / median | position 0 leaves with (divisor) | "
             "that over the median token's | most extreme other / median (token, position) |", "|---|---|---|---|---|"]
    lines += [f"| {r['norm']} | {r['position0_over_median']:.3g} | {r['position0_out']:.3g} ({r['position0_divisor']}) | "
              f"{r['position0_out_over_typical']:.3g} | {r['other_max_over_median']:.3g} ({r['other_token']!r}, "
              f"{r['other_position']}) |" for r in rows]
    write_results(args.out, {"checkpoint": str(args.checkpoint), "ce": ce, "rows": rows}, lines)


if __name__ == "__main__":
    main()
