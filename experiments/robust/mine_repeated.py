"""Mine the token ids that run away when repeated (issue 37, direction "vocabulary coverage and replay").

Sweeps BOS + one id repeated to a short context over a seeded share of the vocabulary (or all of it)
through the model's body (`lnfree.removal.mining`) and writes, per id, its largest residual norm
over the model's envelope, taken from an earlier `lnfree stress` record of the same model:

    python experiments/robust/mine_repeated.py MODEL --envelope STRESS.json --part 0,1,2,3 --of 16 \
        [--context 8] [--fp32] --out ids.json

`--part K --of N` cuts a seeded permutation of the vocabulary into N equal parts and sweeps parts K (a
comma list): disjoint parts give a mined set and a held-out set of the same kind; `--ids-from MINED.json`
sweeps only the ids an earlier mining found overflowing (did they stay so?). The JSON holds the
settings, `overflow` (the ids above `OVERFLOW_RATIO`, worst first, which `train.coverage.replay` reads),
the `TOP` highest ids with their ratio and quantiles of the finite ratios (the swept ids follow from the settings).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from lnfree.data.documents import bos_token
from lnfree.evaluate import load_models
from lnfree.evaluate.stress import recorded_envelope
from lnfree.removal.mining import OVERFLOW_RATIO, SWEEP_CONTEXT, repeated_sweep, vocabulary_part

#: How many of the highest ids the record lists with their ratio, and the quantiles it gives of all.
TOP = 200
QUANTILES = (0.5, 0.9, 0.99, 0.999)


def _quantiles(ratio: np.ndarray) -> dict[str, float]:
    """`QUANTILES` of the finite ratios (a runaway id's is inf)."""
    finite = ratio[np.isfinite(ratio)]
    return {str(q): float(np.quantile(finite, q)) for q in QUANTILES} if len(finite) else {}


def _finite(value: float) -> float | str:
    return value if np.isfinite(value) else "inf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a run, checkpoint or export folder, or a model name")
    parser.add_argument("--envelope", type=Path, required=True, help="a `lnfree stress` JSON of this model")
    parser.add_argument("--label", help="its record's label (default: the first)")
    parser.add_argument("--part", default="0", help="comma list of parts to sweep")
    parser.add_argument("--of", type=int, default=1, help="parts the vocabulary is cut into (1: all of it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ids-from", type=Path, help="sweep only the `overflow` ids of an earlier mining")
    parser.add_argument("--context", type=int, default=SWEEP_CONTEXT)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    label, limits = recorded_envelope(args.envelope, args.label)
    model = load_models([args.model])[0]
    bos = bos_token(model.module, model.tokenizer)
    if args.ids_from:
        ids = np.asarray(json.loads(args.ids_from.read_text())["overflow"], dtype=np.int64)
    else:
        ids = vocabulary_part(model.vocab_size, [int(k) for k in args.part.split(",")], args.of, args.seed)
    start = time.process_time()
    with tqdm(total=len(ids), desc="repeated ids", unit="id") as bar:
        ratio = repeated_sweep(model.module, torch.from_numpy(ids), limits, bos=bos, context=args.context,
                               batch_size=args.batch_size, bf16=not args.fp32, progress=bar)
    order = np.argsort(-ratio.numpy(), kind="stable")
    over = [int(ids[i]) for i in order if ratio[i] > OVERFLOW_RATIO]
    record = {
        "model": args.model, "envelope_from": f"{args.envelope} ({label})", "context": args.context,
        "bos": bos, "bf16": not args.fp32, "parts": args.part, "of": args.of, "seed": args.seed,
        "ids_from": str(args.ids_from) if args.ids_from else None,
        "swept": len(ids), "overflow_ratio": OVERFLOW_RATIO, "n_overflow": len(over),
        "n_nonfinite": int((~ratio.isfinite()).sum()), "cpu_seconds": round(time.process_time() - start, 1),
        "overflow": over, "overflow_text": [model.tokenizer.decode([i]) for i in over[:200]],
        "finite_ratio_quantiles": _quantiles(ratio.numpy()),
        "top": [[int(ids[i]), _finite(float(ratio[i]))] for i in order[:TOP]],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record))
    print(f"{len(over)} of {len(ids)} repeated ids overflow ({record['n_nonfinite']} non-finite); "
          f"{record['cpu_seconds']} CPU-s; written to {args.out}")


if __name__ == "__main__":
    main()
