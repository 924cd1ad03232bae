"""What fading position 0's own σ does to an all-norms-fixed checkpoint, by kind of norm, without training.

    python experiments/gemma3/pos0_fade.py CHECKPOINT [--out DIR] [--fractions 0.75 1] [--groups]
        [--silence-mlp-from 1 [--values-too 0 0.5] [--only-silenced]]

Position 0 (BOS, the attention sink) keeps its own σ at every norm until the `pos0_special` stage
fades it geometrically into the general σ. From the checkpoint, each row fades it at one kind of
norm only (or at all of them) to `fraction` and measures the held-out CE and the most extreme
token scales at the norm inputs (`lnfree.removal.losses.massive.massive_scales`), with no scale ceiling. It says
which kind's fade lets the tokens run away, and how far into the fade. Two more rows scale
position 0's attention values (the sink's value vectors, at every block; families with a separate
V projection) by 0.5 and 0, every σ as it is: how much the other tokens read from the sink. A
checkpoint already in its fade starts where it is (a lower fraction takes a kind back); `--groups`
also fades the output side and then one input-side kind with it; `--silence-mlp-from B` repeats the
fade with position 0's MLP output zeroed from block B up (what `train.position0_mlp` trains towards),
`--values-too` with its attention values scaled as well. Writes results.json and tables.md.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from post_mlp_runaway import checkpoint_parser, held_out, write_results  # noqa: E402

from lnfree.fixedscale import surgery  # noqa: E402
from lnfree.arch import architecture  # noqa: E402
from lnfree.removal.losses.massive import massive_scales  # noqa: E402

KINDS = ("every norm", "ln_1qk", "ln_1v", "q_norm", "k_norm", "post_attn", "ln_2", "post_mlp", "ln_f")
OUTPUT_SIDE = ("post_attn", "post_mlp", "ln_f")
# Groups of kinds faded together: the output side first, then one input-side kind at a time on top of it.
GROUPS = {"output side": OUTPUT_SIDE, "output side + ln_2": (*OUTPUT_SIDE, "ln_2"),
          "output side + ln_1qk": (*OUTPUT_SIDE, "ln_1qk"),
          "all but ln_1v": (*OUTPUT_SIDE, "ln_2", "ln_1qk", "q_norm", "k_norm")}
FRACTIONS = (0.1, 0.3, 0.5, 1.0)


def fade_fraction(state) -> float:
    """How far position 0's σ is faded at a norm now (1 once it is gone)."""
    return float(state.pos0_fade) if bool(state.pos0_active) else 1.0


def value_projections(model) -> list[torch.nn.Module]:
    """The projections that produce attention values (where the family has a separate V projection)."""
    return [model.get_submodule(c.path) for site in architecture(model).sites() if site.stage == "ln_1"
            for c in site.consumers if c.v_columns == "all"]


def mlp_output_projections(model, first_block: int) -> list[torch.nn.Module]:
    """The projections that produce each MLP's output (what its output norm reads), from `first_block` up."""
    return [model.get_submodule(c.path) for site in architecture(model).sites()
            if site.stage == "post_mlp" and site.layer >= first_block for c in site.consumers]


