"""The GPT-2 presets on a GPU: tokens/s, peak memory against `lnfree plan`, and what bf16 and compile change
(issue 38).

For each GPT-2 preset (gpt2, gpt2-distill, gpt2-medium, gpt2-large, gpt2-xl) a GPT-2 of the published
shape (`lnfree.arch.gpt2.PUBLISHED_SIZES`: 50,257-token vocabulary, 1,024 positions) with random weights
is saved to a local folder with the realtext tokenizer (no Hub needed; token values do not change the
work of a step). Each run is `lnfree.removal.train.run` on the preset's config with that model, the
text file `--text` as data (by default the realtext training documents), the preset's micro-batch
and `--accumulation` micro-batches per step (the presets accumulate to 524,288 tokens per step, so the
optimiser step weighs more here than in a real run), cut to `--steps` steps with one removal at step 1
(`throughput.bench_overrides`). Arms:
- bf16: the preset as it is (`train.mixed_precision = "auto"`: bf16 autocast on a GPU);
- fp32: `train.mixed_precision = "no"`;
- bf16 + compile: `train.compile = true` (its first steps compile, and recompile at step 1's removal).

Each run is a fresh process (so each has its own CUDA memory peak) that skips the final checkpoint
(its disk write is not a step). Per run: the median step time after `--warmup` steps, tokens/s, the
peak GPU memory that torch allocated and reserved, and the peak that `lnfree plan` predicts for the same
setup (`lnfree.removal.plan.run_prediction`; its 2 GB reserve is for the CUDA context and fragmentation,
which torch's counters do not see). The runs go in the order of `--runs` until `--budget` seconds are
spent; a run that would start later is listed as not run. The JSON and text are rewritten after every
run, so a stopped job keeps what it measured.

    python benchmarks/gpu_presets.py [--runs "gpt2:bf16,gpt2-xl:fp32,..."] [--steps 8] [--warmup 3]
        [--accumulation 4] [--budget 480] [--text FILE] [--out benchmarks/results/gpu/gpt2_presets]
    python benchmarks/gpu_presets.py --smoke   # a CPU check of this script: 2-layer models, 128 tokens
    python benchmarks/gpu_presets.py --replan benchmarks/results/gpu/*.json   # measured peaks vs today's plan
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

ARMS = {"bf16": {}, "fp32": {"train.mixed_precision": "no"}, "bf16 + compile": {"train.compile": True}}
PRESETS = ("gpt2", "gpt2-distill", "gpt2-medium", "gpt2-large", "gpt2-xl")
#: Every preset in bf16 first, then what fp32 and compile change at both ends of the size range.
DEFAULT_RUNS = [*(f"{p}:bf16" for p in PRESETS), "gpt2:fp32", "gpt2:bf16 + compile", "gpt2-xl:fp32",
                "gpt2-xl:bf16 + compile", "gpt2-medium:fp32", "gpt2-large:fp32"]
#: llm.c's GPT-2 (124M) training on one A100 40GB, bf16 (issue 38's reference, from llm.c's README).
LLM_C_TOKENS_PER_SECOND = 218_000
SMOKE_SHAPE = {"n_layer": 2, "n_embd": 64, "n_head": 2}


def model_folder(preset: str, work: Path, smoke: bool) -> Path:
    """A folder holding a random-weight GPT-2 of `preset`'s published shape and the realtext tokenizer
    (made once per shape)."""
    import torch
    from transformers import GPT2LMHeadModel

    from lnfree.arch.gpt2 import published_config
    from lnfree.data.realtext import REALTEXT_MODEL_DIR
    from lnfree.removal.config import load_preset

    name = load_preset(preset).model
    config = published_config(name)
    if smoke:
        config.update(SMOKE_SHAPE)
    folder = work / "models" / name.replace("/", "_")
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = GPT2LMHeadModel(config)
    model.save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REALTEXT_MODEL_DIR / file, folder / file)
    return folder


def run_config(preset: str, arm: str, folder: Path, args, work: Path):
    """`preset`'s run config for one benchmark run of `arm` on the model in `folder`."""
    from throughput import bench_overrides

    from lnfree.removal.config import load_preset, with_overrides

    config = with_overrides(load_preset(preset), bench_overrides(args.steps, work / "run"))
    micro = config.train.micro_batch_size
    context = config.data.context_length
    if args.smoke:
        micro, context = 2, 128
    overrides = {
        "model": str(folder), "data.source": str(args.text), "data.document_separator": "\n\n",
        "data.revision": None, "data.cache_dir": str(work / "data"), "data.val_fraction": 0.01,
        "data.context_length": context, "train.micro_batch_size": micro,
        "train.tokens_per_step": micro * context * args.accumulation, **ARMS[arm],
        **dict(kv.split("=", 1) for kv in args.set),
    }
    return with_overrides(config, overrides)


