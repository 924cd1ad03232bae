"""Peak memory of `lnfree eval` and `lnfree analyze all` on a model, each in its own process.

Runs, each as a fresh subprocess whose peak resident set size (`ru_maxrss` of that child, from
`os.wait4`) is recorded:

* ``load``: the models loaded as `lnfree analyze` loads them (fp32) and read once (weights are mapped
  from their files, resident once read), nothing else: the floor under the two commands;
* ``eval``: `lnfree eval MODEL ... --dataset D --context 64 --n-sequences 66`;
* ``analyze all``: `lnfree analyze all --models MODEL ... --dataset D --n-sequences 8 --length 64
  --n-prompts 8 --batch-size 4` (the small settings of docs/how-to/modern-models.md), with the peak
  each analysis reached (the command's own `timings.json`: the process peak when it finished);
* with ``--each``, every analysis alone (`lnfree analyze NAME ...`), in a process of its own.

Writes ``benchmarks/results/analysis_memory_<name>.json`` and ``.txt`` (``<name>``: ``--name``, by default
the models' labels joined by ``+``).

    python benchmarks/analysis_memory.py gemma3-270m [MORE MODELS] [--labels ...] [--dataset realtext] [--each]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANALYSES = ("dla", "patching", "entropy-neurons", "residual")
LOAD = ("import sys; from lnfree.analysis.common import load_models; "
        "[p.sum() for m in load_models(sys.argv[1:], device='cpu') for p in m.loaded.model.parameters()]")


def peak_of(command: list[str], env: dict) -> dict:
    """Run `command`; its exit status, wall seconds, peak RSS (GB, this child alone) and, if it failed, its
    output's tail."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        tail = log.read().decode(errors="replace").splitlines()[-15:]
    return {"command": " ".join(command[2:] if command[1] == "-m" else command), "exit_status": child.returncode,
            "seconds": round(time.perf_counter() - started, 1), "peak_rss_gb": round(usage.ru_maxrss / 2**20, 3),
            **({"output_tail": tail} if child.returncode else {})}


def commands(args: argparse.Namespace, work: Path) -> dict[str, list[str]]:
    """The measured commands, by name."""
    python = [sys.executable, "-m", "lnfree"]
    labels = ["--labels", *args.labels] if args.labels else []
    small = ["--dataset", args.dataset, "--n-sequences", str(args.n_sequences), "--length", str(args.length),
             "--n-prompts", str(args.n_prompts), "--batch-size", str(args.batch_size), "--device", "cpu",
             "--no-progress"]
    runs = {
        "load": [sys.executable, "-c", LOAD, *args.models],
        "eval": [*python, "eval", *args.models, *labels, "--dataset", args.dataset, "--context", str(args.context),
                 "--n-sequences", str(args.eval_sequences), "--device", "cpu", "--no-progress", "--out",
                 str(work / "eval")],
        "analyze all": [*python, "analyze", "all", "--models", *args.models, *labels, *small, "--out",
                        str(work / "all")],
    }
    for name in ANALYSES if args.each else ():
        runs[f"analyze {name}"] = [*python, "analyze", name, "--models", *args.models, *labels, *small, "--out",
                                   str(work / name)]
    return runs


def own_report(name: str, work: Path) -> dict:
    """What the command itself reported: eval's `settings.peak_memory_gb`, each analysis's peak from timings.json."""
    try:
        if name == "eval":
            return {"reported_peak_gb": json.loads((work / "eval" / "summary.json").read_text())["settings"]
                    .get("peak_memory_gb")}
        if name == "analyze all":
            return {"reported_peak_gb": json.loads((work / "all" / "timings.json").read_text()).get("peak_memory_gb")}
    except (OSError, KeyError, ValueError):
        return {}
    return {}


def text_report(results: dict) -> str:
    """The results as a short table."""
    lines = [f"Peak RSS per process, {results['models']} ({results['settings']})", "",
             f"{'run':<26} {'peak RSS GB':>11} {'seconds':>8}  exit", "-" * 54]
    for name, run in results["runs"].items():
        lines.append(f"{name:<26} {run['peak_rss_gb']:>11.3f} {run['seconds']:>8.1f}  {run['exit_status']}")
    per_analysis = results["runs"].get("analyze all", {}).get("reported_peak_gb") or {}
    if per_analysis:
        lines += ["", "analyze all, process peak when each analysis finished (its timings.json):"]
        lines += [f"  {name:<24} {gb:>11.3f}" for name, gb in per_analysis.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="Model names or folders, as `lnfree eval` takes them.")
    parser.add_argument("--labels", nargs="*", default=None)
    parser.add_argument("--dataset", default="realtext")
    parser.add_argument("--context", type=int, default=64, help="lnfree eval --context")
    parser.add_argument("--eval-sequences", type=int, default=66, help="lnfree eval --n-sequences")
    parser.add_argument("--n-sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--each", action="store_true", help="Also run every analysis alone, each in its own process.")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the runs")
    parser.add_argument("--name", default=None, help="Result file name suffix (default: the models' labels).")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    name = args.name or "+".join(args.labels or [Path(m.rstrip("/")).name for m in args.models])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    results = {"models": args.models, "settings": {k: getattr(args, k) for k in (
        "dataset", "context", "eval_sequences", "n_sequences", "length", "n_prompts", "batch_size", "threads")},
        "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for run, command in commands(args, Path(tmp)).items():
            results["runs"][run] = peak_of(command, env) | own_report(run, Path(tmp))
            print(f"{run}: {results['runs'][run]['peak_rss_gb']:.3f} GB, exit {results['runs'][run]['exit_status']}",
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"analysis_memory_{name}.json").write_text(json.dumps(results, indent=1))
    (args.out / f"analysis_memory_{name}.txt").write_text(text_report(results))
    print(text_report(results))


if __name__ == "__main__":
    main()
