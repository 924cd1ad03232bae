"""What fading position 0's own σ does to an all-norms-fixed checkpoint, by kind of norm, without training.

    python experiments/gemma3/pos0_fade.py CHECKPOINT [--out experiments/results/gemma3-270m/ln_free/pos0_fade]

Position 0 (BOS, the attention sink) keeps its own σ at every norm until the `pos0_special` stage
fades it geometrically into the general σ. From the checkpoint, each row fades it at one kind of
norm only (or at all of them) to `fraction` and measures the held-out CE and the most extreme
token scales at the norm inputs (`lnfree.massive.massive_scales`), with no scale ceiling. It says
which kind's fade lets the tokens run away, and how far into the fade. Two more rows scale
position 0's attention values (the sink's value vectors, at every block; families with a separate
V projection) by 0.5 and 0, every σ as it is: how much the other tokens read from the sink. Writes
results.json and tables.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from post_mlp_runaway import held_out, write_results  # noqa: E402

from lnfree import surgery  # noqa: E402
from lnfree.arch import architecture  # noqa: E402
from lnfree.massive import massive_scales  # noqa: E402

KINDS = ("every norm", "ln_1qk", "ln_1v", "q_norm", "k_norm", "post_attn", "ln_2", "post_mlp", "ln_f")
FRACTIONS = (0.1, 0.3, 0.5, 1.0)


def value_projections(model) -> list[torch.nn.Module]:
    """The projections that produce attention values (where the family has a separate V projection)."""
    return [model.get_submodule(c.path) for site in architecture(model).sites() if site.stage == "ln_1"
            for c in site.consumers if c.v_columns == "all"]


def held_out_ce(model, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        losses = [float(model(input_ids=chunk, labels=chunk, use_cache=False).loss) for chunk in tokens.split(8)]
    return sum(losses) / len(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/gemma3-270m/ln_free/pos0_fade"))
    parser.add_argument("--n-sequences", type=int, default=16)
    args = parser.parse_args()
    model, _, _, tokens = held_out(args.checkpoint, args.n_sequences)
    states = {slot: s for slot, s in surgery.scale_states(model).items() if s.pos0_on}
    ratios = {slot: float(s.sigma_pos0 / s.sigma) for slot, s in states.items()}

    def measure(label: str, fraction: float, chosen: list[str]) -> dict:
        for slot in chosen:
            states[slot].fade_special("pos0", fraction)
        row = {"faded": label, "fraction": fraction, "norms": len(chosen), "ce": held_out_ce(model, tokens),
               **massive_scales(model, tokens[:8])}
        for slot in chosen:  # back to position 0's own σ
            states[slot].fade_special("pos0", 0.0)
        print(row, flush=True)
        return row

    rows = [measure("nothing", 0.0, [])]
    for factor in (0.5, 0.0):
        def scaled(module, args, out, factor=factor):
            out = out.clone()
            out[:, 0] *= factor
            return out

        hooks = [proj.register_forward_hook(scaled) for proj in value_projections(model)]
        if hooks:
            rows.append(measure(f"nothing; position 0's values ×{factor:g} at every block", 0.0, []))
        for hook in hooks:
            hook.remove()
    for kind in KINDS:
        chosen = [slot for slot in states if kind == "every norm" or slot.rsplit(".", 1)[-1] == kind]
        rows += [measure(kind, fraction, chosen) for fraction in FRACTIONS if chosen]
    result = {"checkpoint": str(args.checkpoint), "sigma_pos0_over_sigma": ratios, "rows": rows}
    lines = [f"# Position 0's σ faded at one kind of norm, no training ({args.checkpoint.name})", "",
             "σ_pos0 / σ by kind (min–max over blocks): " + "; ".join(
                 f"{k} {min(v):.3g}–{max(v):.3g}" for k in KINDS[1:]
                 if (v := [r for s, r in ratios.items() if s.rsplit('.', 1)[-1] == k])), "",
             "| faded at | fraction | held-out CE | position 0 / median | most extreme other / median |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['faded']} | {r['fraction']:g} | {r['ce']:.3f} | {r['position0_scale']:.3g} | "
              f"{r['outlier_scale']:.3g} |" for r in rows]
    write_results(args.out, result, lines)


if __name__ == "__main__":
    main()
