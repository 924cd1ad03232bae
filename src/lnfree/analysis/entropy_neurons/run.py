"""Entropy (confidence-regulation) neurons: find them, mean-ablate them, compare models.

An *entropy neuron* is an MLP neuron (typically in the last layer) whose output weight ``w_out`` is
large but points into a direction the unembedding barely reads: its direct effect on the logits
is small, yet by changing the norm of the final residual stream it changes the final LayerNorm's
scale, and so the temperature (entropy) of the whole output distribution.  In an LN-free model the
final norm divides by a constant, so this mechanism cannot exist: ablating a last-layer neuron can
only act through its direct logit effect.

What this module computes
-------------------------
* **Candidates** (:func:`rank_candidates`): for every neuron of a layer (the last one by default),
  ``score = ‖w_out‖ / LogitVar`` with ``LogitVar = Var_v cos(w_out, W_U[:, v])`` (population
  variance over the vocabulary).  High score = large weight that treats all tokens alike.
* **Null-space fraction** (:func:`null_space_fraction`): the share of ``‖w_out‖²`` lying in the
  ``k`` bottom singular directions of ``W_U`` (smallest singular values).
* **Mean ablation** (:func:`mean_activations`, :func:`ablation_effects`): a neuron's activation
  (``blocks.L.mlp.hook_post``) is replaced by its mean over every token of the given data, singly and
  cumulatively (top-1, top-1+2, ...), in any layers; measured per token: the output entropy
  ``H`` (nats, every position) and the next-token cross-entropy ``CE`` (every position but the
  last), and their changes ``ΔH``, ``ΔCE``.  Ablations are batched: the clean run and every
  ablation set are stacked along the batch dimension (up to ``batch_tokens`` tokens per forward
  pass), each row with its own replacement, applied by one forward hook per layer.

Which weights
-------------
Everything is read from the model's TransformerLens bridge (:meth:`AnalysisModel.bridge`):

* LN models: the bridge is in compatibility mode, so ``W_U`` is the unembedding with ``ln_f``'s
  weight folded in (``diag(w_f) W_E^T``, centred over ``d_model`` by TL's ``fold_ln``) and
  ``W_out`` is centred (TL's ``center_writing_weights``).
* LN-free models: the exact folded bridge, ``W_U = C diag(w_f / σ_f) W_E^T`` (the fixed-scale
  ``ln_f``, including its centring ``C``, folded into an untied head).

Every LayerNorm, real or fixed-scale, centres its input, so the all-ones component of the
residual stream never reaches the logits.  We therefore centre ``w_out`` and ``W_U`` over
``d_model`` (a no-op for the bridges above, except ``W_out`` of LN-free models) and treat the
all-ones direction as a trivial null direction that is *excluded* from the singular directions:
"bottom-k" means the k smallest singular directions of ``W_U`` inside the centred subspace.
The ``1/σ_f`` scale of the LN-free ``W_U`` changes neither cosines nor singular directions.

Defaults
--------
The neurons ablated default to the known GPT-2 lists (:data:`KNOWN_ENTROPY_NEURONS`) when the model
has GPT-2 small's or medium's shape, otherwise to the ``top_k`` candidates of the reference model
(the first model, or ``reference=``).  The same neurons are ablated in every model, each model
using its own dataset-mean activations.

Reference numbers (GPT-2 small, paper P25: original / vanilla fine-tuned / LN-free)
-------------------------------------------------------------------------------------
* median per-token ``|ΔH|`` when mean-ablating 11.584: ≈0.052 / 0.012 / ≈0;
* cumulative ablation of the 3 known neurons, relative change of the mean output entropy:
  −2.5 % / −0.15 % / +0.03 %.

Modules
-------
This module runs the analysis (:func:`run`) and re-exports the public names of its parts:
``entropy_neurons_candidates`` (neuron identifiers, weights, scores, null space),
``entropy_neurons_ablation`` (mean activations, batched ablation), ``entropy_neurons_tables`` (the
tables and per-model summaries) and ``entropy_neurons_figures`` (the figures), all in
``lnfree.analysis``.

Notebook use::

    from lnfree.analysis.common import load_models, evaluation_tokens
    from lnfree.analysis.entropy_neurons import run as en
    models = load_models(["gpt2", "runs/gpt2/export"], ["original", "ln_free"])
    ranking = en.rank_candidates(models[0].bridge())            # DataFrame, best first
    tokens = evaluation_tokens(models[0].tokenizer, source="...", n_sequences=32, length=256)
    means = en.mean_activations(models[0].bridge(), tokens, [11])
    effects = en.ablation_effects(models[0].bridge(), tokens, [[(11, 584)]], means)
    effects.delta_entropy[0].abs().median()
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from lnfree.errors import UsageError
from lnfree.analysis.common import AnalysisModel, bridge_of, write_figure
from lnfree.analysis.entropy_neurons.ablation import (
    AblationEffects,
    AblationSets,
    _token_stats,  # noqa: F401 (re-exported for the tests)
    ablation_effects,
    ablation_sets,
    mean_activations,
)
from lnfree.analysis.entropy_neurons.candidates import (
    KNOWN_ENTROPY_NEURONS,
    Neuron,
    candidate_scores,
    centred,
    default_null_k,
    known_entropy_neurons,
    logit_variance,
    neuron_label,
    null_space_basis,
    null_space_fraction,
    output_weights,
    parse_neurons,
    rank_candidates,
    unembedding,
    unembedding_columns,
)
from lnfree.analysis.entropy_neurons.figures import figures
from lnfree.analysis.entropy_neurons.tables import TableRows, model_summary
from lnfree.forms.bridge import norm_centres
from lnfree.evaluate.results import TIMINGS, write_summary, write_table

__all__ = [
    "KNOWN_ENTROPY_NEURONS",
    "REFERENCE_GPT2_SMALL",
    "AblationEffects",
    "ablation_effects",
    "candidate_scores",
    "centred",
    "default_null_k",
    "known_entropy_neurons",
    "logit_variance",
    "mean_activations",
    "neuron_label",
    "null_space_basis",
    "null_space_fraction",
    "parse_neurons",
    "output_weights",
    "rank_candidates",
    "run",
    "select_neurons",
    "unembedding",
    "unembedding_columns",
]

#: Paper P25 numbers for GPT-2 small (original / vanilla fine-tuned / LN-free).
REFERENCE_GPT2_SMALL: dict[str, dict[str, float]] = {
    "median_abs_delta_entropy_11.584": {"original": 0.052, "vanilla": 0.012, "ln_free": 0.0},
    "cumulative_3_relative_entropy_change_percent": {"original": -2.5, "vanilla": -0.15, "ln_free": 0.03},
}


# ----------------------------------------------------------------------------------------------
# The analysis
# ----------------------------------------------------------------------------------------------


def _shape(model: AnalysisModel) -> tuple[int, int, int]:
    """``(n_layers, d_model, d_mlp)`` of a model, from its architecture (no bridge needed)."""
    arch = model.loaded.arch
    return arch.n_layers, arch.hidden, arch.intermediate


def select_neurons(
    shape: tuple[int, int, int], ranking: pd.DataFrame | None, *, layer: int | None = None,
    neurons: Sequence | None = None, top_k: int = 3,
) -> tuple[list[Neuron], str]:
    """The neurons :func:`run` ablates, and why: ``neurons`` if given, else the known GPT-2 list for
    a model of ``shape = (n_layers, d_model, d_mlp)`` (when ``layer`` is None or theirs), else the
    first ``top_k`` rows of ``ranking`` (a :func:`rank_candidates` table)."""
    n_layers, d_model, d_mlp = shape
    default_layer = n_layers - 1 if layer is None else layer
    if neurons is not None:
        return parse_neurons(neurons, default_layer), "given"
    known = known_entropy_neurons(n_layers, d_model, d_mlp)
    if known is not None and (layer is None or all(l == layer for l, _ in known)):
        return known, "known GPT-2 entropy neurons"
    if ranking is None:
        raise UsageError("no known entropy neurons for this shape: give a candidate ranking or neurons")
    top = ranking.head(top_k)
    return [(int(l), int(n)) for l, n in zip(top["layer"], top["neuron"])], f"top-{top_k} candidates"


@dataclass(frozen=True)
class _Plan:
    """What :func:`run` does in every model: the same tokens, neurons, ablations and settings."""

    tokens: torch.Tensor
    rank_layer: int
    null_k: int
    selected: list[Neuron]
    selection: str
    ablations: AblationSets
    token_sequences: np.ndarray  # the sequences kept in the per_token table
    top_k: int
    batch_tokens: int
    n_bootstrap: int
    seed: int


def run(
    models: list[AnalysisModel],
    out_dir: str | Path,
    *,
    tokens: torch.Tensor,
    layer: int | None = None,
    neurons: list[int] | list[str] | list[tuple[int, int]] | None = None,
    top_k: int = 3,
    seed: int = 0,
    reference: str | None = None,
    null_k: int | None = None,
    batch_tokens: int = 4096,
    n_bootstrap: int = 1000,
    max_token_rows: int | None = 1_000_000,
) -> dict:
    """Rank entropy-neuron candidates and mean-ablate the chosen neurons in every model.

    * Candidates are ranked in ``layer`` (default: the last) of every model.
    * Ablated neurons, the same in every model: ``neurons`` if given (ints are neurons of
      ``layer``/the last layer; ``"L.N"`` or ``(L, N)`` name any layer), else the known GPT-2
      small/medium lists for models of that shape (if ``layer`` is None or theirs), else the
      ``top_k`` candidates of the ``reference`` model (a label; default the first model).
    * Each neuron is ablated alone and cumulatively (the first 2, 3, ... of the list together;
      "top-1" is the first single ablation), with each model's own dataset-mean activations over
      ``tokens [batch, pos]``.  ``batch_tokens`` bounds the tokens per forward pass.
    * One model at a time: a model's bridge is built for its ranking and ablations and released
      after them (unless the caller had it built already), so one bridge is in memory at a time.

    Writes (tidy CSVs) ``candidates`` (every neuron of every model, ranked), ``null_space_spectrum``
    (selected neurons' share of ‖w_out‖² in the bottom-k directions, every k), ``ablations`` (one
    row per model and ablation: medians of |ΔH| and |ΔCE|, mean ΔH/ΔCE, relative entropy change,
    bootstrap CIs over sequences with ``seed``), ``distributions`` (quantiles of the per-token
    |ΔH|, |ΔCE|) and ``per_token`` (one row per model, ablation and token; if that exceeds
    ``max_token_rows``, only a seeded random subset of whole sequences, recorded in the summary);
    figures ``candidates``, ``ablation_distributions``, ``cumulative_entropy``,
    ``null_space_spectrum``; and ``summary.json``.  Returns the summary (``"tables"`` and
    ``"figures"`` list the written paths).
    """
    labels, reference = _check_models(models, reference)
    timings: dict[str, dict[str, float]] = {label: {} for label in labels}
    shape = _common_shape(models)
    rank_layer = shape[0] - 1 if layer is None else int(layer)
    null_k = default_null_k(shape[1]) if null_k is None else int(null_k)
    tokens = _check_tokens(tokens)
    ranked: dict[str, tuple[pd.DataFrame, tuple[torch.Tensor, torch.Tensor]]] = {}
    if models[0].label != reference:  # the reference's ranking chooses the neurons: rank it first
        model = models[labels.index(reference)]
        with _timed_bridge(model, shape, timings[reference]) as bridge:
            ranked[reference] = _rank(bridge, rank_layer, null_k, timings[reference])
    plan, rows, per_model = None, TableRows(), {}
    for model in models:  # one model (and one bridge) at a time
        with _timed_bridge(model, shape, timings[model.label]) as bridge:
            if model.label not in ranked:
                ranked[model.label] = _rank(bridge, rank_layer, null_k, timings[model.label])
            if plan is None:
                selected, selection = _selected_neurons(shape, ranked[reference][0], reference, layer=layer,
                                                        neurons=neurons, top_k=top_k)
                ablations = ablation_sets(selected)
                plan = _Plan(tokens, rank_layer, null_k, selected, selection, ablations, _per_token_sequences(
                    tokens.shape, len(models) * len(ablations.sets), max_token_rows, seed), top_k, batch_tokens,
                    n_bootstrap, seed)
            per_model[model.label] = _analyse_model(model, bridge, *ranked[model.label], plan, rows,
                                                    timings[model.label])

    out_dir = Path(out_dir)
    tables = rows.tables()
    table_paths = [str(write_table(table, out_dir, name)) for name, table in tables.items()]
    figure_paths = [str(path) for name, figure in figures(tables, plan.ablations.names).items()
                    for path in write_figure(figure, out_dir, name)]
    summary = _summary(labels, reference, plan, per_model, table_paths, figure_paths)
    write_summary(summary, out_dir)
    write_summary({"seconds": timings}, out_dir, TIMINGS)
    return summary


def _check_models(models: list[AnalysisModel], reference: str | None) -> tuple[list[str], str]:
    """The models' labels, and the reference model's label (default: the first model's)."""
    if not models:
        raise UsageError("no models given")
    labels = [m.label for m in models]
    reference = labels[0] if reference is None else reference
    if reference not in labels:
        raise UsageError(f"reference {reference!r} is not one of {labels}")
    return labels, reference


def _common_shape(models: list[AnalysisModel]) -> tuple[int, int, int]:
    """The models' common shape ``(n_layers, d_model, d_mlp)``; an error if they differ."""
    shapes = {_shape(m) for m in models}
    if len(shapes) != 1:
        raise UsageError(f"models differ in shape (n_layers, d_model, d_mlp): {sorted(shapes)}")
    return shapes.pop()


@contextlib.contextmanager
def _timed_bridge(model: AnalysisModel, shape: tuple[int, int, int], timings: dict[str, float]) -> Iterator[Any]:
    """``model``'s bridge (`bridge_of`: released afterwards), its build time in ``timings["bridge_s"]``."""
    t0 = time.perf_counter()
    with bridge_of(model) as bridge:
        timings["bridge_s"] = time.perf_counter() - t0
        cfg = bridge.cfg
        if (int(cfg.n_layers), int(cfg.d_model), int(cfg.d_mlp)) != shape:  # pragma: no cover - TL vs lnfree.arch
            raise RuntimeError(f"the bridge of {model.label} has another shape than its architecture says {shape}")
        yield bridge


def _check_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` as a long tensor ``[batch, pos]`` with at least 2 positions."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise UsageError(f"tokens must be [batch, pos] with pos >= 2, got {tuple(tokens.shape)}")
    return tokens


def _rank(bridge: Any, rank_layer: int, null_k: int,
          timings: dict[str, float]) -> tuple[pd.DataFrame, tuple[torch.Tensor, torch.Tensor]]:
    """A model's candidate ranking in ``rank_layer`` and its :func:`null_space_basis` (timed)."""
    t0 = time.perf_counter()
    basis = null_space_basis(unembedding_columns(bridge), centre=norm_centres(bridge))
    ranking = rank_candidates(bridge, rank_layer, null_k=null_k, basis=basis[0])
    timings["ranking_s"] = time.perf_counter() - t0
    return ranking, basis


def _selected_neurons(
    shape: tuple[int, int, int], ranking: pd.DataFrame, reference: str, *, layer: int | None, neurons: Sequence | None,
    top_k: int,
) -> tuple[list[Neuron], str]:
    """:func:`select_neurons` with the reference model's ``ranking``, checking that every neuron exists."""
    n_layers, _, d_mlp = shape
    selected, selection = select_neurons(shape, ranking, layer=layer, neurons=neurons, top_k=top_k)
    if selection == f"top-{top_k} candidates":
        selection += f" of {reference}"
    for lay, neu in selected:
        if not (0 <= lay < n_layers and 0 <= neu < d_mlp):
            raise UsageError(f"no neuron {neuron_label((lay, neu))} in a {n_layers}-layer model with d_mlp={d_mlp}")
    return selected, selection


def _per_token_sequences(shape: tuple[int, int], n_tables: int, max_token_rows: int | None, seed: int) -> np.ndarray:
    """The sequences of ``tokens`` (of ``shape``) whose tokens go into ``per_token``: all of them, unless the
    rows (``n_tables`` = models × ablation sets) would exceed ``max_token_rows``; then a seeded random
    subset of whole sequences that fits."""
    n_seq, n_pos = shape
    if max_token_rows is None or n_tables * n_seq * n_pos <= max_token_rows:
        return np.arange(n_seq)
    keep = max(1, max_token_rows // (n_tables * n_pos))
    return np.sort(np.random.default_rng(seed).choice(n_seq, size=keep, replace=False))


def _analyse_model(model: AnalysisModel, bridge: Any, ranking: pd.DataFrame,
                   basis: tuple[torch.Tensor, torch.Tensor], plan: _Plan, rows: TableRows,
                   timings: dict[str, float]) -> dict:
    """Add one model's rows to ``rows`` (its candidates and spectra, then its mean ablations, timed);
    return its ``per_model`` summary entry."""
    rows.add_candidates(model.label, ranking, plan.selected)
    rows.add_spectra(model.label, bridge, plan.selected, *basis)
    t0 = time.perf_counter()
    means = mean_activations(bridge, plan.tokens, sorted({l for l, _ in plan.selected}), batch_tokens=plan.batch_tokens)
    effects = ablation_effects(bridge, plan.tokens, plan.ablations.sets, means, batch_tokens=plan.batch_tokens)
    timings["ablation_s"] = time.perf_counter() - t0
    ablations = rows.add_ablations(model.label, effects, means, plan.ablations, plan.token_sequences,
                                   n_bootstrap=plan.n_bootstrap, seed=plan.seed)
    return model_summary(model, ranking, plan.selected, plan.rank_layer, plan.top_k, ablations)


def _summary(labels: list[str], reference: str, plan: _Plan, per_model: dict, table_paths: list[str],
             figure_paths: list[str]) -> dict:
    """The contents of ``summary.json``."""
    n_seq, n_pos = plan.tokens.shape
    return {
        "analysis": "entropy_neurons",
        "models": labels,
        "reference": reference,
        "rank_layer": plan.rank_layer,
        "selection": plan.selection,
        "neurons": [neuron_label(n) for n in plan.selected],
        "ablations": {name: [neuron_label(n) for n in s] for name, s in zip(plan.ablations.names, plan.ablations.sets)},
        "tokens": {"n_sequences": n_seq, "length": n_pos},
        "per_token_sequences": "all" if len(plan.token_sequences) == n_seq else plan.token_sequences.tolist(),
        "null_k": plan.null_k,
        "seed": plan.seed,
        "n_bootstrap": plan.n_bootstrap,
        "units": "nats; entropy at every position, CE of the next token (positions 0..pos-2)",
        "per_model": per_model,
        "reference_numbers_gpt2_small_p25": REFERENCE_GPT2_SMALL,
        "tables": table_paths,
        "figures": figure_paths,
    }
