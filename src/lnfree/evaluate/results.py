"""Results as files and numbers, for the evaluation and every analysis: model labels, bootstrap
confidence intervals, CSV tables and JSON summaries (wall-clock seconds in a file of their own), and
the process's peak memory."""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from lnfree.errors import UsageError


def default_label(source: str) -> str:
    """A short label for a model source: its folder name (or Hub repo name)."""
    path = Path(str(source).rstrip("/"))
    if path.name == "export" and path.parent.name:
        return path.parent.name
    return path.name or str(source)


def model_labels(sources: Sequence[str], labels: Sequence[str] | None = None) -> list[str]:
    """One unique label per source; by default the sources' folder names."""
    if labels is not None and len(labels) != len(sources):
        raise UsageError(f"{len(labels)} labels for {len(sources)} models")
    if not labels:
        return _unique_defaults(sources)
    labels = list(labels)
    if len(set(labels)) != len(labels):
        raise UsageError(f"model labels must be unique, got {labels}; pass labels explicitly")
    return labels


def _unique_defaults(sources: Sequence[str]) -> list[str]:
    """Default labels, lengthened where they collide: the shortest path suffix that tells them apart
    ('tiny-llama' and 'tiny-llama/export'), then a number for sources given twice."""
    labels = [default_label(s) for s in sources]
    parts = [Path(str(s).rstrip("/")).parts for s in sources]
    for depth in range(2, max(len(p) for p in parts) + 1):
        clashing = {i for i, label in enumerate(labels) if labels.count(label) > 1}
        if not clashing:
            break
        for i in clashing:
            labels[i] = "/".join(parts[i][-depth:])
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            labels[i] = f"{label} #{seen[label]}"
    return labels


def auto_block(n: int) -> int:
    """The default block length of a moving-block bootstrap over `n` neighbouring units: round(√n)
    (8 of 64 sequences, 25 of 620), long enough to span a document of several sequences."""
    return max(1, round(n ** 0.5))


def _resample(rng: np.random.Generator, n: int, block: int) -> np.ndarray:
    """Indices of one bootstrap resample of n units: blocks of `block` consecutive units (circular,
    random starts), cut to n; block 1 is the plain bootstrap (the same draws)."""
    if block <= 1:
        return rng.integers(0, n, n)
    starts = rng.integers(0, n, -(-n // block))
    return ((starts[:, None] + np.arange(block)[None, :]) % n).reshape(-1)[:n]


def bootstrap_ci(
    values: np.ndarray | Sequence[float], *, statistic: Callable[[np.ndarray], float] = np.mean,
    n_resamples: int = 1000, seed: int = 0, level: float = 0.95, block: int = 1,
) -> tuple[float, float]:
    """Percentile bootstrap CI of `statistic` over the first axis of `values` (resampling units, e.g.
    sequences). With `block` > 1 a circular moving-block bootstrap: units next to each other (sequences
    cut from one document) are resampled together, so their correlation widens the interval as it should."""
    values = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    n = values.shape[0]
    if n == 0 or n_resamples < 1:
        return float("nan"), float("nan")
    stats = np.array([statistic(values[_resample(rng, n, block)]) for _ in range(n_resamples)])
    alpha = (1 - level) / 2
    return float(np.quantile(stats, alpha)), float(np.quantile(stats, 1 - alpha))


def ratio_of_means_ci(
    numerators: np.ndarray, denominators: np.ndarray, *, n_resamples: int = 1000, seed: int = 0, level: float = 0.95,
) -> tuple[float, float]:
    """Bootstrap CI of sum(numerators)/sum(denominators), resampling the first axis jointly."""
    stacked = np.stack([np.asarray(numerators, np.float64), np.asarray(denominators, np.float64)], axis=1)
    return bootstrap_ci(stacked, statistic=lambda s: s[:, 0].sum() / s[:, 1].sum(),
                        n_resamples=n_resamples, seed=seed, level=level)


def write_table(table, out_dir: str | Path, name: str) -> Path:
    """Write a pandas DataFrame as `out_dir/name.csv` (tidy: one row per observation)."""
    path = Path(out_dir) / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(path, index=False)
    return path


#: The summary (timings.json) of an analysis's wall-clock seconds: kept out of the result summaries, so
#: that results written again from the same models are byte-identical (only this file changes).
TIMINGS = "timings"


def write_summary(summary: dict, out_dir: str | Path, name: str = "summary") -> Path:
    """Write a JSON summary (numbers, settings, seeds, file list)."""
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, default=str))
    return path


def write_experiment(result: dict, tables: str | Sequence[str], out_dir: str | Path) -> Path:
    """An experiment script's record in `out_dir` (created): `result` as results.json and `tables` (markdown
    text, or its lines) as tables.md; returns `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    text = tables if isinstance(tables, str) else "\n".join(tables)
    (out / "tables.md").write_text(text if text.endswith("\n") else text + "\n")
    return out


def ce_headline(summary: dict, label: str) -> dict:
    """The headline of an `lnfree eval` summary (its summary.json, read as a dict) for the model `label`:
    every model's mean CE, the scored tokens per model, and `label` minus the reference model with its
    bootstrap CI and the unit that bootstrap resamples."""
    ce = {m["label"]: m["ce"]["mean"] for m in summary["models"]}
    if label not in ce:
        raise UsageError(f"{label!r} is not one of the evaluated labels {list(ce)}")
    model = next(m for m in summary["models"] if m["label"] == label)
    return {**ce, "scored_tokens": summary["dataset"]["scored_tokens_per_model"],
            "delta_vs_reference": model.get("delta_ce_vs_reference"),
            "ci": model.get("delta_ce_vs_reference_ci"), "reference": model.get("reference"),
            "ci_method": summary["settings"].get("bootstrap_unit")}


def peak_memory_gb() -> float:
    """This process's peak resident memory so far, in GB (2**30 bytes; `ru_maxrss`), rounded to 3 decimals.

    A peak over the process's whole life: a later step reports at least what an earlier one reached.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**30 if sys.platform == "darwin" else 2**20), 3)  # bytes on macOS, KiB elsewhere
