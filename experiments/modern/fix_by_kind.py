"""Which kinds of norm can a real model lose without fine-tuning? Held-out CE with groups of norms fixed.

    python experiments/modern/fix_by_kind.py --model gemma3-270m [--out experiments/results/gemma3-270m/fix_by_kind]

σ is measured on held-out realtext sequences (the model's own rule for BOS), then, starting each time
from the original, every norm of one kind is fixed at once (all blocks), and then the groups a
schedule would fix together: every input-side norm (ln_1 both paths, ln_2, q/k norms) with the
sublayer-output norms still real, and the reverse. Each row gives the CE of other held-out sequences
and the largest growth of any token's residual norm over the original's (worst block). This decides
the order of a family's stages by measurement (lnfree.arch: each adapter's `stages`). Writes
results.json and tables.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lnfree.fixedscale import surgery
from lnfree.arch import architecture
from lnfree.removal.config import DataConfig
from lnfree.data.documents import bos_token, prepare_data
from lnfree.models.base import load_base

INPUT_SIDE = ("ln_1qk", "ln_1v", "ln_2", "q_norm", "k_norm")
OUTPUT_SIDE = ("post_attn", "post_mlp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--n-sequences", type=int, default=8, help="sequences to measure σ on, and as many to score")
    args = parser.parse_args()
    out = args.out or Path("experiments/results") / args.model / "fix_by_kind"
    model, tokenizer = load_base(args.model)
    model.eval()
    data = prepare_data(DataConfig(source="realtext", context_length=64, eval_sequences=2 * args.n_sequences),
                        tokenizer, 64, model.config.vocab_size, bos_token(model, tokenizer))
    tokens = data.eval_batch(2 * args.n_sequences)
    measure, score = tokens[: args.n_sequences], tokens[args.n_sequences:]
    surgery.install(model)
    surgery.initialise_sigmas(model, measure.split(4))
    states = surgery.scale_states(model)
    kinds = [k for k in architecture(model).stages] + ["ln_f"]

    def forward() -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            result = model(input_ids=score, labels=score, output_hidden_states=True)
        return float(result.loss), torch.stack(result.hidden_states).norm(dim=-1)

    ce0, base = forward()
    rows = [{"fixed": "nothing (the original)", "norms": 0, "ce": ce0, "max_residual_growth": 1.0}]
    if bos_token(model, tokenizer) is not None:  # the same tokens after BOS, scored without it in front
        with torch.no_grad():
            logits = model(input_ids=score[:, 1:]).logits[:, :-1]
        ce = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), score[:, 2:].flatten()))
        with torch.no_grad():
            logits = model(input_ids=score).logits[:, 1:-1]
        same = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), score[:, 2:].flatten()))
        rows.append({"fixed": "nothing, BOS first (targets 2…63)", "norms": 0, "ce": same, "max_residual_growth": 1.0})
        rows.append({"fixed": "nothing, no BOS first (the same targets)", "norms": 0, "ce": ce,
                     "max_residual_growth": float("nan")})
    groups = [(kind, (kind,)) for kind in kinds]
    groups += [("every input-side norm (sublayer outputs real)", INPUT_SIDE),
               ("every sublayer-output norm (inputs real)", OUTPUT_SIDE),
               ("every norm but the final one", INPUT_SIDE + OUTPUT_SIDE),
               ("every norm", INPUT_SIDE + OUTPUT_SIDE + ("ln_f",))]
    for name, group in groups:
        chosen = [slot for slot in states if slot.rsplit(".", 1)[-1] in group]
        if not chosen:
            continue
        for slot in chosen:
            states[slot].switch_to_fixed()
        ce, norms = forward()
        growth = (norms / base).nan_to_num(nan=float("inf")).amax()
        rows.append({"fixed": name, "norms": len(chosen), "ce": ce, "max_residual_growth": float(growth)})
        for slot in chosen:  # back to real for the next group (σ unchanged: no statistics are gathered here)
            states[slot].switch_to_real()
        print(rows[-1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"model": args.model, "scored_tokens": score.numel() - len(score),
                                                  "rows": rows}, indent=1))
    lines = [f"# {args.model}: norms fixed without fine-tuning ({score.numel() - len(score)} held-out tokens scored)",
             "", "| fixed | norms | CE | Δ CE | max residual growth |", "|---|---|---|---|---|"]
    lines += [f"| {r['fixed']} | {r['norms']} | {r['ce']:.4f} | {r['ce'] - ce0:+.4f} | {r['max_residual_growth']:.3g} |"
              for r in rows]
    (out / "tables.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
