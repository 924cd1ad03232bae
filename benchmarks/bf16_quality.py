"""Does bf16 autocast remove as well as fp32 on a CPU? Validation CE of the same runs in both precisions.

For each preset (default: the distillation presets of the two bundled models, `tiny-distill` and
`realtext-distill`), `lnfree remove` runs twice on the same tokens, each with its vanilla control:
fp32 (`train.mixed_precision = "no"`, fp32 teacher) and bf16 (bf16 autocast over fp32 master
weights, bf16 teacher). The script reads each run's summary (held-out CE at the end: the validation
split for realtext) and prints, per preset and model (LN-free, vanilla), bf16 − fp32 and whether it is
within `--tolerance` (0.01 nats, the bar bf16 must clear before it becomes a CPU default), and the
process CPU time of each run from its log. Writes benchmarks/results/bf16_quality.json / .txt.

    python benchmarks/bf16_quality.py [--presets tiny-distill,realtext-distill] [--threads N]
    python benchmarks/bf16_quality.py --presets experiments/robust/gemma3_coverage.toml --no-control \
        --set removal.mode=vanilla --set train.max_steps=100 --out benchmarks/results/bf16_quality_gemma3-270m

(a run cut short must be a vanilla one, or have a schedule that ends before it does)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = {
    "fp32": ["--set", "train.mixed_precision=no", "--set", "train.teacher_dtype=fp32"],
    "bf16": ["--set", "train.mixed_precision=bf16", "--set", "train.teacher_dtype=bf16"],
}


def cpu_seconds(run: Path) -> float:
    """The process CPU time of a run's training (its log's last `cpu_seconds`)."""
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return max(r.get("cpu_seconds", 0.0) for r in rows)


def one_run(preset: str, arm: str, work: Path, threads: int | None, control: bool = True,
            settings: tuple[str, ...] = ()) -> dict:
    """`lnfree remove --preset PRESET` (or `--config` for a file; with its control unless not `control`;
    `settings` as `--set`, after those of `arm`: a precision of PRECISIONS, or `key=value` settings joined
    by ';'); its held-out CEs and CPU time."""
    arm_args = PRECISIONS.get(arm) or [a for s in arm.split(";") for a in ("--set", s)]
    out = work / re.sub(r"\W+", "_", f"{Path(preset).stem}-{arm}")
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    source = ["--config", preset] if Path(preset).suffix in (".toml", ".json") else ["--preset", preset]
    command = [sys.executable, "-m", "lnfree", "remove", *source, "-o", str(out),
               "--control" if control else "--no-control", "--overwrite", *arm_args,
               *(arg for setting in settings for arg in ("--set", setting))]
    subprocess.run(command, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    main = "ln_free" if summary["mode"] == "remove" else "vanilla"
    cpu = {main: cpu_seconds(out), **({"vanilla": cpu_seconds(out / "control")} if control else {})}
    return {"held_out_ce": summary["held_out_ce"], "held_out_tokens": summary["held_out_tokens"], "cpu_seconds": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny-distill,realtext-distill",
                        help="comma-separated presets, or run-config files (.toml/.json)")
    parser.add_argument("--no-control", dest="control", action="store_false", help="no vanilla control runs")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="a config setting for every run (repeatable), e.g. train.max_steps=100")
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the runs (default: inherited)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bf16_quality")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            results[preset] = {p: one_run(preset, p, Path(tmp), args.threads, args.control, tuple(args.settings))
                               for p in PRECISIONS}
            print(f"{preset}: {json.dumps(results[preset])}", flush=True)
    lines = [f"# bf16 autocast vs fp32 on this CPU: held-out CE at the end of the same runs (tolerance "
             f"{args.tolerance} nats)", "",
             "| preset | model | fp32 | bf16 | bf16 − fp32 | within | CPU s fp32 / bf16 |", "|---|---|---|---|---|---|---|"]
    verdicts = {}
    for preset, runs in results.items():
        for model in runs["fp32"]["cpu_seconds"]:  # ln_free and/or vanilla
            a, b = runs["fp32"]["held_out_ce"][model], runs["bf16"]["held_out_ce"][model]
            ok = abs(b - a) <= args.tolerance
            verdicts[f"{preset}/{model}"] = ok
            cpu = f"{runs['fp32']['cpu_seconds'][model]:.0f} / {runs['bf16']['cpu_seconds'][model]:.0f}"
            lines.append(f"| {preset} | {model} | {a:.4f} | {b:.4f} | {b - a:+.4f} | {'yes' if ok else 'no'} | {cpu} |")
    args.out.with_suffix(".json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "results": results, "within": verdicts}, indent=1))
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
