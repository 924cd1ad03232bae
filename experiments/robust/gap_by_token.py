"""Where does a removal's CE gap to its control sit? Its split by token kind on the validation half (issue 37).

    python experiments/robust/gap_by_token.py CONTROL ARM... [--labels ...] [--sequences 192] [--out FILE.md]

Scores every model on the first `--sequences` sequences of the realtext validation half (never the test half),
token by token (fp32), and splits each arm's gap to the first model (the control) by the next token's
position, by whether that token already stands earlier in the sequence (what copying from context can
predict), by its kind (whitespace, a word, punctuation and the rest) and by its frequency in the training split.
Each row gives its tokens, the control's mean CE, each arm's mean gap and its share of the arm's whole gap.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from lnfree.data.documents import bos_token, prepare_data
from lnfree.evaluate import load_models
from lnfree.removal.config import DataConfig

from induction import token_ce  # this folder's copying probe (run as a script, its folder is on the path)

POSITIONS = ((1, 3), (4, 7), (8, 15), (16, 31), (32, 63))  # the predicted token's position in its sequence
RANKS = ((0, 100), (100, 1_000), (1_000, 10_000), (10_000, None))  # frequency ranks in the training split


def groups(ids: np.ndarray, train: np.ndarray, tokenizer) -> dict[str, np.ndarray]:
    """Boolean masks over the predicted tokens (rows, positions − 1), by group name."""
    target = ids[:, 1:]
    out = {}
    position = np.broadcast_to(np.arange(1, ids.shape[1]), target.shape)
    for a, b in POSITIONS:
        out[f"position {a}-{b}"] = (position >= a) & (position <= b)
    seen = np.zeros(target.shape, dtype=bool)
    for r, row in enumerate(ids):
        for t in range(1, len(row)):
            seen[r, t - 1] = row[t] in row[1:t]  # BOS aside
    out["earlier in the sequence"], out["new in the sequence"] = seen, ~seen
    text = {int(i): tokenizer.decode([int(i)]) for i in np.unique(target)}
    kind = np.vectorize(lambda i: "whitespace" if not text[i].strip() else
                        "word" if any(c.isalnum() for c in text[i]) else "punctuation and other")(target)
    for name in ("whitespace", "word", "punctuation and other"):
        out[name] = kind == name
    counts = np.bincount(np.asarray(train).ravel(), minlength=int(ids.max()) + 1)
    rank = np.empty_like(counts)
    rank[np.argsort(-counts, kind="stable")] = np.arange(len(counts))
    for a, b in RANKS:
        out[f"frequency rank {a:,}-{'' if b is None else f'{b:,}'}"] = (rank[target] >= a) & (
            rank[target] < (b if b is not None else len(rank)))
    return out


def control_and_arms(description: str) -> argparse.ArgumentParser:
    """The command line of a script that scores a control, then its arms, on the validation half (add --out)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("models", nargs="+", help="the control, then the arms (names or checkpoint folders)")
    parser.add_argument("--labels", nargs="+")
    parser.add_argument("--sequences", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=4)
    return parser


def validation_half(args: argparse.Namespace, parser: argparse.ArgumentParser, context: int = 64):
    """(the models of `args`, in fp32; the realtext data of their tokenizer; its first `args.sequences` sequences of
    the validation half), after checking that a control and at least one arm were given."""
    if len(args.models) < 2:
        parser.error("give the control and at least one arm")
    loaded = load_models(args.models, args.labels, form="hf", dtype="fp32")
    tokenizer, config = loaded[0].tokenizer, loaded[0].module.config
    bos = bos_token(loaded[0].module, tokenizer)
    data = prepare_data(DataConfig(source="realtext", context_length=context), tokenizer, context, config.vocab_size,
                        bos)
    return loaded, data, data.eval_batch(args.sequences)


def main() -> None:
    parser = control_and_arms(__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    loaded, data, ids = validation_half(args, parser)
    tokenizer = loaded[0].tokenizer
    masks = groups(ids.numpy(), data.train, tokenizer)
    ce = []
    for model in loaded:
        model.module.eval()
        ce.append(token_ce(model.module, ids, args.batch_size).numpy())
    control, arms = ce[0], ce[1:]
    names = [m.label for m in loaded]
    header = ["tokens", "group", f"{names[0]} CE", *[f"{n}: gap (share)" for n in names[1:]]]
    lines = [f"CE gap to {names[0]} by token group: the first {len(ids)} sequences of the realtext validation half "
             f"({control.size:,} predicted tokens, fp32); a share is the group's part of the arm's summed gap", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, mask in {"all": np.ones(control.shape, dtype=bool), **masks}.items():
        cells = [f"{int(mask.sum()):,}", name, f"{control[mask].mean():.3f}"]
        for arm in arms:
            gap = arm - control
            cells.append(f"{gap[mask].mean():+.3f} ({gap[mask].sum() / gap.sum():.0%})")
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
