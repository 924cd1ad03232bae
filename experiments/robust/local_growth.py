"""How much does one gated MLP sublayer amplify a token that arrives too large? The local growth factor.

    python experiments/robust/local_growth.py MODEL [--factor 2 --factor 4] [--random-rows N] --out DIR

MODEL is a name (smollm2-135m, gemma3-270m: every norm real, σ measured on held-out realtext), or a run or
checkpoint folder (its norms as saved). The residuals are those of the model's own forward; each block's MLP
sublayer is then evaluated with its norms fixed (those still real switched to their σ for that evaluation
only, so a block is measured as it will be once fixed, on the residuals it sees now, without the chain of the
blocks below). For every block and every real-text token t (position 0 aside), with h the residual entering the
MLP sublayer and M(h) what the sublayer adds (its input norm, the MLP, its output norm where the family has one):

    r_c = |c·h + M(c·h)| / (c·|h + M(h)|),    g_c = 1 + log(r_c) / log(c)

g_c is the factor by which the sublayer multiplies a token's log-excess of scale log(c): 1 for a sublayer that
passes a scaled token on scaled (a GELU MLP behind a fixed norm, which is about 1-homogeneous), below 1 with a
real norm (it adds a fixed-size output to a larger stream), above 1 for a gated MLP behind a fixed norm (its
output grows with c²). A chain of blocks with g > 1 compounds a small excess into an overflow: the log-excess of
the traced SmolLM2 runaway words grew about 1.4× a block (experiments/results/smollm2-135m/README.md). Writes
growth.json and tables.md (median, 90th and 99th percentile and maximum of g_c over tokens, per block).
With --random-rows N the tokens measured are N rows of random ids instead (BOS first where the family reads one,
seeded; as `lnfree stress`'s vocabulary sweep): rare ids in random contexts are where a trained LN-free Gemma
still runs away. Tokens whose residual is already non-finite count as +inf.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from lnfree.data.documents import bos_token, prepare_data
from lnfree.evaluate import load_models
from lnfree.fixedscale import surgery
from lnfree.models.base import load_base
from lnfree.removal.config import DataConfig
from lnfree.removal.losses.growth import MlpSublayers, growth_factors
from lnfree.removal.mining import random_rows

QUANTILES = (0.5, 0.9, 0.99)


@torch.no_grad()
def local_growth(model, ids: torch.Tensor, factors: list[float]) -> dict:
    """{factor: per block, g_c of every token after the first, the block's MLP sublayer as fixed}."""
    sublayers = MlpSublayers(model)
    try:
        with sublayers.capturing():
            model(input_ids=ids, use_cache=False)
        inputs = sublayers.take()
    finally:
        sublayers.remove()
    return {c: [growth_factors(sublayers, i, h[:, 1:].float(), c).flatten().nan_to_num(nan=math.inf)
                for i, h in enumerate(inputs)] for c in factors}


def summarise(g: torch.Tensor) -> dict:
    """Quantiles and maximum of one block's growth factors."""
    finite = g[g.isfinite()]
    out = {f"q{int(q * 100)}": float(finite.quantile(q)) if finite.numel() else math.inf for q in QUANTILES}
    out.update(max=float(g.max()), over_1_5=float((g > 1.5).float().mean()), tokens=int(g.numel()))
    return out


def load(name: str, n_sequences: int, random: int = 0):
    """(the model, its scored ids, a description): a named base model (every norm real, σ measured on held-out
    text), or a run or checkpoint with its norms as saved."""
    if Path(name).exists():
        loaded = load_models([name], ["model"], form="hf", dtype="fp32")[0]
        model, tokenizer = loaded.module, loaded.tokenizer
        if not surgery.is_installed(model):
            raise SystemExit(f"{name} has no lnfree norms to measure (an export: load its run or checkpoint)")
        described = f"{name} (norms as saved)"
    else:
        model, tokenizer = load_base(name)
        described = None
    model.eval()
    data = prepare_data(DataConfig(source="realtext", context_length=64, eval_sequences=2 * n_sequences),
                        tokenizer, 64, model.config.vocab_size, bos_token(model, tokenizer))
    tokens = data.eval_batch(2 * n_sequences)
    if described is None:
        surgery.install(model)
        surgery.initialise_sigmas(model, tokens[:n_sequences].split(4))
        described = f"{name} (the original, σ measured on {n_sequences} held-out sequences)"
    if random:
        bos = bos_token(model, tokenizer)
        order = np.random.default_rng(0).permutation(model.config.vocab_size)[: random * (64 - (bos is not None))]
        return model, random_rows(order, 64, bos), described + f"; {random} rows of random ids"
    return model, tokens[n_sequences:], described


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--factor", action="append", type=float, default=None, help="c (default 2 and 4)")
    parser.add_argument("--n-sequences", type=int, default=8, help="sequences for σ, and as many measured")
    parser.add_argument("--random-rows", type=int, default=0, help="measure N rows of random ids instead of text")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    factors = args.factor or [2.0, 4.0]
    model, ids, described = load(args.model, args.n_sequences, args.random_rows)
    growth = local_growth(model, ids, factors)
    rows = {str(c): [summarise(g) for g in blocks] for c, blocks in growth.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "growth.json").write_text(json.dumps({"model": described, "tokens": int(ids[:, 1:].numel()),
                                                       "factors": factors, "blocks": rows}, indent=1))
    lines = [f"# Local growth factor g_c of each MLP sublayer: {described}", "",
             f"{int(ids[:, 1:].numel())} tokens (position 0 aside). g_c = 1 + log(r_c) / log(c), r_c = "
             "|c·h + M(c·h)| / (c·|h + M(h)|): 1 passes a scaled token on scaled, above 1 amplifies its excess.", ""]
    for c, blocks in rows.items():
        lines += [f"## c = {c}", "", "| block | median | p90 | p99 | max | share > 1.5 |", "|---|---|---|---|---|---|"]
        lines += [f"| {i} | {r['q50']:.3f} | {r['q90']:.3f} | {r['q99']:.3f} | {r['max']:.3g} | {r['over_1_5']:.3f} |"
                  for i, r in enumerate(blocks)]
        lines.append("")
    (args.out / "tables.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
