"""Training throughput of a real removal run on this machine, in tokens per hour, and what the allocator changes.

Runs `lnfree remove` itself (a subprocess per run: glibc's allocator setting is per process) on a
run config (default: `experiments/gemma3/ln_free.toml`, Gemma 3 270M with its teacher's forward),
cut to `--steps` steps with one early removal so that nothing but training steps is timed, and
reads each step's time from the run's own `log.jsonl`. Variants:
- default malloc (`train.steady_allocator = false`): glibc maps every allocation above 32 MB fresh
  from the kernel and unmaps it on free;
- steady allocator (lnfree's default on a CPU, `lnfree.removal.runtime`);
- steady allocator, second copy: the same again, a control whose true ratio is 1 (this run's resolution).

Each round runs every variant once, the order rotated from round to round. Per run the median step
time over the steps after `--warmup`; the script prints tokens/hour per variant (median over rounds)
and the per-round ratio of each variant's step time to the default's, and writes them to
`benchmarks/results/throughput_<model>.json` / `.txt`. The model's weights must be installed
(see README: real models by name).

    python benchmarks/throughput.py [--config FILE] [--steps 10] [--warmup 2] [--rounds 2] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from lnfree.removal.config import load_config, with_overrides

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"default malloc": False, "steady allocator": True, "steady allocator, second copy": True}
BASELINE = "default malloc"


def bench_config(path: Path, steps: int, out: Path):
    """The run config at `path`, cut to `steps` steps (`bench_overrides`)."""
    return with_overrides(load_config(path), bench_overrides(steps, out))


def bench_overrides(steps: int, out: Path) -> dict:
    """A run cut to `steps` steps: one removal at step 1, no evaluation, checkpoint, ceiling or special σ."""
    return {
        "output_dir": str(out), "train.max_steps": steps, "train.warmup_steps": 1, "train.eval_every": 0,
        "train.save_every": 0, "train.keep_checkpoints": None, "train.log_every": 1, "data.eval_sequences": 4,
        "removal.scale_ceiling": None, "removal.special_pos0": False, "removal.special_eot": False,
        "removal.schedule": {"stages": [{"kind": "ln_1qk", "start": 1, "gap": 0}]},
    }


def setting(text: str) -> tuple[str, object]:
    """KEY=VALUE → (KEY, VALUE read as JSON, else the string)."""
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def step_seconds(log: Path, warmup: int) -> list[float]:
    """Seconds of each step after the first `warmup`, from the cumulative `seconds` of a run's log."""
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    times = {r["step"]: r["seconds"] for r in rows if "seconds" in r and "event" not in r}
    steps = sorted(times)
    return [times[b] - times[a] for a, b in zip(steps, steps[1:]) if a >= warmup]


def one_run(config, steady: bool, workdir: Path, warmup: int, threads: int | None) -> dict:
    """Run `config` once with the allocator setting `steady`; its median step time and tokens/hour."""
    out = workdir / "run"
    config = with_overrides(config, {"output_dir": str(out), "train.steady_allocator": steady})
    path = workdir / "config.json"
    path.write_text(config.model_dump_json())
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    subprocess.run([sys.executable, "-m", "lnfree", "remove", "--config", str(path), "--overwrite", "--no-control"],
                   check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    seconds = step_seconds(out / "log.jsonl", warmup)
    median = statistics.median(seconds)
    start = json.loads((out / "log.jsonl").read_text().splitlines()[0])
    return {"steady_allocator": start["steady_allocator"], "step_seconds": seconds, "median_step_seconds": median,
            "tokens_per_hour": config.train.tokens_per_step / median * 3600}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "experiments/gemma3/ln_free.toml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of each run's median")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the runs (default: inherited)")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/throughput_<model>")
    args = parser.parse_args()
    if args.steps <= args.warmup + 1:
        parser.error("--steps must exceed --warmup + 1")
    with tempfile.TemporaryDirectory() as tmp:
        config = bench_config(args.config, args.steps, Path(tmp) / "run")
        names = list(VARIANTS)
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                runs[name].append(one_run(config, VARIANTS[name], Path(tmp), args.warmup, args.threads))
                print(f"round {round_ + 1} {name}: {runs[name][-1]['median_step_seconds']:.2f} s/step", flush=True)
    summary = {name: {
        "tokens_per_hour": statistics.median(r["tokens_per_hour"] for r in rs),
        "median_step_seconds": statistics.median(r["median_step_seconds"] for r in rs),
        "ratio_to_default_per_round": [r["median_step_seconds"] / b["median_step_seconds"]
                                       for r, b in zip(rs, runs[BASELINE])],
    } for name, rs in runs.items()}
    model = config.model.replace("/", "_")
    out = args.out or ROOT / "benchmarks" / "results" / f"throughput_{model}"
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "model": config.model, "torch": torch.__version__,
              "tokens_per_step": config.train.tokens_per_step, "threads": args.threads or os.environ.get("OMP_NUM_THREADS"),
              "summary": summary, "runs": runs}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"# {config.model}: {config.train.tokens_per_step} tokens per step, {args.steps} steps per run "
             f"(median after {args.warmup}), {args.rounds} rounds, OMP_NUM_THREADS={result['threads']}", "",
             "| variant | tokens / hour | s / step | step time / default malloc, per round |", "|---|---|---|---|"]
    for name, s in summary.items():
        ratios = ", ".join(f"{r:.3f}" for r in s["ratio_to_default_per_round"])
        lines.append(f"| {name} | {s['tokens_per_hour']:,.0f} | {s['median_step_seconds']:.2f} | {ratios} |")
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
