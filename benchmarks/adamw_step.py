"""AdamW's step on a CPU: torch's per-parameter loop (lnfree before `train.fused_optimizer`), `foreach`
and `fused`, on the trained parameters of real models (issue 38).

For each model its parameters' shapes come from its config (the model built on the meta device, no
weights read); the embedding is left out where `--frozen-embedding` says (lnfree's
`train.freeze_embeddings`, which the Gemma 3 270M configs use). Each shape gets an fp32 tensor and a
random gradient, and AdamW (lnfree's two groups: weight decay on matrices only) takes `--steps` steps
per run after one warm-up step. Rounds interleave the implementations, the order rotated each round;
per implementation: the median over rounds of process CPU seconds per step, and each round's time over
the loop's in that round. Writes benchmarks/results/adamw_step.json / .txt.

    python benchmarks/adamw_step.py [--models gemma3-270m,smollm2-135m] [--rounds 5] [--steps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
IMPLEMENTATIONS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def trained_shapes(name: str, frozen_embedding: bool) -> list[torch.Size]:
    """The shapes of `name`'s trained parameters (its token embedding, and a head tied to it, left out
    when `frozen_embedding`)."""
    from transformers import AutoModelForCausalLM

    from lnfree.arch import architecture
    from lnfree.models.base import load_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(name))
    embedding = model.get_submodule(architecture(model).token_embedding).weight
    return [p.shape for p in model.parameters() if not (frozen_embedding and p is embedding)]


def step_seconds(shapes: list[torch.Size], options: dict, steps: int) -> float:
    """Process CPU seconds per AdamW step over fresh fp32 parameters of `shapes` with random gradients."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-4, **options)
    optimizer.step()  # allocates the moments
    start = time.process_time()
    for _ in range(steps):
        optimizer.step()
    return (time.process_time() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gemma3-270m,smollm2-135m")
    parser.add_argument("--frozen-embedding", default="gemma3-270m",
                        help="comma-separated models whose embedding is frozen (not stepped)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "adamw_step")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    frozen = set(args.frozen_embedding.split(",")) if args.frozen_embedding else set()
    names = list(IMPLEMENTATIONS)
    results = {}
    for model in args.models.split(","):
        shapes = trained_shapes(model, model in frozen)
        times: dict[str, list[float]] = {n: [] for n in names}
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(step_seconds(shapes, IMPLEMENTATIONS[name], args.steps))
        results[model] = {
            "parameters": sum(s.numel() for s in shapes), "frozen_embedding": model in frozen,
            "seconds": times, "median_seconds": {n: statistics.median(t) for n, t in times.items()},
            "ratio_to_loop_per_round": {n: [a / b for a, b in zip(t, times["loop"])] for n, t in times.items()},
        }
        print(model, json.dumps(results[model]["median_seconds"]), flush=True)
    lines = [f"# AdamW step, process CPU seconds (median of {args.rounds} rounds of {args.steps} steps), "
             f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)", "",
             "| model | trained parameters | loop | foreach | fused | fused / loop, per round |", "|---|---|---|---|---|---|"]
    for model, r in results.items():
        m = r["median_seconds"]
        ratios = ", ".join(f"{x:.2f}" for x in r["ratio_to_loop_per_round"]["fused"])
        lines.append(f"| {model}{' (embedding frozen)' if r['frozen_embedding'] else ''} | {r['parameters'] / 1e6:.1f}M | "
                     f"{m['loop']:.3f} | {m['foreach']:.3f} | {m['fused']:.3f} | {ratios} |")
    args.out.with_suffix(".json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
         "threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
         "results": results}, indent=1))
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
