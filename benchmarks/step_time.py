"""Training-step time of the removal model (all norms real / all fake) relative to plain GPT-2.

A GPT-2-small-shaped model (12 × 768, random init) on CPU with short sequences. One step is
forward + backward + AdamW + (for the removal model) the σ update. The three variants are
timed interleaved, round-robin with the order rotated every round, so drift in machine load hits all of them alike; the script
prints the median of each and the ratios to the plain model.

    python benchmarks/step_time.py [--steps 15] [--batch 4] [--seq 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lnfree import surgery


def make_step(model: torch.nn.Module, removal: bool, ids: torch.Tensor):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if removal:
            surgery.update_sigmas(model, 0.9)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))

    real = surgery.install(copy.deepcopy(base))
    surgery.initialise_sigmas(real, [ids])
    fake = copy.deepcopy(real)
    for state in surgery.scale_states(fake).values():
        state.switch_to_fake()
    steps = {
        "plain LayerNorm": make_step(base, False, ids),
        "lnfree, all real": make_step(real, True, ids),
        "lnfree, all fake": make_step(fake, True, ids),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(args.warmup + args.steps):
        # Rotate the order every round so no variant always runs first (or right after another).
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            step = steps[name]
            started = time.perf_counter()
            step()
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(t) for name, t in times.items()}
    plain = medians["plain LayerNorm"]
    print(f"GPT-2-small shape, batch {args.batch} × {args.seq} tokens, {args.threads} threads, {args.steps} steps each")
    for name, median in medians.items():
        print(f"  {name:>17}: median {median * 1000:8.1f} ms   ratio to plain {median / plain:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"medians_s": medians, "ratios": {n: m / plain for n, m in medians.items()}, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
