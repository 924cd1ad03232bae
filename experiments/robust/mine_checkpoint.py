"""What `train.coverage.mine` would find on a saved checkpoint: repeated ids and, with --random, ids among random ids.

Runs `lnfree.removal.mining.mine` as a run does when its mining setting starts (no scale ceiling, against the
envelope of the first validation sequences), on part K of N of the vocabulary, and writes the ids found with
their text, split by sweep (issue 37: do rows of random ids find what the repeated sweep misses?):

    python experiments/robust/mine_checkpoint.py CHECKPOINT [--part 0 --of 16] [--random] [--seed 0] \
        [--dataset realtext-val] [--sequences 64] [--context 64] [--repeated-context 8] --out FILE.json

--repeated-context sets the repeated sweep's row length (a run's `mine.context`, 8 by default): runaways that need
more repeats than that (slow growers) show only at a longer one.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from lnfree.data.documents import bos_token
from lnfree.evaluate import load_models
from lnfree.evaluate.datasets import load_sequences, resolve_dataset
from lnfree.fixedscale.ceiling import set_ceiling
from lnfree.removal.mining import SWEEP_CONTEXT, Mining, mine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a run, checkpoint or export folder")
    parser.add_argument("--part", type=int, default=0)
    parser.add_argument("--of", type=int, default=16)
    parser.add_argument("--random", action="store_true", help="also sweep rows of random ids (Mining.random)")
    parser.add_argument("--seed", type=int, default=0, help="the run's train.seed")
    parser.add_argument("--dataset", default="realtext-val", help="the text whose envelope bounds the residuals")
    parser.add_argument("--sequences", type=int, default=64, help="its first sequences (a run's data.eval_sequences)")
    parser.add_argument("--context", type=int, default=64, help="tokens per text and random-id row")
    parser.add_argument("--repeated-context", type=int, default=SWEEP_CONTEXT, help="tokens per repeated row")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    loaded = load_models([args.model], ["model"], form="hf", dtype="fp32")[0]
    model, tokenizer = loaded.module, loaded.tokenizer
    set_ceiling(model, math.inf)  # as the run's mining: the model as it will be exported
    bos = bos_token(model.config, tokenizer)
    text = torch.from_numpy(load_sequences(resolve_dataset(args.dataset), tokenizer, context=args.context,
                                           n_sequences=args.sequences, vocab_size=model.config.vocab_size,
                                           bos_token_id=bos))
    started = time.process_time()
    mining = Mining(part=args.part, of=args.of, context=args.repeated_context, random=args.random,
                    random_context=args.context)
    found = mine(model, mining, text, bos=bos, seed=args.seed, bf16=True)
    named = lambda ids: [[i, tokenizer.decode([i])] for i in ids]  # noqa: E731
    record = {"model": args.model, "part": args.part, "of": args.of, "seed": args.seed,
              "repeated_context": args.repeated_context, "swept": found.swept,
              "repeated": named(found.repeated), "random": named(found.random),
              "random_only": named([i for i in found.random if i not in set(found.repeated)]),
              "cpu_seconds": round(time.process_time() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, ensure_ascii=False))
    print(f"{found.swept:,} ids swept: {len(found.repeated)} overflow repeated, {len(found.random)} rows of random "
          f"ids overflow ({len(record['random_only'])} of their ids not found repeated); {record['cpu_seconds']} CPU-s")
    print("random only:", ", ".join(repr(t) for _, t in record["random_only"][:30]))


if __name__ == "__main__":
    main()
