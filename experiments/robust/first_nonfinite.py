"""Where a non-finite sequence really goes non-finite (issue 37: the no-BOS failure's culprit).

A token whose residual becomes non-finite at some layer puts NaN in its key there, and a NaN key reaches every
query of that layer, the earlier ones too: the causal mask is added to the scores (NaN + -inf is NaN). So in one
forward a whole sequence turns non-finite from position 0, and "the first non-finite token" of a sequence
names position 0 whatever token ran away. The token that ran away is the last of the shortest prefix whose
forward is non-finite (a prefix holds no later token to leak from); this finds it by bisection for every
non-finite sequence of a dataset's split:

    python experiments/robust/first_nonfinite.py MODEL --dataset realtext-val [--no-bos] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm.auto import tqdm

from lnfree.data.documents import bos_token
from lnfree.evaluate import load_models
from lnfree.evaluate.datasets import load_sequences, resolve_dataset


@torch.no_grad()
def nonfinite(model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """Per row and position: True where a logit is non-finite."""
    return ~model(input_ids=rows, use_cache=False).logits.isfinite().all(dim=-1)


def culprit(model: torch.nn.Module, row: torch.Tensor) -> int:
    """The position of the token that makes `row` non-finite: the last of its shortest non-finite prefix."""
    low, high = 1, len(row)  # the prefix of `high` tokens is non-finite
    while low < high:
        mid = (low + high) // 2
        if nonfinite(model, row[None, :mid]).any():
            high = mid
        else:
            low = mid + 1
    return high - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--dataset", default="realtext-val")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--no-bos", action="store_true", help="no sequence starts with BOS (as `lnfree stress --no-bos`)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    model = load_models([args.model])[0]
    bos = None if args.no_bos else bos_token(model.module.config, model.tokenizer)
    rows = torch.from_numpy(load_sequences(resolve_dataset(args.dataset), model.tokenizer, context=args.context,
                                           n_sequences=None, vocab_size=model.vocab_size, bos_token_id=bos))
    start = time.process_time()
    found = []
    for batch_start in tqdm(range(0, len(rows), args.batch_size), desc="sequences", unit="batch"):
        batch = rows[batch_start:batch_start + args.batch_size]
        bad = nonfinite(model.module, batch)
        for i in bad.any(dim=1).nonzero().flatten().tolist():
            position = culprit(model.module, batch[i])
            found.append({"sequence": batch_start + i, "first_in_full_forward": int(bad[i].float().argmax()),
                          "culprit": position, "token": model.tokenizer.decode([int(batch[i, position])]),
                          "before": model.tokenizer.decode(batch[i, max(0, position - 6):position].tolist())})
    positions = Counter(f["culprit"] for f in found)
    record = {
        "model": args.model, "dataset": args.dataset, "context": args.context, "bos": bos, "sequences": len(rows),
        "nonfinite_sequences": len(found),
        "full_forward_says_position_0": sum(f["first_in_full_forward"] == 0 for f in found),
        "culprit_at_position_0": positions.get(0, 0),
        "culprit_positions": {str(k): v for k, v in sorted(positions.items())},
        "cpu_seconds": round(time.process_time() - start, 1), "sequences_found": found,
    }
    print(json.dumps({k: v for k, v in record.items() if k != "sequences_found"}, indent=1))
    for f in found[:30]:
        print(f"  seq {f['sequence']:>4}: position {f['culprit']:>2} {f['token']!r} after {f['before']!r} "
              f"(full forward: first at {f['first_in_full_forward']})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
