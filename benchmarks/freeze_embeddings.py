"""Does freezing the token embedding cost a modern model validation CE? The same run with
`train.freeze_embeddings` true and false, on the same tokens (issue 38).

A large-vocabulary model's tied embedding is most of its parameters (Gemma 3 270M: 168M of 268M):
frozen, it needs no gradient for the head's weight and no AdamW state. This script runs `lnfree remove`
on a run config (default: `experiments/robust/gemma3_coverage.toml` cut to `--set train.max_steps=100` in vanilla
mode, a removal's schedule being longer) once with the embedding frozen and once trained, everything else
equal (seed, data order, precision: the config's unless `--set`), and prints the validation CE of both
(the held-out CE of each run's summary: realtext's validation split), frozen − trained and whether it is
within `--tolerance` (0.01 nats: the bar for making it the modern models' default), and each run's process
CPU time. Writes benchmarks/results/freeze_embeddings_<config stem>.json / .txt.

    python benchmarks/freeze_embeddings.py [--config experiments/robust/gemma3_coverage.toml] [--threads 1]
        [--set removal.mode=vanilla --set train.max_steps=100 ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bf16_quality import one_run

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"frozen": "train.freeze_embeddings=true", "trained": "train.freeze_embeddings=false"}
PILOT = ["removal.mode=vanilla", "train.max_steps=100"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="experiments/robust/gemma3_coverage.toml")
    parser.add_argument("--set", dest="settings", action="append", default=None, metavar="KEY=VALUE",
                        help=f"a setting for both runs (repeatable; default: {' '.join(PILOT)})")
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the runs (default: inherited)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    settings = tuple(PILOT if args.settings is None else args.settings)
    out = args.out or ROOT / "benchmarks" / "results" / f"freeze_embeddings_{Path(args.config).stem}"
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name, arm in ARMS.items():
            runs[name] = one_run(args.config, arm, Path(tmp), args.threads, control=False, settings=settings)
            print(f"{name}: {json.dumps(runs[name])}", flush=True)
    (model,) = runs["frozen"]["cpu_seconds"]  # ln_free or vanilla
    frozen, trained = runs["frozen"]["held_out_ce"][model], runs["trained"]["held_out_ce"][model]
    within = frozen - trained <= args.tolerance
    original = runs["frozen"]["held_out_ce"].get("original", float("nan"))
    lines = [f"# train.freeze_embeddings on {args.config} ({', '.join(settings)}): validation CE at the end of the "
             f"same run, embedding frozen vs trained (tolerance {args.tolerance} nats)", "",
             "| model | original | frozen | trained | frozen − trained | within | CPU s frozen / trained | tokens |",
             "|---|---|---|---|---|---|---|---|",
             f"| {model} | {original:.4f} | {frozen:.4f} | {trained:.4f} | {frozen - trained:+.4f} | "
             f"{'yes' if within else 'no'} | "
             f"{runs['frozen']['cpu_seconds'][model]:.0f} / {runs['trained']['cpu_seconds'][model]:.0f} | "
             f"{runs['frozen']['held_out_tokens']} |"]
    out.with_suffix(".json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "settings": settings, "results": runs,
         "frozen_minus_trained": frozen - trained, "within": within}, indent=1))
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
