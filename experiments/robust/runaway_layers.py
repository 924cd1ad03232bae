"""Where mined repeated-id runaways leave the envelope, block by block (issue 37).

For the first ids of a `mine_repeated.py` record, BOS and the id repeated to a short context through the
model's body: per block input (and the final norm's), the largest norm over the envelope of the model's
`lnfree stress` record, at the last position, and the first block where any position exceeds 10×:

    python experiments/robust/runaway_layers.py MODEL --stress STRESS.json --mined MINED.json [--ids 12] [--out FILE.txt]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from lnfree.data.documents import bos_token
from lnfree.evaluate import load_models
from lnfree.evaluate.stress import recorded_envelope
from lnfree.removal.mining import OVERFLOW_RATIO, SWEEP_CONTEXT, repeated_sequences, residual_norms, residual_stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--stress", type=Path, required=True)
    parser.add_argument("--mined", type=Path, required=True)
    parser.add_argument("--ids", type=int, default=12)
    parser.add_argument("--context", type=int, default=SWEEP_CONTEXT)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    _, limits = recorded_envelope(args.stress)
    ids = json.loads(args.mined.read_text())["overflow"][:args.ids]
    model = load_models([args.model])[0]
    rows = repeated_sequences(np.asarray(ids), args.context, bos_token(model.module, model.tokenizer))
    stream, _ = residual_stream(model.module, rows, head=False)
    ratio = residual_norms(stream) / limits[:, None, None]  # (layers + 1, ids, positions)
    lines = [f"# {args.model}: norm over the envelope at the last position, per block input (then the final norm's)",
             ""]
    for i, token in enumerate(ids):
        over = (ratio[:, i] > OVERFLOW_RATIO).any(dim=1).nonzero()
        first = int(over[0]) if len(over) else None
        chain = ", ".join("inf" if not math.isfinite(v) else f"{v:.3g}" for v in ratio[:, i, -1].tolist())
        lines.append(f"{model.tokenizer.decode([token])!r} ({token}): first block above {OVERFLOW_RATIO:g}×: {first}; {chain}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
