"""The whole pipeline at CPU scale, on the bundled tiny model, regenerating `experiments/results/tiny/`.

    python experiments/tiny/reproduce.py            # ≈ 5 minutes on 2 CPU cores
    python experiments/tiny/reproduce.py --check    # regenerate elsewhere, compare with the committed results

Steps (each the user-facing command): `lnfree remove` (LN removal + vanilla control), `lnfree verify`
on the export, `lnfree eval` of original / vanilla / LN-free on held-out synthetic text, and
`lnfree analyze all` on the same three models. Model weights stay in the work folder; tables,
figures and summaries are copied into the results folder.

Runs are deterministic on one machine (seeded data order, σ measurement, bootstrap). Across
machines, CPU kernels may differ in the last bits, so `--check` compares numbers with a relative
tolerance (`--rtol`, default 1e-3) rather than bit for bit.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path("experiments/results/tiny")  # paths are relative to the repository root, where commands run
LABELS = "original,vanilla,ln_free"
# Fields that legitimately differ between runs: timings, absolute paths, versions.
VOLATILE = {"seconds", "train_seconds", "total_seconds", "checkpoint", "export", "control_dir", "source", "repr",
            "out", "path", "paths", "figures", "tables", "files", "summary_path", "created", "lnfree_version",
            "timing_s"}


def lnfree(*args: str) -> None:
    """Run one `lnfree` command in this interpreter; stop on failure."""
    command = [sys.executable, "-m", "lnfree", *args]
    print("$ lnfree " + " ".join(args), flush=True)
    subprocess.run(command, check=True, cwd=REPO)


def reproduce(results: Path, work: Path) -> None:
    """Run every step into `work`, then copy the small outputs into `results`."""
    run = work / "run"
    lnfree("remove", "-o", str(run), "--overwrite")
    models = ["tiny", str(run / "control"), str(run / "export")]
    if (REPO / results).exists():
        shutil.rmtree(REPO / results)
    (REPO / results).mkdir(parents=True)
    lnfree("verify", str(run / "export"), "-o", str(results / "verify.json"))
    lnfree("eval", *models, "--labels", LABELS, "--dataset", "tiny", "--out", str(results / "eval"))
    lnfree("analyze", "all", "--models", *models, "--labels", LABELS, "--out", str(results / "analysis"))
    for source, name in ((run / "summary.json", "removal_summary.json"), (run / "log.jsonl", "removal_log.jsonl"),
                         (run / "control" / "log.jsonl", "control_log.jsonl")):
        shutil.copy(REPO / source, REPO / results / name)
    write_readme(REPO / results)


def write_readme(results: Path) -> None:
    """A short page pointing at everything the reproduction wrote."""
    summary = json.loads((results / "removal_summary.json").read_text())
    ce = summary["held_out_ce"]
    lines = [
        "# Tiny-model reproduction (CPU)", "",
        "Regenerate with `python experiments/tiny/reproduce.py`; check with `--check`.", "",
        f"Removal: {summary['steps']} steps, {summary['tokens']:,} tokens; held-out CE "
        + ", ".join(f"{k} {v:.4f}" for k, v in ce.items()) + ".", "",
        "- `removal_summary.json`, `removal_log.jsonl`, `control_log.jsonl`: the removal run and its vanilla control",
        "- `verify.json`: every representation of the export vs the exact form",
        "- [`eval/comparison.md`](eval/comparison.md): cross-entropy, percentiles, ECE, pairwise JSD",
        "- [`analysis/index.md`](analysis/index.md): DLA vs DE, patching, entropy neurons, residual norms and sinks",
    ]
    (results / "README.md").write_text("\n".join(lines) + "\n")


def _numbers(value, path: str = ""):
    """Yield (path, number) for every number in a JSON value, skipping volatile fields."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in VOLATILE:
                yield from _numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{path}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, float(value)


def _file_numbers(path: Path) -> dict[str, float]:
    if path.suffix == ".json":
        return dict(_numbers(json.loads(path.read_text())))
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return dict(_numbers(records))
    numbers = {}
    with path.open() as f:
        for i, row in enumerate(csv.DictReader(f)):
            for key, cell in row.items():
                try:
                    numbers[f"[{i}].{key}"] = float(cell)
                except (TypeError, ValueError):
                    pass
    return numbers


def compare(committed: Path, fresh: Path, rtol: float, atol: float) -> list[str]:
    """Differences between two results folders' numbers (JSON, JSONL and CSV files)."""
    committed, fresh = REPO / committed, REPO / fresh
    problems = []
    for old in sorted(committed.rglob("*")):
        if old.suffix not in {".json", ".jsonl", ".csv"} or old.name in {"verify.json"}:
            continue
        new = fresh / old.relative_to(committed)
        if not new.exists():
            problems.append(f"missing: {new.relative_to(fresh)}")
            continue
        a, b = _file_numbers(old), _file_numbers(new)
        for key in sorted(set(a) | set(b)):
            x, y = a.get(key), b.get(key)
            if x is None or y is None:
                problems.append(f"{old.relative_to(committed)}{key}: only in one run")
            elif not (math.isclose(x, y, rel_tol=rtol, abs_tol=atol) or (math.isnan(x) and math.isnan(y))):
                problems.append(f"{old.relative_to(committed)}{key}: committed {x:.6g}, regenerated {y:.6g}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS, help="where tables and figures go")
    parser.add_argument("--work", type=Path, default=Path("runs/tiny-reproduction"), help="where model weights go")
    parser.add_argument("--check", action="store_true", help="regenerate into a temporary folder and compare")
    parser.add_argument("--rtol", type=float, default=1e-3)
    parser.add_argument("--atol", type=float, default=1e-6)
    args = parser.parse_args()
    if not args.check:
        reproduce(args.results, args.work)
        print(f"results: {args.results}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        reproduce(Path(tmp) / "results", Path(tmp) / "work")
        problems = compare(args.results, Path(tmp) / "results", args.rtol, args.atol)
    for line in problems[:50]:
        print(line)
    print(f"{len(problems)} differences beyond rtol={args.rtol}, atol={args.atol}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