@contextmanager
def position0_scaled(modules: list[torch.nn.Module], factor: float):
    """Multiply position 0 of each module's output by `factor` inside the block."""
    def scaled(module, args, out):
        out = out.clone()
        out[:, 0] *= factor
        return out

    hooks = [m.register_forward_hook(scaled) for m in modules]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def held_out_ce(model, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        losses = [float(model(input_ids=chunk, labels=chunk, use_cache=False).loss) for chunk in tokens.split(8)]
    return sum(losses) / len(losses)


def main() -> None:
    parser = checkpoint_parser(__doc__, n_sequences=16, out=Path("experiments/results/gemma3-270m/ln_free/pos0_fade"))
    parser.add_argument("--fractions", type=float, nargs="+", default=FRACTIONS,
                        help="fade fractions to try (from a checkpoint in its fade, a lower one takes that kind back)")
    parser.add_argument("--groups", action="store_true",
                        help="also fade groups of kinds together (the output side, then one input-side kind)")
    parser.add_argument("--silence-mlp-from", type=int, metavar="BLOCK",
                        help="also fade with position 0's MLP output zeroed from this block up")
    parser.add_argument("--values-too", type=float, nargs="*", default=(), metavar="FACTOR",
                        help="with position 0's MLP output zeroed, also scale its attention values by these factors")
    parser.add_argument("--only-silenced", action="store_true", help="skip the by-kind rows")
    args = parser.parse_args()
    model, _, _, tokens = held_out(args.checkpoint, args.n_sequences)
    states = {slot: s for slot, s in surgery.scale_states(model).items() if s.pos0_on}
    start = {slot: fade_fraction(s) for slot, s in states.items()}
    ratios = {slot: float(s.sigma_pos0 / s.sigma) for slot, s in states.items()}

    def measure(label: str, fraction: float, chosen: list[str]) -> dict:
        for slot in chosen:
            states[slot].fade_special("pos0", fraction)
        row = {"faded": label, "fraction": fraction, "norms": len(chosen), "ce": held_out_ce(model, tokens),
               **massive_scales(model, tokens[:8])}
        for slot in chosen:  # back to where the checkpoint was
            states[slot].fade_special("pos0", start[slot])
        print(row, flush=True)
        return row

    now = sorted(set(start.values()))
    rows = [measure("nothing", now[0] if len(now) == 1 else float("nan"), [])]
    values = value_projections(model)
    if args.values_too and not values:
        raise SystemExit("--values-too: this family has no separate V projection to scale")
    for factor in (0.5, 0.0) if values else ():
        with position0_scaled(values, factor):
            rows.append(measure(f"nothing; position 0's values ×{factor:g} at every block", rows[0]["fraction"], []))
    if args.silence_mlp_from is not None:
        # Position 0's own MLP output is what runs away when ln_2's σ_pos0 fades: without it, does the fade go?
        label = f"position 0's MLP output ×0 from block {args.silence_mlp_from}"
        by_kind = {k: [slot for slot in states if slot.rsplit(".", 1)[-1] in kinds]
                   for k, kinds in (("nothing", ()), ("ln_2", ("ln_2",)), ("all but ln_1v", GROUPS["all but ln_1v"]),
                                    ("every norm", KINDS))}
        mlps = mlp_output_projections(model, args.silence_mlp_from)
        if not mlps:
            raise SystemExit(f"--silence-mlp-from {args.silence_mlp_from}: no MLP-output norm from that block up")
        with position0_scaled(mlps, 0.0):
            for kind, chosen in by_kind.items():
                rows.append(measure(f"{kind}; {label}", 1.0 if chosen else rows[0]["fraction"], chosen))
            for factor in args.values_too:  # and the sink's values scaled: a sink that writes nothing?
                with position0_scaled(values, factor):
                    for kind in ("nothing", "every norm"):
                        rows.append(measure(f"{kind}; {label}, its values ×{factor:g}",
                                            1.0 if by_kind[kind] else rows[0]["fraction"], by_kind[kind]))
    groups = {} if args.only_silenced else {kind: (kind,) for kind in KINDS} | (GROUPS if args.groups else {})
    for label, kinds in groups.items():
        chosen = [slot for slot in states if label == "every norm" or slot.rsplit(".", 1)[-1] in kinds]
        rows += [measure(label, fraction, chosen) for fraction in args.fractions  # a lower one: that kind back
                 if chosen and any(fraction != start[slot] for slot in chosen)]
    result = {"checkpoint": str(args.checkpoint), "sigma_pos0_over_sigma": ratios, "rows": rows}
    lines = [(f"# Position 0's σ faded at one kind of norm, no training ({args.checkpoint.name}; "
              f"faded {', '.join(f'{f:g}' for f in now)} there)"), "",
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
