"""Does a removal keep the attention sink? Attention on position 0 and row entropy by query position (issue 37).

    python experiments/robust/attention_sink.py MODEL... [--labels ...] [--sequences 32] [--out FILE.md] [--json F]

Runs every model (names or checkpoint folders) with eager attention on the first `--sequences` sequences of
the realtext validation half (never the test half) and reports, per group of query positions, the mean
attention weight on position 0 (BOS, the sink) over every head and block, per block and in all, and the
mean entropy of the attention rows. A head that can rest on the sink puts its weight there when nothing in
the context serves it; a removal that shortens the sink's key spreads that weight over the context.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lnfree.data.documents import bos_token, prepare_data
from lnfree.evaluate import load_models
from lnfree.removal.config import DataConfig
from lnfree.removal.losses.attention import AttentionPatterns

QUERIES = ((1, 3), (4, 15), (16, 63))  # the query's position in its sequence


@torch.no_grad()
def sink_profile(model, ids: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean attention on position 0, mean row entropy), each (blocks, queries) averaged over sequences and heads."""
    patterns = AttentionPatterns(model)
    sink = entropy = 0
    for chunk in ids.split(batch):
        with patterns.capturing():
            model(input_ids=chunk, use_cache=False)
        rows = torch.stack([p.float() for p in patterns.take()])  # blocks, batch, heads, queries, keys
        sink = sink + rows[..., 0].sum((1, 2))
        entropy = entropy - torch.xlogy(rows, rows).sum(-1).sum((1, 2))
    patterns.remove()
    count = len(ids) * rows.shape[2]
    return sink / count, entropy / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="model names or checkpoint folders")
    parser.add_argument("--labels", nargs="+")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, help="the table, as markdown")
    parser.add_argument("--json", type=Path, help="the same numbers as JSON")
    args = parser.parse_args()
    loaded = load_models(args.models, args.labels, form="hf", dtype="fp32")
    tokenizer, config = loaded[0].tokenizer, loaded[0].module.config
    bos = bos_token(loaded[0].module, tokenizer)
    data = prepare_data(DataConfig(source="realtext", context_length=64), tokenizer, 64, config.vocab_size, bos)
    ids = data.eval_batch(args.sequences)
    lines = [f"Attention on position 0 (the sink) and row entropy (nats), mean over heads, on the first {len(ids)} "
             "sequences of the realtext validation half (fp32, eager attention)", "",
             "| model | queries | on position 0, all blocks | entropy | on position 0 per block |", "|---|---|---|---|---|"]
    record = {}
    for model in loaded:
        sink, entropy = sink_profile(model.module.eval(), ids, args.batch_size)
        record[model.label] = {}
        for a, b in QUERIES:
            s, e = sink[:, a:b + 1].mean(1), entropy[:, a:b + 1].mean(1)
            record[model.label][f"{a}-{b}"] = {"sink": float(s.mean()), "entropy": float(e.mean()),
                                               "sink_per_block": [round(float(x), 4) for x in s]}
            lines.append(f"| {model.label} | {a}–{b} | {float(s.mean()):.3f} | {float(e.mean()):.2f} | "
                         + " ".join(f"{float(x):.2f}" for x in s) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
