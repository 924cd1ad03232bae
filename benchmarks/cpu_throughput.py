"""CPU training throughput of a removal run in reduced precision and with the chunked vocabulary loss,
in tokens per CPU-hour (issue 38).

Runs `lnfree remove` itself (a subprocess per run, the same kind of process every time) on a run
config (default: `experiments/robust/gemma3_coverage.toml`, Gemma 3 270M distilled from its teacher, with
vocabulary coverage), cut to `--steps` steps with one early removal (`throughput.bench_config`), in
these variants, each setting `train.mixed_precision`, `train.teacher_dtype`,
`train.chunked_vocab_loss`, `train.fused_optimizer` and `train.freeze_embeddings` (and bf16's
`train.cpu_fp32_attention`) explicitly:
- fp32: no autocast, fp32 teacher, the plain loss, the embedding frozen, fused AdamW (the baseline of
  every ratio unless `--baseline` or `--before`);
- … (loop AdamW): torch's per-parameter AdamW loop (`train.fused_optimizer = false`);
- bf16: bf16 autocast over the fp32 weights and a bf16 teacher (attention in fp32 at short contexts,
  `lnfree.removal.precision.attention_in_fp32`);
- bf16 (bf16 attention): attention in bf16 at every context (`train.cpu_fp32_attention = false`);
- bf16 (eager vocabulary loss): the CE and KL over the vocabulary by PyTorch's eager operations instead of the
  kernels `train.compile_vocab_loss` compiles ("auto" compiles them on a CPU for Gemma 3's vocabulary);
- bf16 + chunked: and CE + KL by `lnfree.removal.losses.vocab_loss` (`--chunk` tokens per chunk);
- bf16 + compile: bf16 with every block compiled (`train.compile`; a norm's switch recompiles its block);
- … (embedding trained): the same with `train.freeze_embeddings = false` (a tied head then trains too);
- fp32 / bf16 (lnfree before), with `--before DIR`: fp32 and bf16 run by an lnfree checkout from before
  issue 38's step changes (fused AdamW, CE and KL from one log-softmax); fp32 (lnfree before), the step
  as it was, is then the baseline.

Each round runs every variant once, the order rotated from round to round. Per run: the median over
the steps after `--warmup` of each step's process CPU time (the log's `cpu_seconds`: every thread,
other jobs on the machine not counted) and wall time (`seconds`). The script prints tokens per
CPU-hour and per wall hour per variant (median over rounds) and, per round, each variant's
throughput over the baseline's in that round, and writes them to
`benchmarks/results/cpu_throughput_<model>.json` / `.txt`. bf16 needs a CPU with native bf16
(avx512_bf16 or AMX, `lnfree.removal.precision`) to be fast; the result records whether this one has it.

    python benchmarks/cpu_throughput.py [--config FILE] [--steps 10] [--warmup 2] [--rounds 2] [--chunk 1024]
        [--variants "fp32,bf16"] [--baseline fp32] [--threads N] [--before DIR] [--set KEY=VALUE ...]

`--set KEY=VALUE` changes a setting of the cut config for every variant (a later stage's losses from step 0:
`--set 'train.stability_margin={...}'`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from throughput import bench_config, setting

from lnfree.removal.config import with_overrides
from lnfree.removal.precision import cpu_description, cpu_has_native_bf16

ROOT = Path(__file__).resolve().parents[1]
FP32 = {"train.mixed_precision": "no", "train.teacher_dtype": "fp32", "train.chunked_vocab_loss": None,
        "train.fused_optimizer": True}
BF16 = {**FP32, "train.mixed_precision": "bf16", "train.teacher_dtype": "bf16", "train.cpu_fp32_attention": True}
CHUNKED = {**BF16, "train.chunked_vocab_loss": "chunk"}  # "chunk": replaced by --chunk
LOOP = {"train.fused_optimizer": False}
VARIANTS = {
    "fp32": {**FP32, "train.freeze_embeddings": True},
    "fp32 (loop AdamW)": {**FP32, **LOOP, "train.freeze_embeddings": True},
    "bf16": {**BF16, "train.freeze_embeddings": True},
    "bf16 (loop AdamW)": {**BF16, **LOOP, "train.freeze_embeddings": True},
    "bf16 (bf16 attention)": {**BF16, "train.freeze_embeddings": True, "train.cpu_fp32_attention": False},
    "bf16 (eager vocabulary loss)": {**BF16, "train.freeze_embeddings": True, "train.compile_vocab_loss": False},
    "bf16 + chunked": {**CHUNKED, "train.freeze_embeddings": True},
    "bf16 + compile": {**BF16, "train.freeze_embeddings": True, "train.compile": True},
    "fp32 (embedding trained)": {**FP32, "train.freeze_embeddings": False},
    "bf16 (embedding trained)": {**BF16, "train.freeze_embeddings": False},
    "bf16 + chunked (embedding trained)": {**CHUNKED, "train.freeze_embeddings": False},
}
#: With `--before DIR`: the same settings run by the lnfree checkout in DIR (its `src/`), which knows no
#: `train.fused_optimizer` (its AdamW is the per-parameter loop) nor `train.cpu_fp32_attention`, and computes CE
#: and KL apart.
BEFORE = {"fp32 (lnfree before)": "fp32", "bf16 (lnfree before)": "bf16"}
BASELINE = "fp32"


def cumulative(log: Path, field: str) -> dict[int, float]:
    """The cumulative `field` (`seconds` or `cpu_seconds`) of a run's log at each logged step."""
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return {r["step"]: r[field] for r in rows if field in r and "event" not in r}


