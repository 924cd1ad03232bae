"""Do the repeated ids that run away late in a 64-token row show early? (issue 37, repeated probes)

The one-command run mines repeated ids in rows of 8 tokens (`lnfree.removal.mining.SWEEP_CONTEXT`); its model
still overflows on 3 of 512 repeated probes, each past position 38. Mining the whole vocabulary at 64 tokens
would cost 8x the 36 CPU-minutes of the 8-token sweep. A two-stage sweep (8 tokens for every id, 64 for the
highest few per cent) would cost little more than today's, if the late runaways already stand out at 8 tokens.
This measures that on a seeded sample of ids, against the envelope of the validation half (never the test
half), for one model:

    python experiments/robust/late_repeats.py MODEL [--of 32] [--extra 53,881] [--out FILE.json]

Each context is a pass of its own: a row that goes non-finite late leaks NaN into its earlier positions through
the attention mask (a NaN key plus the mask's -inf is NaN), so the first positions of a 64-token row are not the
short row. A short context's score of an id is its largest ratio over positions 1 .. c - 1 (position 0, BOS,
is the same in every row and sits near the envelope itself). It prints and writes, per context, how many
sampled ids overflow, and for the ids that overflow at 64 tokens but not at 8: their rank by each short
context's score among all sampled ids, and what share a top-k second stage at that context would catch.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from lnfree.evaluate import load_models
from lnfree.removal.mining import (OVERFLOW_RATIO, SWEEP_CONTEXT, repeated_sequences, residual_norms,
                                   residual_stream, vocabulary_part)
from position0_sweep import validation_envelope

LONG = 64
SHORT = (SWEEP_CONTEXT, 16, 32)
TOP_SHARES = (0.01, 0.02, 0.05, 0.10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a run, checkpoint or export folder")
    parser.add_argument("--of", type=int, default=32, help="sample one part of the vocabulary cut into this many")
    parser.add_argument("--seed", type=int, default=1, help="the sample's permutation (the runs mine with seed 0)")
    parser.add_argument("--extra", default="", help="comma list of ids to add (e.g. known late runaways)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    model = load_models([args.model])[0]
    start = time.process_time()
    bos, limits = validation_envelope(model)
    extra = [int(i) for i in args.extra.split(",") if i]
    ids = torch.from_numpy(np.concatenate([vocabulary_part(model.vocab_size, [0], args.of, args.seed), extra]))
    ratio = per_position_ratio(model.module, ids, limits, bos, LONG)  # (ids, LONG)
    long = ratio.max(axis=1)
    score = {c: per_position_ratio(model.module, ids, limits, bos, c)[:, 1:].max(axis=1) for c in SHORT}
    rank = {c: (-score[c]).argsort(kind="stable").argsort() for c in SHORT}  # 0: the highest score
    short = score[SWEEP_CONTEXT]
    late = np.flatnonzero((long > OVERFLOW_RATIO) & ~(short > OVERFLOW_RATIO))
    record = {
        "model": args.model, "envelope": "realtext-val (whole validation half)", "sampled": len(ids),
        "extra": extra, "overflow_ratio": OVERFLOW_RATIO,
        f"overflow_at_{SWEEP_CONTEXT}": int((short > OVERFLOW_RATIO).sum()),
        f"overflow_at_{LONG}": int((long > OVERFLOW_RATIO).sum()),
        "late_only": len(late),
        "late": [{"id": int(ids[i]), "token": model.tokenizer.decode([int(ids[i])]), "ratio_long": float(long[i]),
                  # where a finite row first overflows (a non-finite row's NaN has leaked to its start)
                  "first_over": int(np.argmax(ratio[i] > OVERFLOW_RATIO)) if np.isfinite(long[i]) else None,
                  **{f"score_{c}": float(score[c][i]) for c in SHORT}, **{f"rank_{c}": int(rank[c][i]) for c in SHORT}}
                 for i in late[np.argsort(rank[16][late])]],
        "caught_by_top_share": {c: {str(s): int((rank[c][late] < s * len(ids)).sum()) for s in TOP_SHARES} for c in SHORT},
        "score_quantiles": {c: {str(q): float(np.quantile(score[c][np.isfinite(score[c])], q)) for q in (0.5, 0.9, 0.99)}
                            for c in SHORT},
        "cpu_seconds": round(time.process_time() - start, 1),
    }
    print(json.dumps({k: v for k, v in record.items() if k != "late"}, indent=1))
    for row in record["late"][:40]:
        print(f"  {row['id']:>7} {row['token']!r:>20}  first over at {row['first_over'] or '-':>2}; " + ", ".join(
            f"{c}: {row[f'score_{c}']:.3g} (rank {row[f'rank_{c}']})" for c in SHORT))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))


@torch.no_grad()
def per_position_ratio(model: torch.nn.Module, ids: torch.Tensor, limits: torch.Tensor, bos: int | None,
                       context: int, batch_size: int = 64) -> np.ndarray:
    """Per id and position, the largest residual norm over the envelope of BOS and the id repeated to `context`
    tokens (inf where non-finite), under bf16 autocast."""
    out = []
    for start in range(0, len(ids), batch_size):
        rows = repeated_sequences(ids[start:start + batch_size].numpy(), context, bos)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            stream, _ = residual_stream(model, rows, head=False)
        out.append((residual_norms(stream) / limits.clamp_min(1e-30)[:, None, None]).amax(dim=0))
    return torch.cat(out).numpy()


if __name__ == "__main__":
    main()
