"""Do the ids that run away late in a repeated row also run away alone at position 0? (issue 37, repeated probes)

In a row of BOS then one id repeated, every copy of the id has the same key and value in block 0, so whatever the
attention weights among the copies, a position's attention output is a blend of BOS's value and the id's own; as
the row grows, BOS's share shrinks and each position tends to the id attending to itself only: the state of the
id alone at position 0 (a sequence without BOS). If the late runaways that the 8-token mining misses are the ids
that run away alone, a one-token sweep of the whole vocabulary (a few CPU-minutes, `position0_sweep.py`) finds
them where a 64-token repeated sweep (about 8x the mining's CPU time) is too dear.

For one model, against the envelope of the validation half (never the test half): every id's largest residual
ratio alone at position 0; then BOS-led 64-token repeated rows of the `--top` ids with the highest such ratio,
of as many ids drawn at random from the rest, and of `--extra` ids (known late runaways):

    python experiments/robust/late_alone.py MODEL [--top 256] [--seed 1] [--extra 134966] [--out FILE.json]

It prints and writes how many ids of each group overflow at 64 tokens, and each overflowing or extra id's rank
by the one-token ratio.
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
from lnfree.removal.mining import OVERFLOW_RATIO
from position0_sweep import position0_ratio, validation_envelope


def groups(alone: np.ndarray, top: int, seed: int, extra: list[int]) -> dict[str, np.ndarray]:
    """The `top` ids by one-token ratio (`alone`, inf where non-finite), as many others at random (seeded), and the extra ids."""
    order = np.argsort(-alone, kind="stable")
    rest = order[top:]
    rng = np.random.default_rng(seed)
    return {"top_alone": order[:top], "random": np.sort(rng.choice(rest, size=top, replace=False)),
            "extra": np.asarray(extra, dtype=np.int64)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a run, checkpoint or export folder")
    parser.add_argument("--top", type=int, default=256, help="ids with the highest one-token ratio to probe")
    parser.add_argument("--seed", type=int, default=1, help="the random group's draw")
    parser.add_argument("--extra", default="", help="comma list of ids to add (e.g. known late runaways)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    model = load_models([args.model])[0]
    start = time.process_time()
    bos, limits = validation_envelope(model)
    alone = position0_ratio(model.module, model.vocab_size, limits)
    alone = np.where(np.isfinite(alone), alone, np.inf)  # a non-finite id ranks first
    rank = (-alone).argsort(kind="stable").argsort()  # 0: the highest ratio
    extra = [int(i) for i in args.extra.split(",") if i]
    record = {"model": args.model, "envelope": "realtext-val (whole validation half)", "overflow_ratio": OVERFLOW_RATIO,
              "vocab_size": model.vocab_size, "alone_overflow": int((alone > OVERFLOW_RATIO).sum()),
              "alone_quantiles": {str(q): float(np.quantile(alone[np.isfinite(alone)], q)) for q in (0.5, 0.9, 0.99, 0.999)},
              "groups": {}}
    for name, ids in groups(alone, args.top, args.seed, extra).items():
        if not len(ids):
            continue
        long = per_position_ratio(model.module, torch.from_numpy(ids), limits, bos, LONG).max(axis=1)
        over = long > OVERFLOW_RATIO
        shown = [i for i in range(len(ids)) if over[i] or name == "extra"]
        record["groups"][name] = {
            "ids": len(ids), "overflow_at_64": int(over.sum()), "alone_ratio_range": [float(alone[ids].min()),
                                                                                   float(alone[ids].max())],
            "rows": [{"id": int(ids[i]), "token": model.tokenizer.decode([int(ids[i])]), "ratio_64": float(long[i]),
                      "alone_ratio": float(alone[ids[i]]), "alone_rank": int(rank[ids[i]])} for i in shown]}
    record["cpu_seconds"] = round(time.process_time() - start, 1)
    print(json.dumps({k: v for k, v in record.items() if k != "groups"}, indent=1))
    for name, group in record["groups"].items():
        print(f"{name}: {group['overflow_at_64']} of {group['ids']} overflow at {LONG} tokens "
              f"(one-token ratio {group['alone_ratio_range'][0]:.3g}..{group['alone_ratio_range'][1]:.3g})")
        for row in group["rows"][:30]:
            print(f"  {row['id']:>7} {row['token']!r:>22}  at {LONG}: {row['ratio_64']:.3g}; alone {row['alone_ratio']:.3g} "
                  f"(rank {row['alone_rank']})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1, default=float))


if __name__ == "__main__":
    main()