def step_times(log: Path, warmup: int, field: str) -> list[float]:
    """Each step's share of the cumulative `field` of a run's log, after the first `warmup` steps."""
    times = cumulative(log, field)
    steps = sorted(times)
    return [times[b] - times[a] for a, b in zip(steps, steps[1:]) if a >= warmup]


def one_run(config, overrides: dict, workdir: Path, warmup: int, threads: int | None,
            code: Path | None = None) -> dict:
    """Run `config` once with `overrides` (by the lnfree checkout `code`, default this one); its median
    step CPU and wall times and tokens per hour of each."""
    out = workdir / "run"
    shutil.rmtree(out, ignore_errors=True)  # an earlier checkout cannot read a later one's run folder
    config = with_overrides(config, {**overrides, "output_dir": str(out)})
    path = workdir / "config.json"
    # the earlier code knows neither the settings added since nor those of them left at their defaults
    data = json.loads(config.model_dump_json(exclude_defaults=code is not None))
    for key, value in overrides.items() if code is not None else ():
        section, field = key.split(".")
        data.setdefault(section, {})[field] = value
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    if code is not None:
        for setting in ("fused_optimizer", "cpu_fp32_attention"):
            data["train"].pop(setting, None)
        env["PYTHONPATH"] = str(code / "src")
    path.write_text(json.dumps(data))
    subprocess.run([sys.executable, "-m", "lnfree", "remove", "--config", str(path), "--overwrite", "--no-control"],
                   check=True, env=env, cwd=code or ROOT, stdout=subprocess.DEVNULL)
    log = out / "log.jsonl"
    cpu, wall = step_times(log, warmup, "cpu_seconds"), step_times(log, warmup, "seconds")
    start = json.loads(log.read_text().splitlines()[0])
    tokens = config.train.tokens_per_step
    # the first steps hold one-off costs (a compiled variant compiles there; its worker processes' CPU
    # time is not the run's own, their wall time is)
    first = {f"warmup_{field}": cumulative(log, field)[warmup] for field in ("seconds", "cpu_seconds")}
    return {"settings": overrides, "precision": start["precision"], "step_cpu_seconds": cpu, "step_seconds": wall,
            **first,
            "median_step_cpu_seconds": statistics.median(cpu), "median_step_seconds": statistics.median(wall),
            "tokens_per_cpu_hour": tokens / statistics.median(cpu) * 3600,
            "tokens_per_hour": tokens / statistics.median(wall) * 3600}


def summarise(runs: dict[str, list[dict]], baseline: str) -> dict:
    """Per variant: the medians over rounds, and each round's throughput over the baseline's in that round."""
    medians = ("tokens_per_cpu_hour", "tokens_per_hour", "median_step_cpu_seconds", "median_step_seconds")
    return {name: {
        **{key: statistics.median(r[key] for r in rs) for key in medians},
        "cpu_ratio_per_round": [r["tokens_per_cpu_hour"] / b["tokens_per_cpu_hour"]
                                for r, b in zip(rs, runs[baseline])],
        "wall_ratio_per_round": [r["tokens_per_hour"] / b["tokens_per_hour"] for r, b in zip(rs, runs[baseline])],
    } for name, rs in runs.items()}


