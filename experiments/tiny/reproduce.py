"""The whole pipeline at CPU scale, on the bundled tiny model, regenerating `experiments/results/tiny/`.

    python experiments/tiny/reproduce.py            # ≈ 5 minutes on 2 CPU cores
    python experiments/tiny/reproduce.py --check    # regenerate elsewhere, compare with the committed results

Steps (each the user-facing command): `lnfree remove` (LN removal + vanilla control), `lnfree verify`
on the export, `lnfree eval` of original / vanilla / LN-free on held-out synthetic text, and
`lnfree analyze all` on the same three models. Model weights stay in the work folder; tables,
figures and summaries are copied into the results folder.

Runs are deterministic on one machine (seeded data order, σ measurement, bootstrap). Across
machines, CPU kernels differ in the last bits and 160 training steps carry that into every
number, so `--check` does not compare every per-token float: it compares what a reader relies on
(:data:`HEADLINES`: step counts, held-out CE and its gaps, eval CE/JSD/ECE, DLA and patching
agreement, entropy-neuron ablations and ranks, sink rates; and the order of the models in
:data:`RANKINGS`), each with a tolerance derived from the quantity:

- counts, steps and ranks: exact;
- a statistic reported with a 95% CI: a tenth of the CI's half-width (a change no reader could
  see beside the interval), but at least fp32 noise, so a value that is zero by construction
  (the LN-free model's DLA-vs-DE NMAE, ~1e-7) is compared in absolute terms;
- the removal run's held-out CE (no CI): a quarter of the smallest gap between the models;
- rates and accuracies: a few of the events they count.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path("experiments/results/tiny")  # paths are relative to the repository root, where commands run
LABELS = "original,vanilla,ln_free"


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
    """Yield (path, number) for every number in a JSON value."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{path}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, float(value)


#: The columns naming a CSV row (keys read `[original].mean_ce`, `[original/vanilla].mean_jsd`).
ROW_IDS = {"comparison.csv": ("model",), "pairwise.csv": ("a", "b")}


def _file_numbers(path: Path) -> dict[str, float]:
    """Every number of a JSON or CSV file under a flat key (see :data:`ROW_IDS` for CSV rows)."""
    if path.suffix == ".json":
        return dict(_numbers(json.loads(path.read_text())))
    numbers = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            name = "/".join(row[c] for c in ROW_IDS[path.name])
            for key, cell in row.items():
                try:
                    numbers[f"[{name}].{key}"] = float(cell)
                except (TypeError, ValueError):
                    pass
    return numbers


Tolerance = Callable[[str, dict[str, float]], float]  # (key, the committed file's numbers) -> tolerance
FP32_NOISE = 1e-5  # a value that is zero by construction, computed in fp32 over the tiny model


def exact(key: str, numbers: dict[str, float]) -> float:
    return 0.0


def absolute(value: float) -> Tolerance:
    return lambda key, numbers: value


def relative(value: float) -> Tolerance:
    return lambda key, numbers: value * abs(numbers[key])


def ci_share(name: str, low: str, high: str, share: float = 0.1) -> Tolerance:
    """A share of the 95% CI's half-width, read from the keys where `name` (the key's end) becomes `low`/`high`."""

    def tolerance(key: str, numbers: dict[str, float]) -> float:
        stem = key[: -len(name)]
        return max(FP32_NOISE, share * (numbers[stem + high] - numbers[stem + low]) / 2)

    return tolerance


def smallest_gap_share(pattern: str, share: float = 0.25) -> Tolerance:
    """A share of the smallest difference between the values matching `pattern` (e.g. the models' CEs)."""

    def tolerance(key: str, numbers: dict[str, float]) -> float:
        values = sorted(v for k, v in numbers.items() if _matches(pattern, k))
        return share * min(b - a for a, b in zip(values, values[1:]))

    return tolerance


def events(count_key: Callable[[str], str], n: int = 2) -> Tolerance:
    """`n` of the events a rate counts (the count read from the key `count_key(key)`)."""
    return lambda key, numbers: n / numbers[count_key(key)]


