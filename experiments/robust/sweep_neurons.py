"""Which MLP neurons the swept ids that overflow share, read in the original model (issue 37).

`lnfree stress` lists an LN-free model's worst tokens; those of its vocabulary sweep (part "vocab": every
id once, in random rows after BOS) sit in rows that `lnfree.evaluate.stress.sweep_sequences` regenerates
from the record's seed. This script runs those rows through a model (by default the original, whose norms
still bound every neuron) and reports, per token and block, the neuron with the largest *gain*: its
|activation| at the token over its largest |activation| at any other position of the row (position 0
aside). Neurons that many overflowing tokens share are one mechanism, not many rare ids:

    python experiments/robust/sweep_neurons.py --stress experiments/results/gemma3-270m/robust/first-run/stress-part-ln_free.json \
        [--model gemma3-270m] [--min-gain 4] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from lnfree.arch import architecture
from lnfree.evaluate import load_models
from lnfree.evaluate.stress import sweep_sequences

TOP = 2  # neurons per block and token counted as shared


def neuron_activations(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per block, the MLP's neuron activations (the down projection's input) [T, d_mlp] of one row."""
    arch = architecture(model)
    seen: list[torch.Tensor] = []
    hooks = [model.get_submodule(arch.neurons(i)[1]).register_forward_pre_hook(
        lambda m, a: seen.append(a[0][0].float())) for i in range(arch.n_layers)]
    try:
        with torch.no_grad():
            model(input_ids=ids[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


def gains(acts: torch.Tensor, pos: int) -> torch.Tensor:
    """Each neuron's |activation| at `pos` over its largest |activation| elsewhere in the row (position 0 aside)."""
    others = torch.cat([acts[1:pos], acts[pos + 1:]]).abs().amax(0)
    return acts[pos].abs() / others.clamp_min(1e-6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stress", type=Path, required=True, help="a `lnfree stress` record (stress.json or parts/LABEL.json)")
    parser.add_argument("--label", default=None, help="the model's label in a stress.json (default: its first)")
    parser.add_argument("--model", default="gemma3-270m", help="the model to read the neurons in (default: the original)")
    parser.add_argument("--min-gain", type=float, default=4.0, help="list a token's block only above this gain")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    data = json.loads(args.stress.read_text())
    if "record" in data:  # one model's part of a stress run: its settings are lnfree stress's defaults
        record, info = data["record"], {}
    else:
        record = data["models"][args.label] if args.label else next(iter(data["models"].values()))
        info = data.get("settings", {})
    worst = [w for w in record["worst"] if w["part"] == "vocab"]
    if not worst:
        raise SystemExit(f"{args.stress} lists no overflowing token of the vocabulary sweep")
    loaded = load_models([args.model], ["model"], form="hf", dtype="fp32")[0]
    model, tokenizer = loaded.module, loaded.tokenizer
    context, seed = info.get("context", 64), info.get("seed", 0)
    bos = info.get("bos", tokenizer.bos_token_id)
    rows = sweep_sequences(int(model.config.vocab_size), context, bos, record.get("vocab_covered"), seed)
    shared: dict[tuple[int, int], list[float]] = defaultdict(list)
    lines = [f"# Shared high-gain neurons of the swept tokens that overflow ({args.stress}, read in {args.model})", "",
             f"Per token: blocks where its strongest-gain neuron exceeds {args.min_gain:g}× its range in the row, as "
             "block:neuron (gain×).", "", "| token | overflows at block | high-gain neurons |", "|---|---|---|"]
    for w in worst:
        seq, pos = w["sequence"], w["position"]
        if int(rows[seq, pos]) != w["token_id"]:
            raise SystemExit(f"row {seq} position {pos} is not {w['token_id']}: the record's sweep settings differ")
        cells = []
        for block, acts in enumerate(neuron_activations(model, rows[seq])):
            g = gains(acts, pos)
            top = g.topk(TOP)
            for value, neuron in zip(top.values.tolist(), top.indices.tolist()):
                shared[(block, neuron)].append(value)
            if top.values[0] >= args.min_gain:
                cells.append(f"{block}:{int(top.indices[0])} ({float(top.values[0]):.0f}×)")
        lines.append(f"| {w['text']!r} | {w['layer']} | {', '.join(cells)} |")
    common = sorted(shared.items(), key=lambda kv: (-len(kv[1]), -max(kv[1])))[:15]
    lines += ["", f"Neurons among a token's top {TOP} by gain in its block, most shared first ({len(worst)} tokens):", "",
              "| block:neuron | tokens | median gain | largest gain |", "|---|---|---|---|"]
    for (block, neuron), values in common:
        lines.append(f"| {block}:{neuron} | {len(values)} | {torch.tensor(values).median():.1f}× | {max(values):.1f}× |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
