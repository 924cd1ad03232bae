"""Which SmolLM2-135M tokens run away as the MLP-input norms (ln_2) are fixed, without any fine-tuning.

    python experiments/smollm2/ln2_runaway_probe.py [--out experiments/results/smollm2-135m/ln2_runaway_probe]

On the lent GPU (experiments/results/smollm2-135m/gpu/) every removal ran away, without its scale
ceiling, once the ln_2 of blocks 9–11 were fixed: top-down (blocks 29 down to 11–8 fixed) and
bottom-up (blocks 0 up to 9–11) alike. This asks the untrained model the same question on the first
16 × 64 sequences of the held-out validation half, which the runs evaluate on (position 0 with its own σ,
as in the runs): fixing the ln_2 of one block after another, in either order, on the original, with the
massive-activation neurons zeroed (those the GPU run `gpu.toml` found and damped), or with block 2's
writers of the ordinary tokens' massive activations zeroed (`secondary_massive.py`), σ measured on the
model that is swept: how many tokens grow their residual RMS past 10× (at any layer, against the same
model with every norm real), which tokens they are, how large their residual was entering the block with
every norm real (over the median token's), and the CE. Writes results.json and tables.md to --out.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path

import torch

from lnfree.fixedscale import surgery
from lnfree.removal.config import DataConfig
from lnfree.data.documents import prepare_data
from lnfree.removal.losses.massive import Neuron, scale_neurons
from lnfree.models.base import load_base
from lnfree.evaluate.results import write_experiment

RUNAWAY = 10.0  # residual growth over the all-real model that counts a token as running away
GPU_NEURONS = Path("experiments/results/smollm2-135m/gpu/gpu/massive_neurons.json")
#: Block 2's neurons that write the massive activations of ordinary tokens (' the' at some positions), found by
#: experiments/smollm2/secondary_massive.py (each fires on all 17 such tokens of its 16 sequences).
SECONDARY_WRITERS = [Neuron(2, 430, 0.0, 0.0, 0.0), Neuron(2, 90, 0.0, 0.0, 0.0)]


def forward(model, tokens: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Held-out CE and the residual RMS at every layer, [layers + 1, batch, position]."""
    with torch.no_grad():
        out = model(input_ids=tokens, labels=tokens, output_hidden_states=True, use_cache=False)
    norms = torch.stack(out.hidden_states).float().pow(2).mean(-1).sqrt()
    return float(out.loss), norms


