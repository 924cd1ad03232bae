"""A frozen head's forward + backward under bf16 autocast: autocast's cast of the weight per forward against
`lnfree.removal.frozen_head.FrozenHead`'s kept transposed copy (issue 38).

At Gemma 3 270M's head (262,144 × 640, tied and frozen under `train.freeze_embeddings`) and micro-batches of 64
to 1,024 tokens, interleaved rounds (the two ways alternate, the order swapped every round), each the process
CPU time of the head's forward and the backward to its input (no weight gradient: the weight is frozen):
- autocast: `nn.Linear` under autocast, as every run did before (the weight cast to bf16 at each forward, the
  input gradient by the [vocabulary, hidden] copy);
- kept: `FrozenHead` (the transposed copy kept, the input gradient as (Wᵀ·gᵀ)ᵀ).
Also the parts alone (best of the rounds): the cast, each forward product and each backward order. Prints the
median time per way and the per-round ratio, checks that the two ways' logits are equal and their input
gradients close, and writes `benchmarks/results/frozen_head.json` / `.txt`.

    python benchmarks/frozen_head.py [--threads 1] [--rounds 5] [--tokens 64,256,1024] [--out PATH]
        [--vocab 262144 --hidden 640]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from lnfree.removal.frozen_head import FrozenHead, kept_transposed, product_backward, use_frozen_head
from lnfree.removal.precision import cpu_description

ROOT = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN = 262_144, 640  # Gemma 3 270M (--vocab, --hidden)
WAYS = ("autocast", "kept")


def _cpu(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def _step(head: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head(leaf)
    out.backward(grad)
    return leaf.grad


def heads(vocab: int, hidden: int) -> dict[str, nn.Module]:
    """The two ways around one frozen weight."""
    torch.manual_seed(0)
    plain = nn.Linear(hidden, vocab, bias=False)
    plain.weight.requires_grad_(False)
    holder = nn.Module()
    holder.head = nn.Linear(hidden, vocab, bias=False)
    holder.head.weight = plain.weight
    use_frozen_head(holder, "head")
    assert isinstance(holder.head, FrozenHead)
    return {"autocast": plain, "kept": holder.head}


def parts(weight: torch.Tensor, tokens: int, rounds: int) -> dict[str, float]:
    """Best CPU seconds of each part alone: the cast, the forward products, the backward orders."""
    vocab, hidden = weight.shape
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    g = torch.randn(tokens, vocab, dtype=torch.bfloat16) * 1e-4
    w = weight.to(torch.bfloat16)
    w_t = kept_transposed(weight, torch.bfloat16)
    ops = {"cast": lambda: weight.to(torch.bfloat16), "forward x·Wᵀ": lambda: x @ w.t(),
           "forward x·(kept Wᵀ)": lambda: x @ w_t, "backward g·W": lambda: g @ w,
           "backward (Wᵀ·gᵀ)ᵀ": lambda: product_backward(g, w_t)}
    return {name: min(_cpu(op) for _ in range(rounds)) for name, op in ops.items()}


def measure(tokens: int, rounds: int, vocab: int = VOCAB, hidden: int = HIDDEN) -> dict:
    """Interleaved rounds of the two ways at `tokens` tokens, and the parts alone."""
    ways = heads(vocab, hidden)
    x = torch.randn(tokens, hidden)
    grad = torch.randn(tokens, vocab, dtype=torch.bfloat16) * 1e-4
    grads = {name: _step(head, x, grad) for name, head in ways.items()}  # warm-up, and the check
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits_equal = torch.equal(ways["autocast"](x), ways["kept"](x))
    gap = (grads["kept"] - grads["autocast"]).abs().max().item() / grads["autocast"].abs().max().item()
    seconds = {name: [] for name in WAYS}
    for r in range(rounds):
        for name in WAYS if r % 2 == 0 else reversed(WAYS):
            seconds[name].append(_cpu(lambda: _step(ways[name], x, grad)))
    ratios = [a / k for a, k in zip(seconds["autocast"], seconds["kept"])]
    return {"tokens": tokens, "seconds": seconds, "median": {n: statistics.median(s) for n, s in seconds.items()},
            "ratio_per_round": ratios, "logits_equal": logits_equal, "grad_max_relative_difference": gap,
            "parts_best": parts(ways["autocast"].weight, tokens, rounds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", default="64,256,1024", help="comma-separated micro-batch sizes")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/frozen_head")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [measure(int(t), args.rounds, args.vocab, args.hidden) for t in args.tokens.split(",")]
    lines = [f"# A frozen {args.vocab:,} × {args.hidden} head under bf16 autocast, forward + input gradient, "
             f"process CPU seconds, {args.threads} thread(s), {args.rounds} interleaved rounds; {cpu_description()}",
             "", "| tokens | autocast (cast per forward) | kept transposed copy | autocast / kept, per round "
             "| logits equal | gradient's largest relative difference |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['tokens']} | {r['median']['autocast']:.3f} | {r['median']['kept']:.3f} | "
                     f"{', '.join(f'{x:.2f}' for x in r['ratio_per_round'])} | {r['logits_equal']} | "
                     f"{r['grad_max_relative_difference']:.1e} |")
    lines += ["", "The parts alone, best of the rounds (seconds):", "",
              "| tokens | " + " | ".join(results[0]["parts_best"]) + " |",
              "|---|" + "---|" * len(results[0]["parts_best"])]
    lines += [f"| {r['tokens']} | " + " | ".join(f"{v:.3f}" for v in r["parts_best"].values()) + " |" for r in results]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".txt").write_text(text)
    record = {"cpu": cpu_description(), "threads": args.threads, "rounds": args.rounds, "vocab": args.vocab,
              "hidden": args.hidden, "results": results}
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