def child(spec: Path) -> None:
    """Run the config in `spec` and write its timings and memory next to it (`--child`)."""
    import torch

    import lnfree.removal.train as train
    from lnfree.removal.config import RunConfig
    from lnfree.removal.plan import run_prediction

    job = json.loads(spec.read_text())
    config = RunConfig.model_validate(job["config"])
    # the final checkpoint (for GPT-2 XL some 20 GB of weights and optimiser state) is a disk write, not a step
    train.save_checkpoint = lambda *a, **k: None
    result = train.run(config, overwrite=True, progress=False)
    log = [json.loads(line) for line in (Path(config.output_dir) / "log.jsonl").read_text().splitlines()]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    precision = log[0]["precision"]
    prediction = run_prediction(config, result.model.config, config.data.context_length,
                                config.train.micro_batch_size, 1, device, precision != "no")
    seconds = {r["step"]: r["seconds"] for r in log if "seconds" in r and "event" not in r}
    steps = sorted(seconds)
    times = [seconds[b] - seconds[a] for a, b in zip(steps, steps[1:]) if a >= job["warmup"]]
    median = statistics.median(times)
    out = {
        "precision": precision, "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "micro_batch": config.train.micro_batch_size, "context": config.data.context_length,
        "tokens_per_step": config.train.tokens_per_step, "step_seconds": times, "median_step_seconds": median,
        "tokens_per_second": config.train.tokens_per_step / median, "first_steps_seconds": seconds[job["warmup"]],
        "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if cuda else None,
        "predicted_gb": prediction.total / 1e9, "predicted": {k: v / 1e9 for k, v in prediction.model_dump().items()},
        "parameters": sum(p.numel() for p in result.model.parameters()),
    }
    Path(job["result"]).write_text(json.dumps(out, indent=1))


def one_run(preset: str, arm: str, args, work: Path, timeout: float) -> dict:
    """One run in a fresh process; its result, or why there is none."""
    folder = model_folder(preset, work, args.smoke)
    config = run_config(preset, arm, folder, args, work)
    spec, result = work / "job.json", work / "result.json"
    result.unlink(missing_ok=True)
    spec.write_text(json.dumps({"config": json.loads(config.model_dump_json()), "warmup": args.warmup,
                                "result": str(result)}))
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, __file__, "--child", str(spec)], timeout=timeout,
                              capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {timeout:.0f} s (the budget)"}
    wall = time.perf_counter() - start
    if done.returncode != 0 or not result.is_file():
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-3:], "wall_seconds": wall}
    return {**json.loads(result.read_text()), "wall_seconds": wall}


def table(result: dict) -> list[str]:
    """The text report of `result`."""
    a = result["args"]
    lines = [f"# GPT-2 presets on {result['device']} (torch {result['torch']}): random weights of the published "
             f"shapes, {a['accumulation']} micro-batches per step, {a['steps']} steps per run (median after "
             f"{a['warmup']})", "",
             f"Reference: llm.c's GPT-2 124M trains at ~{LLM_C_TOKENS_PER_SECOND:,} tokens/s on one A100 "
             "(plain training: no teacher, no σ statistics).", "",
             "| preset | arm | precision | micro-batch × context | tokens/s | s / step | first steps, s | "
             "peak allocated GB | peak reserved GB | plan's prediction GB (without its reserve) | run's wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in result["runs"].items():
        preset, arm = key.split(":", 1)
        if "error" in r:
            lines.append(f"| {preset} | {arm} | failed: {r['error']} |")
            continue
        reserve = r["predicted"]["reserve"]
        peak = (f"{r['peak_allocated_gb']:.1f} | {r['peak_reserved_gb']:.1f}" if r["peak_allocated_gb"] is not None
                else "– | –")
        lines.append(f"| {preset} | {arm} | {r['precision']} | {r['micro_batch']} × {r['context']} | "
                     f"{r['tokens_per_second']:,.0f} | {r['median_step_seconds']:.3f} | {r['first_steps_seconds']:.1f} | "
                     f"{peak} | {r['predicted_gb']:.1f} ({r['predicted_gb'] - reserve:.1f}) | {r['wall_seconds']:.0f} |")
    for key in result["not_run"]:
        lines.append(f"| {key.replace(':', ' | ', 1)} | not run: the budget was spent |")
    return lines


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / f"{out.name}.json").write_text(json.dumps(result, indent=1))
    (out.parent / f"{out.name}.txt").write_text("\n".join(table(result)) + "\n")


