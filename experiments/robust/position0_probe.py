"""Can position 0 be bounded for every id cheaply? A probe, not a recipe (issue 37: input without BOS).

Half of Gemma 3 270M's vocabulary runs away alone at position 0 in the LN-free model (`position0_sweep.py`).
One-token rows cost one token each, so a hinge on them is nearly free beside a text micro-batch. This probe
trains a finished LN-free model on that hinge alone (nothing else, the embeddings frozen as in the recipe,
under the recipe's training-time ceiling so that the runaway ids give a gradient), on the even ids only, and
then measures (no ceiling) how many ids overflow at position 0 among the even ids and the odd ids it never
trained on, and the BOS-led CE on the first 64 validation sequences (what the runs evaluate), before and after:

    python experiments/robust/position0_probe.py MODEL [--hinge norms|residual] [--steps 100] [--rows 256] \
        [--lr 3e-5] [--out FILE.json]

The hinge, per row, `--hinge residual`: Σ over block inputs and the final norm's input of
max(0, log(norm / typical) − log 2)², with `typical` the median norm of the validation text's tokens after
position 0 at that layer; `--hinge norms` (default): the recipe's coverage hinge
(`lnfree.removal.losses.coverage.coverage_hinge`) at every norm's input, position 0 included, against the
validation text's typical scale there — it also reads the norms after each sublayer, whose inputs the
training-time ceiling clamps.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lnfree.arch import architecture
from lnfree.data.documents import bos_token
from lnfree.evaluate import load_models
from lnfree.evaluate.datasets import load_sequences, resolve_dataset
from lnfree.fixedscale.ceiling import set_ceiling
from lnfree.removal.losses.coverage import coverage_hinge, typical_log_scales
from lnfree.removal.losses.massive import NormInputs
from lnfree.removal.mining import OVERFLOW_RATIO, residual_norms, residual_stream, text_envelope

from position0_sweep import CONTEXT, position0_ratio

CEILING = 8.0  # the recipe's training-time ceiling (train.scale_ceiling) before its release
EVAL_SEQUENCES = 64


@torch.no_grad()
def text_ce(model: torch.nn.Module, rows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token CE of `rows` (fp32)."""
    total, count = 0.0, 0
    for batch in rows.split(batch_size):
        logits = model(input_ids=batch, use_cache=False).logits.float()
        ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total, count = total + float(ce), count + batch[:, 1:].numel()
    return total / count


def overflow_counts(model: torch.nn.Module, vocab_size: int, limits: torch.Tensor) -> dict:
    """Ids overflowing alone at position 0 (no ceiling): even ids, odd ids."""
    ratio = position0_ratio(model, vocab_size, limits)
    return {"even": int((ratio[0::2] > OVERFLOW_RATIO).sum()), "odd": int((ratio[1::2] > OVERFLOW_RATIO).sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--hinge", choices=("norms", "residual"), default="norms")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    loaded = load_models([args.model])[0]
    model, vocab = loaded.module, loaded.vocab_size
    bos = bos_token(model.config, loaded.tokenizer)
    text = torch.from_numpy(load_sequences(resolve_dataset("realtext-val"), loaded.tokenizer, context=CONTEXT,
                                           n_sequences=None, vocab_size=vocab, bos_token_id=bos))
    evaluated = text[:EVAL_SEQUENCES]
    start = time.process_time()
    limits = text_envelope(model, text, bf16=True)
    with torch.no_grad():
        norms = residual_norms(residual_stream(model, evaluated, head=False)[0])[:, :, 1:].flatten(1)
    log_typical = norms.median(dim=1).values.log()
    arch = architecture(model)
    norm_inputs = NormInputs(model)
    with torch.no_grad(), norm_inputs.capturing():
        model(input_ids=evaluated, use_cache=False)
    typical = typical_log_scales(norm_inputs.take(), evaluated, loaded.tokenizer.eos_token_id, arch.norm_kind)
    before = {"ce": text_ce(model, evaluated), **overflow_counts(model, vocab, limits)}
    print("before", before)

    embedding = model.get_submodule(arch.token_embedding).weight
    params = [p for p in model.parameters() if p is not embedding]
    embedding.requires_grad_(False)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    stream_with_grad = residual_stream.__wrapped__  # the same capture, with gradients
    rng = np.random.default_rng(args.seed)
    set_ceiling(model, CEILING)
    model.train()
    log = []
    for step in tqdm(range(args.steps), desc="position-0 hinge"):
        ids = torch.from_numpy(2 * rng.integers(0, vocab // 2, args.rows))[:, None]
        with torch.autocast("cpu", dtype=torch.bfloat16), norm_inputs.capturing():
            stream, _ = stream_with_grad(model, ids, head=False)
        if args.hinge == "norms":
            loss = coverage_hinge(norm_inputs.take(), typical, arch.norm_kind, 2.0, torch.ones(len(ids), dtype=torch.bool))
        else:
            log_norm = torch.linalg.vector_norm(stream.float(), dim=-1)[:, :, 0].clamp_min(1e-12).log()  # (layers, rows)
            loss = (log_norm - log_typical[:, None] - math.log(2)).clamp_min(0).pow(2).sum(dim=0).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        log.append({"step": step + 1, "loss": float(loss), "grad_norm": float(grad_norm)})
    model.eval()
    set_ceiling(model, math.inf)
    after = {"ce": text_ce(model, evaluated), **overflow_counts(model, vocab, limits)}
    print("after", after)
    norm_inputs.remove()
    record = {"model": args.model, "hinge": args.hinge, "steps": args.steps, "rows": args.rows, "lr": args.lr, "ceiling": CEILING,
              "ids": {"even": (vocab + 1) // 2, "odd": vocab // 2}, "before": before, "after": after,
              "cpu_seconds": round(time.process_time() - start, 1), "log": log[::5] + log[-1:]}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