def sweep(model, tokens, tokenizer, order: list[int]) -> list[dict]:
    """Fix the ln_2 of `order`'s blocks one by one; one row per block."""
    states = surgery.scale_states(model)
    for state in states.values():
        state.switch_to_real()
    _, baseline = forward(model, tokens)
    rows = []
    for block in order:
        states[f"blocks.{block}.ln_2"].switch_to_fixed()
        ce, norms = forward(model, tokens)
        growth = (norms / baseline).nan_to_num(nan=math.inf)
        worst_layer = growth.argmax(dim=0)  # per token: the layer of its largest growth
        growth = growth.amax(dim=0)[:, 1:]  # position 0 has its own σ
        runaway = (growth > RUNAWAY).nonzero().tolist()
        names = Counter(tokenizer.decode(tokens[b, p + 1]) for b, p in runaway)
        first = [int(worst_layer[b, p + 1]) for b, p in runaway]
        entering = baseline[block][:, 1:] / baseline[block][:, 1:].median()  # all-real, at the fixed block's input
        ratios = sorted(float(entering[b, p]) for b, p in runaway)
        positions = Counter(p + 1 for _, p in runaway)
        rows.append({"fixed_block": block, "ce": ce, "runaway_tokens": len(runaway),
                     "max_growth": float(growth.max()), "top_tokens": names.most_common(6),
                     "top_positions": positions.most_common(6),
                     "median_worst_layer": sorted(first)[len(first) // 2] if first else None,
                     "entering_ratio": [ratios[0], ratios[len(ratios) // 2], ratios[-1]] if ratios else None,
                     "entering_above_2": int((entering > 2).sum())})
        r = rows[-1]
        if len(rows) >= 2 and math.isnan(ce) and math.isnan(rows[-2]["ce"]):
            print(f"  block {block:2d}: NaN twice in a row; the rest of the order is not measured", flush=True)
            break
        print(f"  block {block:2d}: CE {ce:.3f}, {r['runaway_tokens']} tokens > {RUNAWAY:g}x "
              f"(max {r['max_growth']:.3g}x) {r['top_tokens'][:4]} at positions {r['top_positions'][:4]}", flush=True)
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| ln_2 fixed up to block | held-out CE | tokens > 10× | max growth | most frequent | at positions "
             "| their residual entering the block, all real (min / median / max × the median token) "
             "| tokens entering above 2× |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        top = ", ".join(f"{name!r} ×{n}" for name, n in r["top_tokens"][:4])
        where = ", ".join(f"{p} ×{n}" for p, n in r["top_positions"][:4])
        entering = " / ".join(f"{x:.2f}" for x in r["entering_ratio"]) if r["entering_ratio"] else "—"
        lines.append(f"| {r['fixed_block']} | {r['ce']:.3f} | {r['runaway_tokens']} | {r['max_growth']:.3g} | {top} "
                     f"| {where} | {entering} | {r['entering_above_2']} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/smollm2-135m/ln2_runaway_probe"))
    parser.add_argument("--n-sequences", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_base("smollm2-135m")
    model.eval()
    data = prepare_data(DataConfig(source="realtext", context_length=64, eval_sequences=args.n_sequences),
                        tokenizer, 64, model.config.vocab_size)
    tokens = data.eval_batch(args.n_sequences)
    surgery.install(model, special_pos0=True, eot_token_id=tokenizer.eos_token_id)
    surgery.initialise_sigmas(model, tokens.split(4))
    neurons = [Neuron(**n) for n in json.loads(GPU_NEURONS.read_text())]
    n_layers = sum(1 for name in surgery.scale_states(model) if name.endswith(".ln_2"))
    zero_sets = {"": [], "_neurons_zeroed": neurons, "_secondary_writers_zeroed": SECONDARY_WRITERS}
    results = {"runaway_growth": RUNAWAY, "scored_tokens": int(tokens[:, 1:].numel()),
               "neurons": [f"{n.layer}.{n.index}" for n in neurons],
               "secondary_writers": [f"{n.layer}.{n.index}" for n in SECONDARY_WRITERS], "sweeps": {}}
    lines = ["# SmolLM2-135M: tokens that run away as ln_2 is fixed, no fine-tuning", "",
             f"By `experiments/smollm2/ln2_runaway_probe.py`: {results['scored_tokens']:,} held-out validation tokens "
             f"({args.n_sequences} × 64, position 0 with its own σ); a token runs away when its residual RMS at "
             "some layer "
             f"exceeds {RUNAWAY:g}× the same model's with every norm real. 'Neurons zeroed': the position-0 writers "
             f"and erasers {', '.join(results['neurons'])}; 'secondary writers zeroed': "
             f"{', '.join(results['secondary_writers'])}, which write the massive activations of ordinary tokens "
             "(`secondary_massive.py`). With neurons zeroed, σ is measured again on the zeroed model.", ""]
    original = {k: v.clone() for k, v in model.state_dict().items()}
    for suffix, zeroed in zero_sets.items():
        model.load_state_dict(original)
        scale_neurons(model, zeroed, 0.0)
        for state in surgery.scale_states(model).values():
            state.switch_to_real()
        surgery.initialise_sigmas(model, tokens.split(4))  # the σ of the model that is swept
        for name, order in (("bottom_up", list(range(n_layers))), ("top_down", list(range(n_layers - 1, -1, -1)))):
            key = f"{name}{suffix}"
            print(key, flush=True)
            results["sweeps"][key] = sweep(model, tokens, tokenizer, order)
            lines += [f"## {key.replace('_', ' ')}", "", *table(results["sweeps"][key]), ""]
    write_experiment(results, lines, args.out)
    print(f"→ {args.out}")


if __name__ == "__main__":
    main()
