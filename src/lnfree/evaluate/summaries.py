"""Summaries of per-token scores: distributions with bootstrap CIs, by position, outliers, pairs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lnfree.evaluate.models import EvalModel
from lnfree.evaluate.scoring import TokenScores
from lnfree.evaluate.results import bootstrap_ci

#: Per-token CE (nats) above which a token is listed as an outlier. P25 (App. E) lists GPT-2 XL
#: LN-free's Pile tokens above 50; the original model's p99.9 there is 43.
DEFAULT_THRESHOLD = 50.0
ECE_BINS = 10


@dataclass
class Distribution:
    """A per-token quantity over all scored tokens: mean (bootstrap CI over sequences) and percentiles."""

    mean: float
    mean_ci: tuple[float, float]
    median: float
    p95: float
    p99: float
    p99_9: float
    max: float
    std: float


def distribution(values: torch.Tensor, *, n_resamples: int = 1000, seed: int = 0, block: int = 1) -> Distribution:
    """Summarise (N, L−1) per-token values; the CI resamples sequences (rows), in blocks of `block`
    neighbouring sequences (`lnfree.evaluate.results.bootstrap_ci`)."""
    flat = values.double().flatten().numpy()
    median, p95, p99, p999 = np.percentile(flat, [50, 95, 99, 99.9])
    per_sequence = values.double().mean(dim=1).numpy()  # equal token counts: mean of means = mean
    ci = bootstrap_ci(per_sequence, n_resamples=n_resamples, seed=seed, block=block)
    return Distribution(float(flat.mean()), ci, float(median), float(p95), float(p99), float(p999),
                        float(flat.max()), float(flat.std()))


def calibration_bins(confidence: torch.Tensor, correct: torch.Tensor, n_bins: int = ECE_BINS) -> np.ndarray:
    """Per sequence and confidence bin: [count, Σ(correct − confidence)], shape (N, n_bins, 2).

    Bins are equal-width on [0, 1] (a confidence of 1 falls in the last bin).
    """
    index = (confidence * n_bins).long().clamp(0, n_bins - 1)
    counts = torch.zeros(confidence.shape[0], n_bins, dtype=torch.float64)
    gaps = torch.zeros_like(counts)
    counts.scatter_add_(1, index, torch.ones_like(confidence, dtype=torch.float64))
    gaps.scatter_add_(1, index, correct.double() - confidence.double())
    return torch.stack([counts, gaps], dim=-1).numpy()


def ece_from_bins(bins: np.ndarray) -> float:
    """ECE = Σ_b (n_b/N)·|accuracy_b − confidence_b| from `calibration_bins` (summed over sequences)."""
    total = bins.sum(axis=0)
    return float(np.abs(total[:, 1]).sum() / total[:, 0].sum())


def expected_calibration_error(confidence: torch.Tensor, correct: torch.Tensor, n_bins: int = ECE_BINS) -> float:
    """Expected calibration error of top-1 predictions with `n_bins` equal-width bins."""
    confidence = confidence.reshape(confidence.shape[0], -1)
    return ece_from_bins(calibration_bins(confidence, correct.reshape(confidence.shape), n_bins))


def position_edges(length: int) -> list[int]:
    """Context-length bin edges 1, 2, 4, 8, … , L: bin [lo, hi) holds targets at positions lo…hi−1."""
    edges = [1]
    while edges[-1] * 2 < length:
        edges.append(edges[-1] * 2)
    return edges + [length]


def by_position(scores: TokenScores) -> list[dict]:
    """Mean CE and entropy per context-position bin (position = tokens seen before the target)."""
    length = scores.ce.shape[1] + 1
    edges = position_edges(length)
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        ce, entropy = scores.ce[:, lo - 1:hi - 1].double(), scores.entropy[:, lo - 1:hi - 1].double()
        rows.append({"positions": str(lo) if hi - 1 == lo else f"{lo}-{hi - 1}", "first": lo, "last": hi - 1, "tokens": ce.numel(),
                     "mean_ce": float(ce.mean()), "mean_entropy": float(entropy.mean())})
    return rows


@dataclass
class Outlier:
    """A token whose CE exceeds the threshold, with the text before it."""

    sequence: int
    position: int  # of the target token in its sequence (≥ 1)
    token_id: int
    token: str
    context: str  # the tokens before the target (the last `context_tokens`), decoded
    ce: float
    predicted_id: int
    predicted: str
    other_models_ce: dict[str, float] = field(default_factory=dict)


def outliers(
    scores: TokenScores, tokens: torch.Tensor, tokenizer, threshold: float, *, limit: int = 50, context_tokens: int = 16,
) -> tuple[int, list[Outlier]]:
    """(count of tokens with CE > threshold, the `limit` highest of them with their context)."""
    above = scores.ce > threshold
    count = int(above.sum())
    if count == 0 or limit <= 0:
        return count, []
    flat = scores.ce.flatten()
    values, order = flat.topk(min(limit, count))
    width = scores.ce.shape[1]
    found = []
    for value, index in zip(values.tolist(), order.tolist()):
        seq, pos = divmod(index, width)
        pos += 1
        target = int(tokens[seq, pos])
        predicted = int(scores.top1[seq, pos - 1])
        before = tokens[seq, max(0, pos - context_tokens):pos].tolist()
        found.append(Outlier(seq, pos, target, tokenizer.decode([target]), tokenizer.decode(before), value,
                             predicted, tokenizer.decode([predicted])))
    return count, found


@dataclass
class ModelResult:
    """Everything measured for one model (JSON-ready)."""

    label: str
    source: str
    kind: str  # how the model was stored (`LoadedModel.stored_as`), under the JSON key of earlier results
    form: str
    dtype: str
    fully_ln_free: bool | None
    sequences: int
    context: int
    scored_tokens: int
    ce: Distribution
    threshold: float
    tokens_above_threshold: int
    sequences_with_outliers: int
    mean_ce_at_or_below_threshold: float
    entropy: Distribution
    top1_accuracy: float
    ece: float
    ece_ci: tuple[float, float]
    by_position: list[dict]
    outliers: list[Outlier]
    reference: str | None = None
    delta_ce_vs_reference: float | None = None
    delta_ce_vs_reference_ci: tuple[float, float] | None = None
    benchmarks: dict[str, Any] = field(default_factory=dict)


@dataclass
class PairResult:
    """Two models on identical tokens: per-token JSD and the paired CE difference (b − a)."""

    a: str
    b: str
    scored_tokens: int
    jsd: Distribution
    delta_ce: float
    delta_ce_ci: tuple[float, float]


def paired_delta(ce_a: torch.Tensor, ce_b: torch.Tensor, *, n_resamples: int, seed: int,
                 block: int = 1) -> tuple[float, tuple]:
    """Mean of ce_b − ce_a and its bootstrap CI over sequences, in blocks of `block` (paired: same tokens)."""
    per_sequence = (ce_b.double() - ce_a.double()).mean(dim=1).numpy()
    return float(per_sequence.mean()), bootstrap_ci(per_sequence, n_resamples=n_resamples, seed=seed, block=block)


def summarise_model(
    model: EvalModel, scores: TokenScores, tokens: torch.Tensor, *, threshold: float, n_resamples: int, seed: int,
    max_outliers: int, block: int = 1,
) -> ModelResult:
    """Distribution, outliers, entropy, calibration and position bins of one model's scores."""
    n, width = scores.ce.shape
    correct = scores.top1 == tokens[:, 1:]
    bins = calibration_bins(scores.confidence, correct)
    boot = {"n_resamples": n_resamples, "seed": seed, "block": block}
    ece_ci = bootstrap_ci(bins, statistic=ece_from_bins, **boot)
    count, listed = outliers(scores, tokens, model.tokenizer, threshold, limit=max_outliers)
    below = scores.ce[scores.ce <= threshold].double()
    return ModelResult(
        label=model.label, source=model.source, kind=model.stored_as, form=model.form, dtype=model.dtype,
        fully_ln_free=model.fully_ln_free, sequences=n, context=width + 1, scored_tokens=n * width,
        ce=distribution(scores.ce, **boot), threshold=threshold,
        tokens_above_threshold=count, sequences_with_outliers=int((scores.ce > threshold).any(dim=1).sum()),
        mean_ce_at_or_below_threshold=float(below.mean()) if below.numel() else float("nan"),
        entropy=distribution(scores.entropy, **boot),
        top1_accuracy=float(correct.double().mean()), ece=ece_from_bins(bins), ece_ci=ece_ci,
        by_position=by_position(scores), outliers=listed,
    )


def sequence_table(scores: TokenScores, threshold: float):
    """One row per sequence: mean/median/max CE, tokens above the threshold, mean entropy (pandas)."""
    import pandas as pd

    ce = scores.ce.double()
    return pd.DataFrame({
        "sequence": np.arange(ce.shape[0]), "scored_tokens": ce.shape[1],
        "mean_ce": ce.mean(dim=1).numpy(), "median_ce": np.median(ce.numpy(), axis=1),
        "max_ce": ce.max(dim=1).values.numpy(), "tokens_above_threshold": (ce > threshold).sum(dim=1).numpy(),
        "mean_entropy": scores.entropy.double().mean(dim=1).numpy(),
    })
