"""Where a runaway token gains its size: block by block, the token's residual, MLP input, strongest
neurons and MLP output, each against the median token of its own sequence, in an LN-free model and in
the original (issue 37, direction "bound the gated MLPs' gain").

Reads the worst real-text tokens of a `lnfree stress` record (part "test": sequence and position in
the dataset's sequences), runs both models on those sequences and writes a markdown table per token:

    python experiments/robust/gain_chain.py --model CHECKPOINT --stress STRESS.json [--original gemma3-270m]
        [--dataset realtext-val] [--context 64] [--tokens 6] [--out FILE.md]

A neuron's "gain" is its activation at the token over its largest magnitude at any other position of
the sequence: a neuron far above its own range at the token is a high-gain neuron, not a large input.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lnfree.arch import architecture
from lnfree.data.documents import bos_token
from lnfree.evaluate import load_models
from lnfree.evaluate.datasets import load_sequences, resolve_dataset

TOP_NEURONS = 3


def culprits(stress: Path, label: str | None, n: int) -> list[tuple[int, int]]:
    """The first `n` distinct (sequence, position) of the record's worst real-text tokens."""
    models = json.loads(stress.read_text())["models"]
    record = models[label] if label else next(iter(models.values()))
    rows = [(w["sequence"], w["position"]) for w in record["worst"] if w["part"] == "test"]
    return list(dict.fromkeys(rows))[:n]


def trace(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Per block: residual in, MLP input (after its norm), neuron activations, MLP output (after its norm)."""
    arch = architecture(model)
    mlp_norm = {s.layer: s.module for s in arch.sites() if s.stage == "ln_2"}
    post_mlp = {s.layer: s.module for s in arch.sites() if s.stage == "post_mlp"}
    seen: dict[str, list] = {"mlp_in": [], "neurons": [], "mlp_out": []}
    hooks = []
    for i in range(arch.n_layers):
        hooks.append(model.get_submodule(mlp_norm[i]).register_forward_hook(
            lambda m, a, out: seen["mlp_in"].append(out[0].float())))
        hooks.append(model.get_submodule(arch.neurons(i)[1]).register_forward_pre_hook(
            lambda m, a: seen["neurons"].append(a[0][0].float())))
        hooks.append(model.get_submodule(post_mlp.get(i, arch.neurons(i)[1])).register_forward_hook(
            lambda m, a, out: seen["mlp_out"].append(out[0].float())))
    try:
        with torch.no_grad():
            out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    seen["residual"] = [h[0].float() for h in out.hidden_states[:-1]]
    return seen


def ratio(x: torch.Tensor, pos: int) -> float:
    """The token's norm over the median norm of the sequence's other positions (position 0 left out)."""
    norms = x.norm(dim=-1)
    others = torch.cat([norms[1:pos], norms[pos + 1:]])
    return float(norms[pos] / others.median())


def neuron_gains(acts: torch.Tensor, down: torch.Tensor, pos: int) -> list[str]:
    """The token's strongest neurons (|activation| × its output weight's norm): id, activation, gain."""
    strength = acts[pos].abs() * down.float().norm(dim=0)
    top = strength.topk(TOP_NEURONS).indices.tolist()
    others = torch.cat([acts[1:pos], acts[pos + 1:]]).abs().amax(0)
    return [f"{j}: {acts[pos, j]:.3g} ({acts[pos, j].abs() / others[j]:.2g}×)" for j in top]


def table(traces: dict[str, dict], downs: dict[str, list[torch.Tensor]], pos: int) -> list[str]:
    """One markdown table: a row per block, for each model residual / MLP in / MLP out ratios and neurons."""
    labels = list(traces)
    head = "| block | " + " | ".join(f"{m}: resid × / MLP in × / MLP out × | {m}: strongest neurons (gain)"
                                      for m in labels) + " |"
    lines = [head, "|---|" + "---|---|" * len(labels)]
    for i in range(len(traces[labels[0]]["residual"])):
        cells = []
        for m in labels:
            t = traces[m]
            cells.append(f"{ratio(t['residual'][i], pos):.2f} / {ratio(t['mlp_in'][i], pos):.2f} / "
                         f"{ratio(t['mlp_out'][i], pos):.2f}")
            cells.append(", ".join(neuron_gains(t["neurons"][i], downs[m][i], pos)))
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--original", default="gemma3-270m")
    parser.add_argument("--stress", type=Path, required=True)
    parser.add_argument("--label", default=None, help="the model's label in the stress record (default: its first)")
    parser.add_argument("--dataset", default="realtext-val")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    models = load_models([args.original, args.model], ["original", "LN-free"], form="hf", dtype="fp32")
    tokenizer, first = models[0].tokenizer, models[0].module
    ids = torch.from_numpy(load_sequences(resolve_dataset(args.dataset), tokenizer, context=args.context,
                                          n_sequences=None, vocab_size=first.config.vocab_size,
                                          bos_token_id=bos_token(first.config, tokenizer)))
    downs = {}
    for m in models:
        arch = architecture(m.module)
        downs[m.label] = [m.module.get_submodule(arch.neurons(i)[1]).weight.detach() for i in range(arch.n_layers)]
    lines = [f"# Gain chains of the worst real-text tokens: {args.model} against {args.original}", "",
             "Ratios: the token's norm over the median of its sequence's other tokens (position 0 left out); "
             "neurons: id: activation (its |activation| over its largest at any other position).", ""]
    for seq, pos in culprits(args.stress, args.label, args.tokens):
        traces = {m.label: trace(m.module, ids[seq]) for m in models}
        before = tokenizer.decode(ids[seq, max(1, pos - 8):pos])
        lines += [f"## sequence {seq}, position {pos}: {tokenizer.decode(ids[seq, pos:pos + 1])!r} after {before!r}",
                  "", *table(traces, downs, pos), ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
