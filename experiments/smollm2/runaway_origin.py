"""Where the ln_2 runaway of a partly LN-free SmolLM2-135M starts: the block, the tokens, the neurons.

    python experiments/smollm2/runaway_origin.py CHECKPOINT... [--labels L...] [--n-sequences 200]
        [--out experiments/results/smollm2-135m/runaway_origin]

For each training checkpoint (`runs/.../checkpoints/step_N`, lnfree's exact form of the run with its fixed
norms and blends), with the scale ceiling off: the first N held-out validation sequences of 64 tokens (BOS-led
where the run's were, `data.bos`); for
each sequence with a non-finite residual, the earliest layer at which a token at a position ≥ 1 exceeds
`--ratio`× the median token's residual RMS there (median over the finite sequences; position 0 has its own
σ in these runs), which tokens, their ratio layer by layer, and the MLP neurons of the block that made
them (the block before that layer): |activation| × the neuron's output-weight norm on the token, against the
neuron's largest elsewhere in the sequence; and what each sublayer of the blocks up to that one wrote on the token,
over the median token of its sequence (attention and MLP outputs: which one first lifts it). Writes results.json
and tables.md to --out.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from lnfree.arch import architecture
from lnfree.data.documents import bos_token, prepare_data
from lnfree.fixedscale.ceiling import set_ceiling
from lnfree.forms.export import load_checkpoint
from lnfree.removal.config import DataConfig
from lnfree.removal.losses.massive import captured_input
from lnfree.evaluate.results import write_experiment


def run_bos(checkpoint: Path) -> str:
    """The run's `data.bos` (its run folder's run_config.json; "family" where there is none): its windows."""
    run_config = checkpoint.parent.parent / "run_config.json"
    return json.loads(run_config.read_text())["data"].get("bos", "family") if run_config.is_file() else "family"


@torch.no_grad()
def residuals(model, ids: torch.Tensor, batch: int = 8) -> torch.Tensor:
    """Residual RMS [layers + 1, sequences, positions] (layer 0: the embedding; the last: after the final norm)."""
    parts = []
    for chunk in ids.split(batch):
        out = model(input_ids=chunk, output_hidden_states=True, use_cache=False)
        parts.append(torch.stack(out.hidden_states).float().pow(2).mean(-1).sqrt())
    return torch.cat(parts, 1)


@torch.no_grad()
def writers(model, ids: torch.Tensor, block: int, position: int, top: int = 4) -> list[dict]:
    """The neurons of `block`'s MLP that write most of the token at `position` of the one sequence `ids`."""
    path = architecture(model).neurons(block)[1]
    weight = model.get_submodule(path).weight.float().norm(dim=0)
    writes = captured_input(model, path, ids[None])[0].abs() * weight  # positions × neurons
    elsewhere = torch.cat([writes[1:position], writes[position + 1:]]).amax(0)
    chosen = writes[position].topk(top)
    return [{"neuron": int(j), "writes": float(v), "largest_elsewhere": float(elsewhere[j])}
            for v, j in zip(chosen.values, chosen.indices)]