def table(result: dict) -> list[str]:
    """The text report of `result`."""
    a = result["args"]
    lines = [f"# {result['model']}: {result['tokens_per_step']} tokens per step, {a['steps']} steps per run (median "
             f"after {a['warmup']}), {a['rounds']} rounds, chunks of {a['chunk']} tokens, "
             f"OMP_NUM_THREADS={result['threads']}, native bf16: {result['native_bf16']}, "
             f"CPU: {result.get('cpu', 'not recorded')}", "",
             "| variant | tokens / CPU-hour | tokens / hour | CPU s / step | s / step | "
             f"CPU throughput / {result['baseline']}, per round | wall throughput / {result['baseline']}, per round | "
             "first steps, s (CPU s) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in result["summary"].items():
        cpu = ", ".join(f"{r:.3f}" for r in s["cpu_ratio_per_round"])
        wall = ", ".join(f"{r:.3f}" for r in s["wall_ratio_per_round"])
        first = ", ".join(f"{r['warmup_seconds']:.0f} ({r['warmup_cpu_seconds']:.0f})" for r in result["runs"][name])
        lines.append(f"| {name} | {s['tokens_per_cpu_hour']:,.0f} | {s['tokens_per_hour']:,.0f} | "
                     f"{s['median_step_cpu_seconds']:.2f} | {s['median_step_seconds']:.2f} | {cpu} | {wall} | {first} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "experiments/robust/gemma3_coverage.toml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of each run's median")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the chunked vocabulary loss")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from: {', '.join(VARIANTS)}")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the runs (default: inherited)")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/cpu_throughput_<model>")
    parser.add_argument("--baseline", default=BASELINE, help="the variant every ratio is over (default: fp32; with "
                        "--before: fp32 (lnfree before))")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config setting for every variant (VALUE read as JSON where it parses)")
    parser.add_argument("--before", type=Path, default=None,
                        help=f"an lnfree checkout from before issue 38's changes: adds {', '.join(BEFORE)}, the baseline")
    args = parser.parse_args()
    known = {**VARIANTS, **(BEFORE if args.before else {})}
    names = [n.strip() for n in args.variants.split(",")]
    if unknown := [n for n in names if n not in known]:
        parser.error(f"unknown variant(s) {unknown}; choose from: {', '.join(known)}")
    baseline = next(iter(BEFORE)) if args.before and args.baseline == BASELINE else args.baseline
    if baseline not in known:
        parser.error(f"unknown baseline {baseline!r}; choose from: {', '.join(known)}")
    names = [baseline] + [n for n in names if n != baseline]  # ratios need the baseline in every round
    if args.steps <= args.warmup + 1:
        parser.error("--steps must exceed --warmup + 1")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        config = with_overrides(bench_config(args.config, args.steps, Path(tmp) / "run"),
                                dict(setting(s) for s in args.set))
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                settings = VARIANTS[BEFORE.get(name, name)]
                overrides = {k: args.chunk if v == "chunk" else v for k, v in settings.items()}
                code = args.before if name in BEFORE else None
                runs[name].append(one_run(config, overrides, Path(tmp), args.warmup, args.threads, code))
                row = runs[name][-1]
                print(f"round {round_ + 1} {name}: {row['median_step_cpu_seconds']:.2f} CPU s/step, "
                      f"{row['median_step_seconds']:.2f} s/step", flush=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "model": config.model, "torch": torch.__version__,
              "tokens_per_step": config.train.tokens_per_step, "native_bf16": cpu_has_native_bf16(),
              "cpu": cpu_description(),
              "threads": args.threads or os.environ.get("OMP_NUM_THREADS"), "baseline": baseline, "summary": summarise(runs, baseline), "runs": runs}
    out = args.out or ROOT / "benchmarks" / "results" / f"cpu_throughput_{config.model.replace('/', '_')}"
    (out.parent / f"{out.name}.json").write_text(json.dumps(result, indent=1))
    lines = table(result)
    (out.parent / f"{out.name}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
