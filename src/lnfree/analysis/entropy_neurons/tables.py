"""The tables and per-model summary entries :func:`lnfree.analysis.entropy_neurons.run.run` writes.

:class:`TableRows` gathers the rows model by model: ``candidates`` (every neuron, ranked),
``null_space_spectrum`` (the selected neurons' share of ‖w_out‖² in the bottom-k directions),
``ablations`` (one row per model and ablation, with bootstrap CIs over sequences), ``distributions``
(quantiles of the per-token |ΔH|, |ΔCE|) and ``per_token``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from lnfree.analysis.common import AnalysisModel
from lnfree.analysis.entropy_neurons.ablation import AblationEffects, AblationSets
from lnfree.analysis.entropy_neurons.candidates import Neuron, neuron_label, null_space_spectrum, output_weights
from lnfree.evaluate.results import bootstrap_ci, ratio_of_means_ci

def _ablation_stats(dh: np.ndarray, dce: np.ndarray, clean_h: np.ndarray, n_bootstrap: int, seed: int) -> dict:
    """Statistics of one ablation; ``dh``/``clean_h`` are [n_seq, n_pos], ``dce`` [n_seq, n_pos-1].

    CIs are percentile bootstraps over sequences (medians resample whole sequences; means use the
    per-sequence means, equivalent for equal-length sequences).
    """
    row = {
        "median_abs_delta_entropy": float(np.median(np.abs(dh))),
        "median_abs_delta_ce": float(np.median(np.abs(dce))),
        "mean_abs_delta_entropy": float(np.mean(np.abs(dh))),
        "mean_abs_delta_ce": float(np.mean(np.abs(dce))),
        "mean_delta_entropy": float(np.mean(dh)),
        "mean_delta_ce": float(np.mean(dce)),
        "relative_entropy_change_percent": 100.0 * float(dh.sum() / clean_h.sum()),
    }
    if n_bootstrap > 0:
        boot = {"n_resamples": n_bootstrap, "seed": seed}
        row["median_abs_delta_entropy_lo"], row["median_abs_delta_entropy_hi"] = bootstrap_ci(
            np.abs(dh), statistic=np.median, **boot)
        row["median_abs_delta_ce_lo"], row["median_abs_delta_ce_hi"] = bootstrap_ci(
            np.abs(dce), statistic=np.median, **boot)
        row["mean_delta_entropy_lo"], row["mean_delta_entropy_hi"] = bootstrap_ci(dh.mean(axis=1), **boot)
        row["mean_delta_ce_lo"], row["mean_delta_ce_hi"] = bootstrap_ci(dce.mean(axis=1), **boot)
        lo, hi = ratio_of_means_ci(dh.sum(axis=1), clean_h.sum(axis=1), **boot)
        row["relative_entropy_change_percent_lo"], row["relative_entropy_change_percent_hi"] = 100 * lo, 100 * hi
    return row


_QUANTILES = {"q05": 0.05, "q25": 0.25, "median": 0.5, "q75": 0.75, "q95": 0.95}


def _distribution_rows(model: str, name: str, dh: np.ndarray, dce: np.ndarray) -> list[dict]:
    rows = []
    for metric, values in (("abs_delta_entropy", np.abs(dh).ravel()), ("abs_delta_ce", np.abs(dce).ravel())):
        qs = np.quantile(values, list(_QUANTILES.values()))
        rows.append({"model": model, "ablation": name, "metric": metric, "count": values.size,
                     "min": float(values.min()), **{k: float(q) for k, q in zip(_QUANTILES, qs)},
                     "max": float(values.max()), "mean": float(values.mean())})
    return rows


def _token_frame(key: dict, sequences: np.ndarray, clean_h: np.ndarray, clean_ce: np.ndarray, dh: np.ndarray,
                 dce: np.ndarray) -> pd.DataFrame:
    """``per_token`` rows of one ablation (``key``: its model, name, kind, size) for the kept ``sequences``,
    every position; CE (of the next token) is NaN at the last position."""
    seq_grid, pos_grid = np.meshgrid(sequences, np.arange(clean_h.shape[1]), indexing="ij")
    pad = np.full((len(sequences), 1), np.nan)
    ce_padded = np.concatenate([clean_ce[sequences], pad], axis=1)
    dce_padded = np.concatenate([dce[sequences], pad], axis=1)
    return pd.DataFrame({
        **key,
        "sequence": seq_grid.ravel(), "position": pos_grid.ravel(),
        "entropy": clean_h[sequences].ravel(), "delta_entropy": dh[sequences].ravel(),
        "abs_delta_entropy": np.abs(dh[sequences]).ravel(),
        "ce": ce_padded.ravel(), "delta_ce": dce_padded.ravel(), "abs_delta_ce": np.abs(dce_padded).ravel(),
    })


@dataclass
class TableRows:
    """The rows of every table, added model by model (in the order they are written)."""

    candidates: list[pd.DataFrame] = field(default_factory=list)
    null_space_spectrum: list[pd.DataFrame] = field(default_factory=list)
    ablations: list[dict] = field(default_factory=list)
    distributions: list[dict] = field(default_factory=list)
    per_token: list[pd.DataFrame] = field(default_factory=list)

    def add_candidates(self, label: str, ranking: pd.DataFrame, selected: list[Neuron]) -> None:
        """Add a model's :func:`rank_candidates` table, marking the ``selected`` (ablated) neurons."""
        ranking = ranking.copy()
        ranking.insert(0, "model", label)
        chosen = set(selected)
        ranking["selected"] = [(int(l), int(n)) in chosen for l, n in zip(ranking["layer"], ranking["neuron"])]
        self.candidates.append(ranking)

    def add_spectra(self, label: str, bridge: Any, selected: list[Neuron], basis: torch.Tensor,
                    singular: torch.Tensor) -> None:
        """Add the cumulative share of each ``selected`` neuron's ‖w_out‖² in the bottom-k directions
        (``basis``, ``singular``: the model's :func:`null_space_basis`), for every k."""
        weights: dict[int, torch.Tensor] = {}
        for lay, neu in selected:
            if lay not in weights:
                weights[lay] = output_weights(bridge, lay)
            share = null_space_spectrum(weights[lay][neu], basis)[0]
            self.null_space_spectrum.append(pd.DataFrame({
                "model": label, "neuron": neuron_label((lay, neu)), "k": np.arange(1, len(share) + 1),
                "singular_value": singular.numpy(), "cumulative_share": share,
            }))

    def add_ablations(self, label: str, effects: AblationEffects, means: dict[int, torch.Tensor],
                      ablations: AblationSets, sequences: np.ndarray, *, n_bootstrap: int, seed: int) -> dict:
        """Add a model's ``per_token`` (kept ``sequences`` only), ``ablations`` and ``distributions`` rows;
        return its ablations as the summary lists them (``{name: row without model and ablation}``)."""
        clean_h = effects.entropy.numpy()
        clean_ce = effects.ce.numpy()
        summary = {}
        for i, (name, kind, neuron_set) in enumerate(zip(ablations.names, ablations.kinds, ablations.sets)):
            dh = effects.delta_entropy[i].numpy()
            dce = effects.delta_ce[i].numpy()
            key = {"model": label, "ablation": name, "kind": kind, "n_neurons": len(neuron_set)}
            self.per_token.append(_token_frame(key, sequences, clean_h, clean_ce, dh, dce))
            row = {
                **key,
                "neurons": " ".join(neuron_label(n) for n in neuron_set),
                "mean_activation": " ".join(f"{float(means[l][n]):.6g}" for l, n in neuron_set),
                **_ablation_stats(dh, dce, clean_h, n_bootstrap, seed),
                "clean_mean_entropy": float(clean_h.mean()), "clean_mean_ce": float(clean_ce.mean()),
            }
            self.ablations.append(row)
            self.distributions.extend(_distribution_rows(label, name, dh, dce))
            summary[name] = {k: v for k, v in row.items() if k not in ("model", "ablation")}
        return summary

    def tables(self) -> dict[str, pd.DataFrame]:
        """The tables, by file name, in the order :func:`run` writes them."""
        return {
            "candidates": pd.concat(self.candidates, ignore_index=True),
            "null_space_spectrum": pd.concat(self.null_space_spectrum, ignore_index=True),
            "ablations": pd.DataFrame(self.ablations),
            "distributions": pd.DataFrame(self.distributions),
            "per_token": pd.concat(self.per_token, ignore_index=True),
        }