@torch.no_grad()
def sublayers(model, ids: torch.Tensor, position: int, blocks: int) -> list[list[float]]:
    """Per block up to `blocks`, [attention, MLP] output norm on the token at `position` of the one sequence `ids`
    over the median of that output at positions ≥ 1 (one forward)."""
    outputs = []
    handles = [model.get_submodule(path).register_forward_hook(
        lambda module, args, out: outputs.append((out[0] if isinstance(out, tuple) else out)[0].float().norm(dim=-1)))
        for path in architecture(model).output_modules()[: 2 * blocks]]
    try:
        model(input_ids=ids[None], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    ratios = [round(float(o[position] / o[1:][torch.isfinite(o[1:])].median()), 1) for o in outputs]
    return [ratios[i:i + 2] for i in range(0, len(ratios), 2)]


def origins(model, tokenizer, ids: torch.Tensor, ratio: float, shown: int) -> dict:
    """The non-finite sequences of `ids` and, for the first `shown` of them, where their runaway starts."""
    rms = residuals(model, ids)
    finite = torch.isfinite(rms).all(0).all(-1)
    median = rms[:, finite, 1:].flatten(1).median(1).values
    times = rms / median[:, None, None]
    rows = []
    for s in (~finite).nonzero().flatten().tolist()[:shown]:
        over = (times[:, s] > ratio) | ~torch.isfinite(times[:, s])
        over[:, 0] = False
        layer = int(over.any(1).nonzero()[0])
        positions = over[layer].nonzero().flatten().tolist()
        p = positions[0]
        rows.append({"sequence": s, "layer": layer, "positions": positions[:8],
                     "tokens": [tokenizer.decode(ids[s, q]) for q in positions[:4]],
                     "before": tokenizer.decode(ids[s, max(0, p - 3):p]),
                     "times_median": [round(float(x), 2) for x in times[: layer + 2, s, p]],
                     "position0_times_median": [round(float(x), 2) for x in times[: layer + 2, s, 0]],
                     "writers": writers(model, ids[s], layer - 1, p) if layer > 0 else [],
                     "sublayers_times_median": sublayers(model, ids[s], p, layer)})
    return {"sequences": ids.shape[0], "nonfinite_sequences": int((~finite).sum()), "origins": rows}


def table(label: str, result: dict) -> list[str]:
    lines = [f"## {label}", "", f"{result['nonfinite_sequences']} of {result['sequences']} sequences non-finite.", "",
             "| seq | first layer over | positions | tokens (after) | token × median, layer 0 … | position 0 × median "
             "| writers in the block before: neuron (writes / largest elsewhere) | blocks 0 … its: attention, MLP output "
             "× median |", "|---|---|---|---|---|---|---|---|"]
    for r in result["origins"]:
        who = ", ".join(f"{w['neuron']} ({w['writes']:.3g} / {w['largest_elsewhere']:.2g})" for w in r["writers"])
        lines.append(f"| {r['sequence']} | {r['layer']} | {r['positions']} | {r['tokens']!r} ({r['before']!r}) | "
                     f"{', '.join(map(str, r['times_median']))} | {', '.join(map(str, r['position0_times_median']))} | "
                     f"{who} | {'; '.join(f'{a}, {m}' for a, m in r.get('sublayers_times_median', []))} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--labels", nargs="+", default=None)
    parser.add_argument("--n-sequences", type=int, default=200)
    parser.add_argument("--ratio", type=float, default=10.0, help="a token is over at a layer above this × the median")
    parser.add_argument("--shown", type=int, default=12, help="sequences traced per checkpoint")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/smollm2-135m/runaway_origin"))
    args = parser.parse_args()
    labels = args.labels or [f"{c.parent.parent.name}/{c.name}" for c in args.checkpoints]
    if len(labels) != len(args.checkpoints):
        raise SystemExit("--labels: one per checkpoint")
    results, lines = {}, ["# SmolLM2-135M: where the ln_2 runaway starts", "",
                          f"By `experiments/smollm2/runaway_origin.py`: the first {args.n_sequences} × 64 held-out "
                          "validation sequences, each checkpoint without its scale ceiling. Layer 0 is the embedding, "
                          f"layer k the output of block k − 1; 'over': above {args.ratio:g}× the median token's "
                          "residual RMS at that layer (or non-finite). Writers: |activation| × output-weight norm.", ""]
    for label, checkpoint in zip(labels, args.checkpoints):
        model, tokenizer, _ = load_checkpoint(checkpoint)
        set_ceiling(model, math.inf)
        rule = run_bos(checkpoint)
        data = prepare_data(DataConfig(source="realtext", context_length=64, eval_sequences=args.n_sequences, bos=rule),
                            tokenizer, 64, model.config.vocab_size, bos_token(model, tokenizer, rule))
        results[label] = {"checkpoint": str(checkpoint),
                          **origins(model, tokenizer, data.eval_batch(args.n_sequences), args.ratio, args.shown)}
        lines += table(label, results[label])
    write_experiment(results, lines, args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
