"""Which SmolLM2-135M tokens other than position 0 carry massive activations, and which MLP neurons write them.

    python experiments/smollm2/secondary_massive.py [--out experiments/results/smollm2-135m/secondary_massive]

`ln2_runaway_probe.py` finds that the tokens which run away once ln_2 is fixed bottom-up enter blocks 3–8,
in the original with every norm real, at 6–12× the median token's residual RMS: massive activations on
ordinary tokens (' the', 'Error' after the first token), which a real norm divides out and a fixed σ does
not. This measures, on the first N × 64 sequences of the held-out validation half (every norm real, the
original weights): per layer, how many tokens at positions ≥ 1 have a residual RMS above `--ratio`× the
median token's, which they are; and per block, the MLP neurons whose |activation| on those tokens is at
least `--neuron-ratio`× their 99th percentile over the other tokens, with their output there over the
median MLP output's (the position-0 writers that `removal.massive_neurons` damps are found the same way, at
position 0). Writes results.json and tables.md to --out.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import torch

from lnfree.arch import architecture
from lnfree.data.documents import prepare_data
from lnfree.models.base import load_base
from lnfree.removal.config import DataConfig
from lnfree.evaluate.results import write_experiment


def capture(model, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Residual RMS per layer [layers + 1, batch, position], and per block the MLP neuron activations
    (the output projection's input) and the MLP output norms [batch, position]."""
    arch = architecture(model)
    acts: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []

    def keep(module, args, output):
        acts.append(args[0].detach().float())
        outs.append(output.detach().float().norm(dim=-1))

    hooks = [model.get_submodule(arch.neurons(i)[1]).register_forward_hook(keep) for i in range(arch.n_layers)]
    try:
        with torch.no_grad():
            out = model(input_ids=tokens, output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    rms = torch.stack(out.hidden_states).float().pow(2).mean(-1).sqrt()
    return rms, acts, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/smollm2-135m/secondary_massive"))
    parser.add_argument("--n-sequences", type=int, default=16)
    parser.add_argument("--ratio", type=float, default=4.0, help="a token is massive above this × the median RMS")
    parser.add_argument("--neuron-ratio", type=float, default=20.0)
    args = parser.parse_args()
    model, tokenizer = load_base("smollm2-135m")
    model.eval()
    data = prepare_data(DataConfig(source="realtext", context_length=64, eval_sequences=args.n_sequences),
                        tokenizer, 64, model.config.vocab_size)
    tokens = data.eval_batch(args.n_sequences)
    rms, acts, outs = capture(model, tokens)
    rest = rms[:, :, 1:]
    ratio = rest / rest.flatten(1).median(dim=1).values[:, None, None]
    massive = ratio > args.ratio  # [layers + 1, batch, position - 1]
    layers = []
    for layer in range(rms.shape[0]):
        where = massive[layer].nonzero().tolist()
        names = Counter(tokenizer.decode(tokens[b, p + 1]) for b, p in where)
        positions = Counter(p + 1 for _, p in where)
        layers.append({"layer": layer, "tokens": len(where), "max_ratio": float(ratio[layer].max()),
                       "position0_ratio": float((rms[layer, :, 0] / rest[layer].median()).median()),
                       "top_tokens": names.most_common(5), "top_positions": positions.most_common(5)})
    # the tokens massive anywhere after the embedding: where are they written?
    anywhere = massive[1:].any(dim=0)
    writers = []
    for block, (a, o) in enumerate(zip(acts, outs)):
        a, o = a[:, 1:].abs(), o[:, 1:]
        if not anywhere.any() or anywhere.all():
            break
        on, off = a[anywhere], a[~anywhere]
        q99 = off.kthvalue(max(1, int(0.99 * off.shape[0])), dim=0).values.clamp_min(1e-6)
        peak = on.amax(dim=0)
        chosen = (peak >= args.neuron_ratio * q99).nonzero().flatten().tolist()
        typical = o[~anywhere].median()
        for j in chosen:
            w = model.get_submodule(architecture(model).neurons(block)[1]).weight[:, j].detach().float().norm()
            writers.append({"block": block, "neuron": j, "peak_on_massive_tokens": float(peak[j]),
                            "q99_elsewhere": float(q99[j]),
                            "output_over_median_mlp_output": float(peak[j] * w / typical),
                            "massive_tokens_firing": int((on[:, j] >= args.neuron_ratio * q99[j]).sum())})
    writers.sort(key=lambda w: -w["output_over_median_mlp_output"])
    results = {"sequences": args.n_sequences, "tokens_after_position_0": int(anywhere.numel()),
               "massive_tokens_anywhere": int(anywhere.sum()), "ratio": args.ratio,
               "neuron_ratio": args.neuron_ratio, "layers": layers, "writers": writers}
    lines = ["# SmolLM2-135M: massive activations on tokens other than position 0 (original, every norm real)", "",
             f"By `experiments/smollm2/secondary_massive.py`: {anywhere.numel():,} tokens at positions ≥ 1 of the "
             f"first {args.n_sequences} × 64 held-out validation sequences; a token is massive at a layer when its "
             f"residual RMS exceeds {args.ratio:g}× the median token's there. {int(anywhere.sum())} tokens are "
             "massive at some layer after the embedding. Layer 0 is the embedding, layer k the output of block k − 1 "
             "(the last one after the final norm).", "",
             "| layer | massive tokens | largest × median | position 0 × median | most frequent | at positions |",
             "|---|---|---|---|---|---|"]
    for r in layers:
        top = ", ".join(f"{n!r} ×{c}" for n, c in r["top_tokens"][:4])
        where = ", ".join(f"{p} ×{c}" for p, c in r["top_positions"][:4])
        lines.append(f"| {r['layer']} | {r['tokens']} | {r['max_ratio']:.2f} | {r['position0_ratio']:.1f} | {top} "
                     f"| {where} |")
    lines += ["", f"Neurons whose |activation| on those tokens reaches {args.neuron_ratio:g}× their 99th percentile "
              "over the other tokens (largest output first, 25 shown):", "",
              "| block | neuron | peak on massive tokens | 99th pct elsewhere | output × median MLP output "
              "| massive tokens it fires on |",
              "|---|---|---|---|---|---|"]
    for w in writers[:25]:
        lines.append(f"| {w['block']} | {w['neuron']} | {w['peak_on_massive_tokens']:.3g} | {w['q99_elsewhere']:.3g} | "
                     f"{w['output_over_median_mlp_output']:.3g} | {w['massive_tokens_firing']} |")
    write_experiment(results, lines, args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
