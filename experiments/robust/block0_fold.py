"""Would folding block 0's input norm into the embedding change anything? (issue 37, "an exact first step")

In a RoPE family the residual entering block 0 is the token's (scaled) embedding alone, so block 0's input norm
divides by a function of the token id, which could fold into the embedding table before the removal starts: an
exact first step. It gains only where the embedding rows' RMS differ. For a fine-tuned (or original) model this
measures, over every id of the vocabulary, the RMS of the residual entering block 0 against the σ that each of
block 0's fixed input-side norms divides by (the fixed form is exact for an id where σ / RMS = 1):

    python experiments/robust/block0_fold.py MODEL [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lnfree.evaluate import load_models
from lnfree.fixedscale.surgery import removal_state

QUANTILES = (0.0, 0.001, 0.5, 0.999, 1.0)


@torch.no_grad()
def row_rms(embedding: torch.nn.Module, vocab_size: int, batch_size: int = 16384) -> torch.Tensor:
    """The RMS of each id's embedding as block 0 receives it (a scaled embedding's scale included)."""
    out = [embedding(torch.arange(s, min(s + batch_size, vocab_size))).float().pow(2).mean(-1).sqrt()
           for s in range(0, vocab_size, batch_size)]
    return torch.cat(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a run, checkpoint or export folder of a RoPE family")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = load_models([args.model])[0]
    rms = row_rms(model.module.get_input_embeddings(), model.vocab_size)
    median = rms.median()
    record = {"model": args.model, "ids": len(rms),
              "rms_quantiles": {str(q): float(torch.quantile(rms, q)) for q in QUANTILES},
              "largest_deviation_from_median": float((rms / median - 1).abs().max()), "block0_norms": {}}
    for slot, state in removal_state(model.module).items():
        if slot.startswith("blocks.0.") and state["fixed"] and slot.split(".")[-1].startswith("ln_1"):
            ratio = state["sigma"] / rms
            record["block0_norms"][slot] = {"sigma": state["sigma"], "sigma_over_rms_min": float(ratio.min()),
                                            "sigma_over_rms_max": float(ratio.max())}
    print(json.dumps(record, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
