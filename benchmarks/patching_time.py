"""Wall time of attribution patching vs activation patching over the full layer x position grid.

On IOI prompts (lnfree.analysis.ioi) for the bundled tiny model (or --model), patching resid_pre at
every (layer, position):

* attribution: one clean caching pass + one forward/backward pass over the corrupted prompts;
* activation, full grid: one clean caching pass + every (prompt, layer, position) as a row of
  batched corrupted forward passes (``skip_unchanged=False``);
* activation, pruned: the same without the cells whose clean and corrupted activations are equal
  (the analysis' default; their value is exactly 0).

The variants are timed interleaved, round-robin, so drift in machine load hits them alike; the
script prints each median and the ratios measured in this one run.

    python benchmarks/patching_time.py [--model DIR] [--prompts 32] [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model source for lnfree.load (default: the bundled tiny model)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per variant")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from lnfree.analysis.patching import run as patching
    from lnfree.analysis.ioi import make_ioi_prompts
    from lnfree.forms.load import load
    from lnfree.data.tiny import TINY_MODEL_DIR

    source = args.model or str(TINY_MODEL_DIR)
    loaded = load(source)
    bridge = loaded.bridge()
    prompts = make_ioi_prompts(loaded.tokenizer, args.prompts, seed=0)
    n_cells = bridge.cfg.n_layers * prompts.n_positions
    variants = {
        "attribution": lambda: patching.attribution_patching(bridge, prompts, "resid_pre", batch_size=args.batch_size),
        "activation (full grid)": lambda: patching.activation_patching(
            bridge, prompts, "resid_pre", batch_size=args.batch_size, skip_unchanged=False),
        "activation (pruned)": lambda: patching.activation_patching(
            bridge, prompts, "resid_pre", batch_size=args.batch_size, skip_unchanged=True),
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.warmup + args.repeats):
        for name, fn in variants.items():
            started = time.perf_counter()
            fn()
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(t) for name, t in times.items()}
    attribution = medians["attribution"]
    print(f"{source}: {len(prompts)} IOI prompts x {bridge.cfg.n_layers} layers x {prompts.n_positions} positions "
          f"= {len(prompts) * n_cells} cells, batch {args.batch_size}, {args.threads} thread(s), "
          f"{args.repeats} interleaved repeats")  # fmt: skip
    for name, median in medians.items():
        print(f"  {name:>22}: median {median * 1000:8.1f} ms   ratio to attribution {median / attribution:6.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"medians_s": medians, "ratios_to_attribution": {n: m / attribution for n, m in medians.items()},
                       "times_s": times, "args": vars(args), "n_cells_per_prompt": n_cells}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
