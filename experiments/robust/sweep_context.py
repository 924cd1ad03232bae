"""How many repeats a repeated-id runaway needs, and whether bf16 sees it as fp32 does (issue 37).

Checks the short context of `lnfree.removal.mining`'s sweep on one model: for the repeated-probe ids of its
`lnfree stress` record (the worst first) and a seeded sample of random ids, the largest residual norm over
the envelope of BOS and the id repeated to each context, in fp32 and under bf16 autocast:

    python experiments/robust/sweep_context.py MODEL --stress STRESS.json [--ids 6] [--random 512] [--out FILE.txt]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from lnfree.data.documents import bos_token
from lnfree.evaluate import load_models
from lnfree.evaluate.stress import recorded_envelope
from lnfree.removal.mining import OVERFLOW_RATIO, repeated_sweep

CONTEXTS = (2, 3, 4, 6, 8, 16, 32, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--stress", type=Path, required=True, help="a `lnfree stress` JSON of this model")
    parser.add_argument("--ids", type=int, default=6, help="how many of its worst repeated probes")
    parser.add_argument("--random", type=int, default=512, help="random ids whose overflow counts are compared")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    label, limits = recorded_envelope(args.stress)
    record = json.loads(args.stress.read_text())["models"][label]
    probes = list(dict.fromkeys(w["token_id"] for w in record["worst"] if w["part"] == "repeated"))[:args.ids]
    model = load_models([args.model])[0]
    bos = bos_token(model.module, model.tokenizer)
    lines = [f"# {args.model}: largest norm over the envelope, BOS + the id repeated to each context (fp32 / bf16)",
             "", "| id | token | " + " | ".join(str(c) for c in CONTEXTS) + " |", "|---" * (len(CONTEXTS) + 2) + "|"]
    ids = torch.tensor(probes)
    by_context = {c: [repeated_sweep(model.module, ids, limits, bos=bos, context=c, bf16=bf16) for bf16 in (False, True)]
                  for c in CONTEXTS}
    for i, token in enumerate(probes):
        cells = [f"{float(by_context[c][0][i]):.3g} / {float(by_context[c][1][i]):.3g}" for c in CONTEXTS]
        lines.append(f"| {token} | {model.tokenizer.decode([token])!r} | " + " | ".join(cells) + " |")
    sample = torch.from_numpy(np.random.default_rng(args.seed).integers(0, model.vocab_size, args.random))
    lines.append("")
    for context in (4, 8):
        fp32, bf16 = (repeated_sweep(model.module, sample, limits, bos=bos, context=context, bf16=b) for b in (False, True))
        over32, over16 = (set(sample[r > OVERFLOW_RATIO].tolist()) for r in (fp32, bf16))
        lines.append(f"{args.random} random ids at context {context}: {len(over32)} overflow in fp32, {len(over16)} "
                     f"under bf16, the same ids: {over32 == over16}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
