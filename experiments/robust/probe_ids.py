"""A few ids, alone and repeated, in several models: where does each run away? (issue 37, repeated probes)

For each model, against the envelope of the validation half (never the test half): each id's largest residual
ratio alone at position 0 (a one-token row, input without BOS) and in a BOS-led row of the id repeated to 64
tokens, with the first position that overflows there. Cheaper than `late_alone.py` (no sweep of the vocabulary)
when the ids are known, e.g. to follow one runaway across checkpoints or arms:

    python experiments/robust/probe_ids.py MODEL [MODEL ...] --ids 1,37875 [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from late_repeats import LONG, per_position_ratio
from lnfree.evaluate import load_models
from lnfree.removal.mining import OVERFLOW_RATIO, alone_sweep
from position0_sweep import validation_envelope


def probe(path: str, ids: list[int]) -> dict:
    """One model's record: per id, its ratio alone and at `LONG` tokens repeated, and where that row first overflows."""
    model = load_models([path])[0]
    start = time.process_time()
    bos, limits = validation_envelope(model)
    tensor = torch.tensor(ids)
    alone = alone_sweep(model.module, tensor, limits, batch_size=len(ids), bf16=True).numpy()
    ratio = per_position_ratio(model.module, tensor, limits, bos, LONG)  # (ids, LONG)
    rows = []
    for i, token in enumerate(ids):
        long = float(ratio[i].max())  # inf where non-finite
        rows.append({"id": token, "token": model.tokenizer.decode([token]), "alone_ratio": float(alone[i]),
                     # where a finite row first overflows (a non-finite row's NaN leaks to its start)
                     "ratio_64": long, "first_over": int(np.argmax(ratio[i] > OVERFLOW_RATIO)) if OVERFLOW_RATIO < long < np.inf else None})
    return {"model": path, "rows": rows, "cpu_seconds": round(time.process_time() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="run, checkpoint or export folders")
    parser.add_argument("--ids", required=True, help="comma list of token ids")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ids = [int(i) for i in args.ids.split(",") if i]
    record = {"envelope": "realtext-val (whole validation half)", "overflow_ratio": OVERFLOW_RATIO, "context": LONG,
              "models": []}
    for path in args.models:
        record["models"].append(probe(path, ids))
        for row in record["models"][-1]["rows"]:
            print(f"{path}: {row['id']:>7} {row['token']!r:>14}  alone {row['alone_ratio']:.3g}; at {LONG}: "
                  f"{row['ratio_64']:.3g} (first over at {row['first_over']})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1, default=float))


if __name__ == "__main__":
    main()
