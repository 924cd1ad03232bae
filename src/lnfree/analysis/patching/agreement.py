"""How well attribution patching agrees with activation patching: NMAE and Pearson r per prompt and
pooled, with bootstrap CIs that resample partner pairs (see :mod:`lnfree.analysis.patching.run`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lnfree.evaluate.results import bootstrap_ci, ratio_of_means_ci

__all__ = ["agreement_per_prompt", "agreement_summary"]


def agreement_per_prompt(
    activation: torch.Tensor | np.ndarray, attribution: torch.Tensor | np.ndarray,
    mask: torch.Tensor | np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt (first axis): NMAE ``sum|act - attr| / sum|act|`` and Pearson r over the cells in ``mask``.

    A prompt with no activation effect gets NMAE nan; one with fewer than two cells or a constant
    grid gets r nan.
    """
    act = np.asarray(activation, np.float64).reshape(len(activation), -1)
    att = np.asarray(attribution, np.float64).reshape(len(attribution), -1)
    keep = np.ones_like(act, bool) if mask is None else np.asarray(mask, bool).reshape(len(act), -1)
    nmae = np.full(len(act), np.nan)
    r = np.full(len(act), np.nan)
    for i in range(len(act)):
        a, b = act[i, keep[i]], att[i, keep[i]]
        den = np.abs(a).sum()
        if den > 0:
            nmae[i] = np.abs(a - b).sum() / den
        if a.size >= 2 and a.std() > 0 and b.std() > 0:
            r[i] = float(np.corrcoef(a, b)[0, 1])
    return nmae, r


def _pearson_from_sums(s: np.ndarray) -> float:
    n, sa, sb, saa, sbb, sab = s.sum(0)
    cov = sab / n - (sa / n) * (sb / n)
    var_a, var_b = saa / n - (sa / n) ** 2, sbb / n - (sb / n) ** 2
    return float(cov / math.sqrt(var_a * var_b)) if var_a > 0 and var_b > 0 else float("nan")


def agreement_summary(
    activation: torch.Tensor, attribution: torch.Tensor, mask: torch.Tensor | None = None,
    units: Sequence[int] | None = None, *, n_bootstrap: int = 1000, seed: int = 0,
) -> dict[str, Any]:
    """NMAE and Pearson r of attribution vs activation patching, with percentile bootstrap CIs.

    ``units`` (one id per prompt, e.g. the partner pair) are resampled together; default: each
    prompt is its own unit. Returns ``nmae`` (ratio of sums over prompts x cells), ``nmae_per_prompt``
    (mean of per-prompt NMAE), ``pearson_r`` (mean of per-prompt r), ``pearson_r_pooled`` (all cells
    of all prompts) and ``pearson_r_mean_map`` (between the prompt-averaged grids; no CI), each
    as ``{"value", "ci_low", "ci_high"}``, plus ``n_prompts``, ``n_units`` and ``n_cells``.
    """
    act = np.asarray(activation, np.float64).reshape(len(activation), -1)
    att = np.asarray(attribution, np.float64).reshape(len(attribution), -1)
    keep = np.ones_like(act, bool) if mask is None else np.asarray(mask, bool).reshape(len(act), -1)
    nmae_p, r_p = agreement_per_prompt(act, att, keep)
    units = np.arange(len(act)) if units is None else np.asarray(units)
    ids = list(dict.fromkeys(units.tolist()))
    a0, b0 = np.where(keep, act, 0.0), np.where(keep, att, 0.0)
    per_unit = []
    for u in ids:
        sel = units == u
        a, b, k = a0[sel], b0[sel], keep[sel]
        per_unit.append([
            np.abs(a - b).sum(), np.abs(a).sum(),  # NMAE numerator / denominator
            np.nanmean(nmae_p[sel]) if np.isfinite(nmae_p[sel]).any() else np.nan,
            np.nanmean(r_p[sel]) if np.isfinite(r_p[sel]).any() else np.nan,
            k.sum(), a.sum(), b.sum(), (a * a).sum(), (b * b).sum(), (a * b).sum(),
        ])  # fmt: skip
    per_unit = np.array(per_unit)
    boot = {"n_resamples": n_bootstrap, "seed": seed}
    nan_ci = (float("nan"), float("nan"))

    def entry(value: float, ci: tuple[float, float]) -> dict[str, float]:
        return {"value": float(value), "ci_low": ci[0], "ci_high": ci[1]}

    finite = lambda col: per_unit[np.isfinite(per_unit[:, col]), col]  # noqa: E731
    return {
        "nmae": entry(per_unit[:, 0].sum() / per_unit[:, 1].sum(),
                      ratio_of_means_ci(per_unit[:, 0], per_unit[:, 1], **boot)),
        "nmae_per_prompt": entry(np.nanmean(nmae_p), bootstrap_ci(finite(2), **boot)),
        "pearson_r": entry(np.nanmean(r_p), bootstrap_ci(finite(3), **boot)),
        "pearson_r_pooled": entry(_pearson_from_sums(per_unit[:, 4:]),
                                  bootstrap_ci(per_unit[:, 4:], statistic=_pearson_from_sums, **boot)),
        "pearson_r_mean_map": entry(_mean_map_r(act, att, keep), nan_ci),
        "n_prompts": int(len(act)),
        "n_units": int(len(ids)),
        "n_cells": int(keep.sum()),
    }  # fmt: skip


def _mean_map_r(act: np.ndarray, att: np.ndarray, keep: np.ndarray) -> float:
    cells = keep.any(0)
    a, b = act.mean(0)[cells], att.mean(0)[cells]
    if a.size < 2 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])