def _unembedding_description(model: AnalysisModel) -> str:
    fixed = [n["fixed"] for n in model.loaded.norms.values()]
    if all(fixed):
        return "LN-free: folded unembedding C·diag(w_f/σ_f)·W_Eᵀ (exact bridge)"
    if not any(fixed):
        return "LN: compatibility-mode unembedding diag(w_f)·W_Eᵀ, centred (TL fold_ln)"
    return "partially LN-free: lm_head with the final norm's weight folded in, centred"



def model_summary(model: AnalysisModel, ranking: pd.DataFrame, selected: list[Neuron], rank_layer: int, top_k: int,
                  ablations: dict) -> dict:
    """A model's entry in the summary's ``per_model``: its ``W_U``, its top candidates, the selected
    neurons' standing in its ``ranking`` (those in ``rank_layer`` only) and its ``ablations``."""
    by_neuron = ranking.set_index("neuron")
    return {
        "ln_free": bool(model.ln_free),
        "W_U": _unembedding_description(model),
        "top_candidates": [
            {"neuron": neuron_label((int(r.layer), int(r.neuron))), "score": float(r.score),
             "w_out_norm": float(r.w_out_norm), "logit_var": float(r.logit_var),
             "null_space_fraction": float(r.null_space_fraction)}
            for r in ranking.head(max(top_k, 1)).itertuples()
        ],
        "selected": {  # the ablated neurons' standing in this model's ranking (rank_layer only)
            neuron_label(n): {"rank": int(by_neuron.at[n[1], "rank"]), "score": float(by_neuron.at[n[1], "score"]),
                              "null_space_fraction": float(by_neuron.at[n[1], "null_space_fraction"])}
            for n in selected if n[0] == rank_layer
        },
        "ablations": ablations,
    }
