"""Why the Gemma 3 270M removal broke at the MLP-output norms of its lowest blocks: from the last good
checkpoint, fix the remaining `post_mlp` norms one more at a time *without training* and measure.

    python experiments/gemma3/post_mlp_runaway.py runs/gemma3-270m/ln_free/checkpoints/step_000600 \
        --out experiments/results/gemma3-270m/ln_free/post_mlp_runaway

The run (`experiments/gemma3/ln_free.toml`) fixed every input-side norm, every `post_attn` and the
`post_mlp` of blocks 17–8 by step 600 (held-out CE 3.237); blending in blocks 5–2 from step 626 on,
its gradient norm rose from ~8 to 10⁵ and its CE to 7.7. Each row here starts from the checkpoint and
fixes post_mlp of blocks 7…k at their frozen σ (the EMA the run measured): the held-out CE (8
sequences × 64 tokens, BOS first), the residual stream's largest per-token RMS over the median token's
(position 0 aside) at any block, where it is and which token, and position 0's. Writes results.json and
tables.md.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from lnfree.fixedscale import surgery
from lnfree.data.documents import bos_token, prepare_data
from lnfree.forms.export import load_checkpoint
from lnfree.evaluate.results import write_experiment


def measure(model, tokens: torch.Tensor, tokenizer) -> dict:
    """Held-out CE and the most extreme residual-stream token (RMS over the median token, per block)."""
    with torch.no_grad():
        result = model(input_ids=tokens, labels=tokens, output_hidden_states=True)
    rms = torch.stack(result.hidden_states).float().pow(2).mean(-1).sqrt()  # (blocks + 1, batch, positions)
    rest = rms[:, :, 1:]
    ratio = rest / rest.flatten(1).median(dim=1).values[:, None, None]
    # The earliest (block-major) overflowed token if any: NaN only follows an overflow, so it is passed over.
    finite_or_inf = ratio.nan_to_num(nan=-math.inf, posinf=math.inf)
    block, row, position = (int(i) for i in torch.unravel_index(finite_or_inf.argmax(), ratio.shape))
    pos0 = rms[:, :, 0] / rest.flatten(1).median(dim=1).values[:, None]
    return {"ce": float(result.loss), "max_ratio": float(ratio[block, row, position]), "at_block": block,
            "token": tokenizer.decode([int(tokens[row, position + 1])]), "position": position + 1,
            "position0_max_ratio": float(pos0.max())}


def held_out(checkpoint: Path, n_sequences: int):
    """(model in eval mode, tokenizer, run config, the first `n_sequences` held-out sequences) of a checkpoint."""
    model, tokenizer, config = load_checkpoint(checkpoint)
    model.eval()
    data = prepare_data(config.data, tokenizer, config.data.context_length, model.config.vocab_size,
                        bos_token(model, tokenizer))
    return model, tokenizer, config, data.eval_batch(n_sequences)


def write_results(out: Path, result: dict, lines: list[str]) -> None:
    """`result` as results.json and `lines` as tables.md in `out` (created); the table is printed too."""
    write_experiment(result, lines, out)
    print("\n".join(lines))


def write_rows(out: Path, checkpoint: Path, rows: list[dict], key: str, column: str, head: list[str]) -> None:
    """results.json and tables.md in `out`: one table row per `measure` row, labelled by `row[key]`."""
    lines = [*head, f"| {column} | held-out CE | max token RMS / median (block) | token (position) | "
             "position 0 / median |", "|---|---|---|---|---|"]
    lines += [f"| {r[key]} | {r['ce']:.3f} | {r['max_ratio']:.3g} ({r['at_block']}) | {r['token']!r} "
              f"({r['position']}) | {r['position0_max_ratio']:.3g} |" for r in rows]
    write_results(out, {"checkpoint": str(checkpoint), "rows": rows}, lines)


def checkpoint_parser(doc: str, n_sequences: int, out: Path | None = None) -> argparse.ArgumentParser:
    """The arguments every Gemma diagnostic starts from: a checkpoint, `--out` (required unless given a
    default) and `--n-sequences` of the held-out text."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--out", type=Path, required=out is None, default=out)
    parser.add_argument("--n-sequences", type=int, default=n_sequences)
    return parser


def main() -> None:
    args = checkpoint_parser(__doc__, n_sequences=8).parse_args()
    model, tokenizer, _, tokens = held_out(args.checkpoint, args.n_sequences)
    states = surgery.scale_states(model)
    real = [slot for slot, state in states.items() if slot.endswith("post_mlp") and not state.is_fixed]
    real.sort(key=lambda slot: -int(slot.split(".")[1]))  # the run's order: top block first
    rows = [{"fixed": f"checkpoint as trained ({sum(s.is_fixed for s in states.values())} of {len(states)} fixed)",
             **measure(model, tokens, tokenizer)}]
    for slot in real:
        states[slot].switch_to_fixed()
        rows.append({"fixed": f"+ {slot}", **measure(model, tokens, tokenizer)})
        print(rows[-1], flush=True)
    write_rows(args.out, args.checkpoint, rows, "fixed", "fixed (cumulative)",
               [f"# Fixing the remaining post_mlp norms of {args.checkpoint.name} without training", ""])

if __name__ == "__main__":
    main()