A, R, E, P = "analysis/index.json", "removal_summary.json", "eval/comparison.csv", "eval/pairwise.csv"
#: (file, key pattern with `*` wildcards, tolerance): what a reader of the tiny results relies on.
HEADLINES: list[tuple[str, str, Tolerance]] = [
    (R, ".steps", exact), (R, ".tokens", exact), (R, ".removal_events[*].step", exact),
    (R, ".held_out_ce.*", smallest_gap_share(".held_out_ce.*")),
    (E, "[*].scored_tokens", exact), (E, "[*].tokens_above_threshold", exact),
    (E, "[*].mean_ce", ci_share("mean_ce", "mean_ce_ci_low", "mean_ce_ci_high")),
    (E, "[*].delta_ce", ci_share("delta_ce", "delta_ce_ci_low", "delta_ce_ci_high")),
    (E, "[*].ece", ci_share("ece", "ece_ci_low", "ece_ci_high")),
    (E, "[*].top1_accuracy", events(lambda key: key.replace("top1_accuracy", "scored_tokens"))),
    (P, "[*].mean_jsd", ci_share("mean_jsd", "jsd_ci_low", "jsd_ci_high")),
    (P, "[*].delta_ce", ci_share("delta_ce", "delta_ce_ci_low", "delta_ce_ci_high")),
    (A, ".analyses.dla.models.*.heads.nmae", ci_share("nmae", "ci_low", "ci_high")),
    (A, ".analyses.dla.models.*.mlps.nmae", ci_share("nmae", "ci_low", "ci_high")),
    (A, ".analyses.patching.models.*.n_prompts", exact),
    (A, ".analyses.patching.models.*.ioi_accuracy_clean",
     events(lambda key: key.replace("ioi_accuracy_clean", "n_prompts"), n=1)),
    (A, ".analyses.patching.models.*.agreement.*.nmae_per_prompt.value", ci_share("value", "ci_low", "ci_high")),
    (A, ".analyses.patching.models.*.agreement.*.pearson_r.value", ci_share("value", "ci_low", "ci_high")),
    (A, ".analyses.entropy-neurons.per_model.*.selected.*.rank", exact),
    (A, ".analyses.entropy-neurons.per_model.*.ablations.top-*.relative_entropy_change_percent",
     ci_share("percent", "percent_lo", "percent_hi")),
    (A, ".analyses.entropy-neurons.per_model.*.ablations.top-*.median_abs_delta_entropy",
     ci_share("entropy", "entropy_lo", "entropy_hi")),
    # ~32k (head, query) pairs over 32 sequences: 1e-3 is ~30 of them crossing the threshold.
    (A, ".analyses.residual.models.*.sink_rate.*", absolute(1e-3)),
    (A, ".analyses.residual.models.*.max_norm_ratio_position_0", relative(1e-3)),
]  # fmt: skip
#: (file, key pattern): the order of the models by these values must not change.
RANKINGS = [(R, ".held_out_ce.*"), (E, "[*].mean_ce"), (A, ".analyses.dla.models.*.heads.nmae")]


def _matches(pattern: str, key: str) -> bool:
    return re.fullmatch(".*?".join(re.escape(part) for part in pattern.split("*")), key) is not None


def compare(committed: Path, fresh: Path) -> list[str]:
    """Differences between two results folders in what a reader relies on (:data:`HEADLINES`, :data:`RANKINGS`)."""
    committed, fresh = REPO / committed, REPO / fresh
    numbers = {}
    for name in {file for file, *_ in HEADLINES}:
        if not (fresh / name).exists():
            return [f"missing: {name}"]
        numbers[name] = _file_numbers(committed / name), _file_numbers(fresh / name)
    problems = []
    for name, pattern, tolerance in HEADLINES:
        old, new = numbers[name]
        keys = sorted({k for k in old | new if _matches(pattern, k)})
        if not keys:
            problems.append(f"{name}: no value matches {pattern}")
        for key in keys:
            x, y = old.get(key), new.get(key)
            if x is None or y is None:
                problems.append(f"{name}{key}: only in the {'regenerated' if x is None else 'committed'} results")
                continue
            tol = tolerance(key, old)
            if not (abs(x - y) <= tol or (math.isnan(x) and math.isnan(y))):
                problems.append(f"{name}{key}: committed {x:.6g}, regenerated {y:.6g} (tolerance {tol:.2g})")
    for name, pattern in RANKINGS:
        orders = [sorted((k for k in n if _matches(pattern, k)), key=n.get) for n in numbers[name]]
        if orders[0] != orders[1]:
            problems.append(f"{name}: order by {pattern} changed from {orders[0]} to {orders[1]}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS, help="where tables and figures go")
    parser.add_argument("--work", type=Path, default=Path("runs/tiny-reproduction"), help="where model weights go")
    parser.add_argument("--check", action="store_true", help="regenerate into a temporary folder and compare")
    args = parser.parse_args()
    if not args.check:
        reproduce(args.results, args.work)
        print(f"results: {args.results}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        reproduce(Path(tmp) / "results", Path(tmp) / "work")
        problems = compare(args.results, Path(tmp) / "results")
    for line in problems[:50]:
        print(line)
    print(f"{len(problems)} differences in the headline numbers beyond their tolerances")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
