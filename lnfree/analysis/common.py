"""Shared pieces of the analyses: models by label, evaluation tokens, bootstrap CIs, output files."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lnfree.load import LoadedModel, load


@dataclass
class AnalysisModel:
    """A loaded model under a short label ("original", "vanilla", "ln_free"), with its bridge cached."""

    label: str
    loaded: LoadedModel
    _bridge: Any = field(default=None, repr=False)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def ln_free(self) -> bool:
        return self.loaded.fully_ln_free

    def bridge(self):
        """The model's TransformerLens bridge (built once): exact LN-free, or folded LN."""
        if self._bridge is None:
            self._bridge = self.loaded.bridge()
        return self._bridge


def default_label(source: str) -> str:
    """A short label for a model source: its folder name (or Hub repo name)."""
    path = Path(str(source).rstrip("/"))
    if path.name == "export" and path.parent.name:
        return path.parent.name
    return path.name or str(source)


def model_labels(sources: Sequence[str], labels: Sequence[str] | None = None) -> list[str]:
    """One unique label per source; by default the sources' folder names."""
    if labels is not None and len(labels) != len(sources):
        raise ValueError(f"{len(labels)} labels for {len(sources)} models")
    labels = list(labels) if labels else [default_label(s) for s in sources]
    if len(set(labels)) != len(labels):
        raise ValueError(f"model labels must be unique, got {labels}; pass labels explicitly")
    return labels


def load_models(
    sources: Sequence[str], labels: Sequence[str] | None = None, *, device: str = "cpu",
) -> list[AnalysisModel]:
    """Load every source with `lnfree.load` (fp32, on `device`); labels default to the sources' folder names."""
    labels = model_labels(sources, labels)
    from lnfree.evaluate import resolve_device

    target = resolve_device(device)
    models = []
    for label, source in zip(labels, sources):
        loaded = load(source)
        loaded.model.to(target)
        models.append(AnalysisModel(label, loaded))
    return models


def evaluation_tokens(
    tokenizer, *, source: str = "tiny", n_sequences: int = 32, length: int = 64, vocab_size: int | None = None,
    cache_dir: str | None = None,
) -> torch.Tensor:
    """The first `n_sequences` sequences of `length` tokens of a dataset (deterministic), as `lnfree eval` reads it.

    `source` is anything `lnfree eval --dataset` takes: "tiny" (the bundled model's held-out
    synthetic text), "owt-val", "pile", "pile-filtered", a Hub dataset id (streamed) or a local path.
    """
    from lnfree.evaluate import load_sequences, resolve_dataset

    sequences = load_sequences(resolve_dataset(source), tokenizer, context=length, n_sequences=n_sequences,
                               vocab_size=vocab_size or len(tokenizer), cache_dir=cache_dir)
    return torch.from_numpy(sequences)


def bootstrap_ci(
    values: np.ndarray | Sequence[float], *, statistic: Callable[[np.ndarray], float] = np.mean,
    n_resamples: int = 1000, seed: int = 0, level: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap CI of `statistic` over the first axis of `values` (resampling units, e.g. sequences)."""
    values = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    n = values.shape[0]
    if n == 0 or n_resamples < 1:
        return float("nan"), float("nan")
    stats = np.array([statistic(values[rng.integers(0, n, n)]) for _ in range(n_resamples)])
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


def write_figure(figure, out_dir: str | Path, name: str) -> list[Path]:
    """Write a plotly figure as HTML (always) and PNG (when a static exporter such as kaleido works)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    html = out_dir / f"{name}.html"
    figure.write_html(html, include_plotlyjs="cdn")
    written = [html]
    try:
        figure.write_image(out_dir / f"{name}.png")
        written.append(out_dir / f"{name}.png")
    except Exception:  # no static exporter (kaleido + a browser) on this machine: HTML only
        pass
    return written


def write_summary(summary: dict, out_dir: str | Path, name: str = "summary") -> Path:
    """Write a JSON summary (numbers, settings, seeds, file list)."""
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, default=str))
    return path