def replan(paths: list[Path], out: Path) -> list[str]:
    """Each measured run in the result files `paths` beside the peak that the plan predicted when it ran and
    the one that this checkout's plan predicts (no GPU needed); written to `out`.json / .txt."""
    import torch

    from lnfree.arch.gpt2 import published_config
    from lnfree.removal.config import load_preset, with_overrides
    from lnfree.removal.plan import run_prediction

    rows = []
    for path in paths:
        result = json.loads(path.read_text())
        for key, r in result["runs"].items():
            if "error" in r or r["peak_allocated_gb"] is None:
                continue
            preset, arm = key.split(":", 1)
            config = with_overrides(load_preset(preset), ARMS[arm])
            now = run_prediction(config, published_config(config.model), r["context"], r["micro_batch"], 1,
                                 torch.device("cuda"), r["precision"] != "no")
            reserve = now.reserve / 1e9
            rows.append({"run": key, "device": result["device"], "measured_allocated_gb": r["peak_allocated_gb"],
                         "then_gb": r["predicted_gb"] - r["predicted"]["reserve"], "now_gb": now.total / 1e9 - reserve})
    lines = ["# Peak GPU memory: measured (torch's allocated peak) against the plan without its reserve", "",
             "| run | device | measured GB | plan when measured GB | plan now GB | now / measured |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['device']} | {r['measured_allocated_gb']:.1f} | {r['then_gb']:.1f} | {r['now_gb']:.1f} | "
              f"{r['now_gb'] / r['measured_allocated_gb']:.3f} |" for r in rows]
    (out.parent / f"{out.name}.json").write_text(json.dumps(rows, indent=1))
    (out.parent / f"{out.name}.txt").write_text("\n".join(lines) + "\n")
    return lines


def default_text(path: Path, megabytes: float) -> Path:
    """The realtext training documents as one text file, paragraphs apart, cut to `megabytes`."""
    from lnfree.data.realtext.corpus import train_and_heldout

    text = "\n\n".join(train_and_heldout()[0])
    path.write_text(text[: text.rfind("\n\n", 0, int(megabytes * 1e6))])
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help="comma-separated preset:arm, in order "
                        f"(presets {', '.join(PRESETS)}; arms {', '.join(ARMS)})")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of each run's median")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimiser step")
    parser.add_argument("--budget", type=float, default=480, help="seconds; no run starts after them")
    parser.add_argument("--text", type=Path, default=None, help="a .txt file of training text (default: realtext's "
                        "training documents cut to --text-mb, written to the work folder, or to --write-text and exit)")
    parser.add_argument("--text-mb", type=float, default=3.0)
    parser.add_argument("--write-text", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, default=None, help="where models and runs go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/gpu/gpt2_presets "
                        "(with --smoke: a temporary folder)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a further config override for every run (e.g. train.learning_rate=1e-5)")
    parser.add_argument("--smoke", action="store_true", help="2-layer models, 128 tokens, micro-batches of 2 (CPU check)")
    parser.add_argument("--replan", type=Path, nargs="+", default=None, metavar="RESULT_JSON",
                        help="no runs: compare the measured peaks in these result files with this checkout's plan "
                        "(writes benchmarks/results/gpu/plan_vs_measured)")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    if args.replan:
        return print("\n".join(replan(args.replan, ROOT / "benchmarks/results/gpu/plan_vs_measured")))
    if args.write_text:
        return print(default_text(args.write_text, args.text_mb))
    runs = [r.strip() for r in args.runs.split(",")]
    if bad := [r for r in runs if r.split(":")[0] not in PRESETS or r.partition(":")[2] not in ARMS]:
        parser.error(f"unknown run(s) {bad}")
    if args.steps <= args.warmup + 1:
        parser.error("--steps must exceed --warmup + 1")
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        out = args.out or (work / "gpt2_presets" if args.smoke else ROOT / "benchmarks/results/gpu/gpt2_presets")
        args.text = args.text or default_text(work / "realtext_train.txt", args.text_mb)
        deadline = time.perf_counter() + args.budget
        result = {"args": {k: str(v) for k, v in vars(args).items() if k != "child"}, "torch": torch.__version__,
                  "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  "command": "python benchmarks/gpu_presets.py " + " ".join(sys.argv[1:]), "runs": {},
                  "not_run": []}
        for i, key in enumerate(runs):
            left = deadline - time.perf_counter()
            if left < 20:
                result["not_run"] = runs[i:]
                break
            preset, arm = key.split(":", 1)
            result["runs"][key] = one_run(preset, arm, args, work, left)
            r = result["runs"][key]
            print(f"{key}: " + (f"{r['tokens_per_second']:,.0f} tokens/s, peak {r['peak_reserved_gb']} GB reserved, "
                                f"predicted {r['predicted_gb']:.1f} GB" if "error" not in r else f"FAILED {r['error']}"),
                  flush=True)
            write(result, out)
        write(result, out)
        print("\n".join(table(result)))


if __name__ == "__main__":
    main()
