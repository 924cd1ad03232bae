"""Which held-out sequences and tokens run away in a removal checkpoint, without its scale ceiling.

    python experiments/gemma3/runaway_tokens.py CHECKPOINT --out DIR [--n-sequences 66] [--batch 6]

The run's evaluation logs one held-out CE under the ceiling and one without it (NaN as soon as one
token overflows). This splits the held-out sequences (BOS first, as the run reads them) into batches
and measures each without the ceiling: its CE, and the token whose residual RMS is the largest
multiple of the median token's at any block (position 0 aside), with position 0's ratio
(`experiments/gemma3/post_mlp_runaway.py`'s `measure`). Writes results.json and tables.md to DIR.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from post_mlp_runaway import checkpoint_parser, held_out, measure, write_rows  # noqa: E402


def main() -> None:
    parser = checkpoint_parser(__doc__, n_sequences=66)
    parser.add_argument("--batch", type=int, default=6)
    args = parser.parse_args()
    model, tokenizer, _, tokens = held_out(args.checkpoint, args.n_sequences)
    rows = []
    with torch.no_grad():
        for first in range(0, args.n_sequences, args.batch):
            batch = tokens[first:first + args.batch]
            rows.append({"sequences": f"{first}–{first + len(batch) - 1}", **measure(model, batch, tokenizer)})
            print(rows[-1], flush=True)
    finite = [r["ce"] for r in rows if math.isfinite(r["ce"])]
    write_rows(args.out, args.checkpoint, rows, "sequences", "sequences",
               [f"# Held-out sequences of {args.checkpoint.name} without the scale ceiling", "",
                f"{len(rows)} batches of {args.batch} sequences; {len(finite)} finite, their CE "
                f"{min(finite):.3f}–{max(finite):.3f}.", ""])

if __name__ == "__main__":
    main()
