"""Which ids run away alone at position 0, where a sequence without BOS puts its first token (issue 37).

Without BOS, the LN-free Gemma 3 270M goes non-finite on about a third of the validation sequences, and in 85 %
of them the token that runs away is the first (`first_nonfinite.py`). A token at position 0 attends to itself
only, so what it writes there is a function of its id alone: one forward of every id as a one-token row
measures position 0 for every sequence without BOS at once (a few CPU-minutes for 262,144 ids). Each id's
largest residual norm over the envelope of the validation half (BOS-led, as `lnfree.removal.mining`):

    python experiments/robust/position0_sweep.py MODEL [MODEL ...] [--out FILE.json]
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
from lnfree.evaluate.datasets import load_sequences, resolve_dataset
from lnfree.removal.mining import OVERFLOW_RATIO, SWEEP_CONTEXT, alone_sweep, text_envelope

CONTEXT = 64


def position0_ratio(model: torch.nn.Module, vocab_size: int, limits: torch.Tensor, batch_size: int = 4096) -> np.ndarray:
    """Per id, its largest residual norm over `limits` as a one-token row (inf where non-finite), bf16 autocast."""
    chunks = torch.arange(vocab_size).split(batch_size)
    return torch.cat([alone_sweep(model, chunk, limits, batch_size=batch_size // SWEEP_CONTEXT, bf16=True)
                      for chunk in tqdm(chunks, desc="ids at position 0", unit="batch")]).numpy()


def validation_envelope(model) -> tuple[int | None, torch.Tensor]:
    """(BOS id or None, per-layer envelope) of an `lnfree.evaluate` model on the whole validation half, BOS-led,
    `CONTEXT` tokens a row, under bf16 autocast (never the test half)."""
    bos = bos_token(model.module.config, model.tokenizer)
    text = load_sequences(resolve_dataset("realtext-val"), model.tokenizer, context=CONTEXT, n_sequences=None,
                          vocab_size=model.vocab_size, bos_token_id=bos)
    return bos, text_envelope(model.module, torch.from_numpy(text), bf16=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    record = {"envelope": "realtext-val (BOS-led, whole validation half)", "overflow_ratio": OVERFLOW_RATIO, "models": {}}
    for source in args.models:
        model = load_models([source])[0]
        start = time.process_time()
        _, limits = validation_envelope(model)
        ratio = position0_ratio(model.module, model.vocab_size, limits)
        over = np.flatnonzero(ratio > OVERFLOW_RATIO)
        worst = over[np.argsort(-ratio[over], kind="stable")]
        record["models"][source] = {
            "ids": len(ratio), "overflow": len(over), "nonfinite": int((~np.isfinite(ratio)).sum()),
            "ratio_quantiles": {str(q): float(np.quantile(ratio[np.isfinite(ratio)], q)) for q in (0.5, 0.9, 0.99)},
            "worst": [[int(i), model.tokenizer.decode([int(i)]), float(ratio[i]) if np.isfinite(ratio[i]) else "inf"]
                      for i in worst[:30]],
            "cpu_seconds": round(time.process_time() - start, 1),
        }
        summary = {k: v for k, v in record["models"][source].items() if k != "worst"}
        print(source, json.dumps(summary))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
