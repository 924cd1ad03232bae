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

Notebook use::

    from lnfree.analysis.common import load_models, evaluation_tokens
    from lnfree.analysis import entropy_neurons as en
    models = load_models(["gpt2", "runs/gpt2/export"], ["original", "ln_free"])
    ranking = en.rank_candidates(models[0].bridge())            # DataFrame, best first
    tokens = evaluation_tokens(models[0].tokenizer, source="...", n_sequences=32, length=256)
    means = en.mean_activations(models[0].bridge(), tokens, [11])
    effects = en.ablation_effects(models[0].bridge(), tokens, [[(11, 584)]], means)
    effects.delta_entropy[0].abs().median()
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from lnfree.analysis.common import AnalysisModel, write_figure
from lnfree.results import TIMINGS, bootstrap_ci, ratio_of_means_ci, write_summary, write_table
from lnfree.bridge import hook_name, norm_centres, norm_weight
from lnfree.evaluate import token_statistics

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
]

Neuron = tuple[int, int]  # (layer, neuron index)

#: Known entropy neurons (layer, neuron), keyed by (n_layer, d_model) of the GPT-2 shape they belong to.
KNOWN_ENTROPY_NEURONS: dict[tuple[int, int], list[Neuron]] = {
    (12, 768): [(11, 584), (11, 2123), (11, 2870)],  # GPT-2 small
    (24, 1024): [(23, 3144), (23, 1083), (23, 1108)],  # GPT-2 medium
}

#: Paper P25 numbers for GPT-2 small (original / vanilla fine-tuned / LN-free).
REFERENCE_GPT2_SMALL: dict[str, dict[str, float]] = {
    "median_abs_delta_entropy_11.584": {"original": 0.052, "vanilla": 0.012, "ln_free": 0.0},
    "cumulative_3_relative_entropy_change_percent": {"original": -2.5, "vanilla": -0.15, "ln_free": 0.03},
}

_EPS = 1e-30


# ----------------------------------------------------------------------------------------------
# Neuron identifiers and defaults
# ----------------------------------------------------------------------------------------------


def neuron_label(neuron: Neuron) -> str:
    """``(11, 584)`` -> ``"11.584"`` (the usual layer.neuron notation)."""
    return f"{neuron[0]}.{neuron[1]}"


def parse_neurons(neurons: Sequence[int | str | Sequence[int]], layer: int) -> list[Neuron]:
    """Neuron specs -> ``[(layer, neuron)]``: ints are neurons of ``layer``; ``"L.N"`` strings and
    ``(L, N)`` pairs name their own layer."""
    out: list[Neuron] = []
    for spec in neurons:
        if isinstance(spec, (int, np.integer)):
            out.append((int(layer), int(spec)))
        elif isinstance(spec, str):
            if "." in spec:
                left, right = spec.split(".", 1)
                out.append((int(left), int(right)))
            else:
                out.append((int(layer), int(spec)))
        else:
            left, right = spec
            out.append((int(left), int(right)))
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate neurons in {neurons}")
    return out


def known_entropy_neurons(n_layers: int, d_model: int, d_mlp: int | None = None) -> list[Neuron] | None:
    """The published entropy neurons for a GPT-2 small/medium-shaped model, else None."""
    known = KNOWN_ENTROPY_NEURONS.get((int(n_layers), int(d_model)))
    if known is None or (d_mlp is not None and any(n >= d_mlp for _, n in known)):
        return None
    return list(known)


def default_null_k(d_model: int) -> int:
    """Default number of bottom singular directions: ``max(1, d_model // 64)`` (12 for GPT-2 small)."""
    return max(1, int(d_model) // 64)


# ----------------------------------------------------------------------------------------------
# Weights and pure scores
# ----------------------------------------------------------------------------------------------


def centred(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x`` minus its mean along ``dim`` (the component any LayerNorm, real or fixed, lets through)."""
    return x - x.mean(dim=dim, keepdim=True)


def unembedding(bridge: Any) -> torch.Tensor:
    """``W_U [d_model, d_vocab]`` as the bridge applies it (see the module docstring), centred over
    ``d_model``, float64.

    A weight still held by the bridge's final norm (a partially LN-free model's own ``ln_f``) is
    folded in; after ``fold_ln`` (LN models) it is all ones, and LN-free bridges have none.
    """
    W_U = bridge.W_U.detach().to(torch.float64).cpu()
    norm = getattr(getattr(bridge, "ln_final", None), "original_component", None)
    weight = norm_weight(bridge, norm) if norm is not None else None
    if isinstance(weight, torch.Tensor) and weight.shape == (W_U.shape[0],):
        W_U = W_U * weight.to(torch.float64).cpu()[:, None]
    return centred(W_U, dim=0) if norm_centres(bridge) else W_U


def _unembedding_description(model: AnalysisModel) -> str:
    fixed = [n["fixed"] for n in model.loaded.norms.values()]
    if all(fixed):
        return "LN-free: folded unembedding C·diag(w_f/σ_f)·W_Eᵀ (exact bridge)"
    if not any(fixed):
        return "LN: compatibility-mode unembedding diag(w_f)·W_Eᵀ, centred (TL fold_ln)"
    return "partially LN-free: lm_head with the final norm's weight folded in, centred"


def output_weights(bridge: Any, layer: int) -> torch.Tensor:
    """``W_out [d_mlp, d_model]`` of ``layer`` as the bridge applies it, centred over ``d_model``, float64."""
    W_out = bridge.blocks[layer].mlp.W_out.detach().to(torch.float64).cpu()
    return centred(W_out, dim=-1) if norm_centres(bridge) else W_out


def _as_rows(vectors: torch.Tensor) -> torch.Tensor:
    vectors = torch.as_tensor(vectors, dtype=torch.float64)
    return vectors.unsqueeze(0) if vectors.ndim == 1 else vectors


def logit_variance(w_out: torch.Tensor, W_U: torch.Tensor, *, chunk: int = 8192) -> torch.Tensor:
    """``Var_v cos(w_out[i], W_U[:, v])`` for every row ``i`` (population variance over the vocabulary).

    ``w_out`` is ``[n, d_model]`` (or one ``[d_model]`` vector), ``W_U`` ``[d_model, d_vocab]``.
    Computed through the d_model×d_model second-moment matrix of the unit-normalised columns, so
    memory stays O(d_model²) for any vocabulary.  Zero columns count as cosine 0.
    """
    w = _as_rows(w_out)
    W = torch.as_tensor(W_U, dtype=torch.float64)
    d, vocab = W.shape
    second = torch.zeros(d, d, dtype=torch.float64)
    first = torch.zeros(d, dtype=torch.float64)
    for start in range(0, vocab, chunk):
        cols = W[:, start:start + chunk]
        unit = cols / cols.norm(dim=0, keepdim=True).clamp_min(_EPS)
        second += unit @ unit.T
        first += unit.sum(dim=1)
    second /= vocab
    first /= vocab
    w_unit = w / w.norm(dim=1, keepdim=True).clamp_min(_EPS)
    mean_sq = ((w_unit @ second) * w_unit).sum(dim=1)
    mean = w_unit @ first
    return (mean_sq - mean**2).clamp_min(0.0)


def candidate_scores(w_out: torch.Tensor, W_U: torch.Tensor) -> torch.Tensor:
    """Entropy-neuron score ``‖w_out‖ / LogitVar`` per row of ``w_out`` (LogitVar floored at 1e-30)."""
    w = _as_rows(w_out)
    return w.norm(dim=1) / logit_variance(w, W_U).clamp_min(_EPS)


def null_space_basis(W_U: torch.Tensor, *, chunk: int = 8192, centre: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Left singular directions of the centred ``W_U``, smallest singular value first.

    Returns ``(directions [d_model, d_model-1], singular_values [d_model-1])``: the all-ones
    direction (an exact null direction of a centred ``W_U``, removed by every LayerNorm) is
    excluded, so ``directions[:, :k]`` are the k bottom non-trivial directions.  Uses the
    eigendecomposition of ``C W_U W_Uᵀ C`` (any vocabulary size, including d_vocab < d_model).
    With ``centre=False`` (RMSNorm families, whose norms do not centre) ``W_U`` is used as it is
    and all ``d_model`` directions are returned.
    """
    W = torch.as_tensor(W_U, dtype=torch.float64)
    d, vocab = W.shape
    gram = torch.zeros(d, d, dtype=torch.float64)
    for start in range(0, vocab, chunk):
        cols = W[:, start:start + chunk]
        cols = centred(cols, dim=0) if centre else cols
        gram += cols @ cols.T
    gram = (gram + gram.T) / 2
    if not centre:
        values, vectors = torch.linalg.eigh(gram)
        return vectors, values.clamp_min(0.0).sqrt()
    # The all-ones direction is an exact eigenvector (eigenvalue 0); lift it above every other
    # eigenvalue so it sorts last, then drop it.
    lift = 1.0 + 2.0 * gram.diagonal().sum()
    ones = torch.full((d, 1), d**-0.5, dtype=torch.float64)
    values, vectors = torch.linalg.eigh(gram + lift * (ones @ ones.T))
    return vectors[:, :-1], values[:-1].clamp_min(0.0).sqrt()


def null_space_fraction(
    w_out: torch.Tensor, W_U: torch.Tensor | None = None, k: int | None = None, *, basis: torch.Tensor | None = None,
    centre: bool = True,
) -> torch.Tensor:
    """Share of ``‖w_out‖²`` in the ``k`` bottom singular directions of ``W_U`` (per row).

    Both are centred over d_model first (see :func:`null_space_basis`); ``k`` defaults to
    :func:`default_null_k`.  Pass a precomputed ``basis`` (from :func:`null_space_basis`) to skip
    the decomposition.  1 = entirely invisible to the unembedding, 0 = none of it.
    """
    w = centred(_as_rows(w_out)) if centre else _as_rows(w_out)
    if basis is None:
        if W_U is None:
            raise ValueError("give W_U or a precomputed basis")
        basis, _ = null_space_basis(W_U, centre=centre)
    k = default_null_k(w.shape[1]) if k is None else int(k)
    if not 1 <= k <= basis.shape[1]:
        raise ValueError(f"k must be in [1, {basis.shape[1]}], got {k}")
    projected = w @ basis[:, :k]
    return (projected**2).sum(dim=1) / (w**2).sum(dim=1).clamp_min(_EPS)


def rank_candidates(
    bridge: Any, layer: int | None = None, *, null_k: int | None = None, basis: torch.Tensor | None = None,
) -> pd.DataFrame:
    """Every neuron of ``layer`` (default: last) ranked by ``‖w_out‖ / LogitVar``, best first.

    Columns: layer, neuron, rank (1 = best), score, w_out_norm, logit_var, null_space_fraction
    (bottom ``null_k`` directions), null_k.  ``basis``: a precomputed :func:`null_space_basis`
    of :func:`unembedding` (``bridge``) directions, to avoid decomposing ``W_U`` twice.
    """
    n_layers = bridge.cfg.n_layers
    layer = n_layers - 1 if layer is None else int(layer)
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer} out of range for {n_layers} layers")
    W_U = unembedding(bridge)
    w_out = output_weights(bridge, layer)
    null_k = default_null_k(W_U.shape[0]) if null_k is None else int(null_k)
    if basis is None:
        basis, _ = null_space_basis(W_U, centre=norm_centres(bridge))
    norms = w_out.norm(dim=1)
    var = logit_variance(w_out, W_U)
    table = pd.DataFrame({
        "layer": layer,
        "neuron": np.arange(w_out.shape[0]),
        "score": (norms / var.clamp_min(_EPS)).numpy(),
        "w_out_norm": norms.numpy(),
        "logit_var": var.numpy(),
        "null_space_fraction": null_space_fraction(w_out, k=null_k, basis=basis, centre=norm_centres(bridge)).numpy(),
        "null_k": null_k,
    })
    table = table.sort_values("score", ascending=False, kind="stable").reset_index(drop=True)
    table.insert(2, "rank", np.arange(1, len(table) + 1))
    return table


def _spectrum_table(w_out: torch.Tensor, basis: torch.Tensor) -> np.ndarray:
    """Cumulative share of ``‖w‖²`` in the bottom-k directions, per row (``w_out`` as :func:`output_weights` gives it)."""
    w = _as_rows(w_out)
    shares = (w @ basis) ** 2 / (w**2).sum(dim=1, keepdim=True).clamp_min(_EPS)
    return shares.cumsum(dim=1).numpy()


# ----------------------------------------------------------------------------------------------
# Mean ablation
# ----------------------------------------------------------------------------------------------


def _row_chunks(n_rows: int, rows_per_forward: int):
    for start in range(0, n_rows, rows_per_forward):
        yield start, min(start + rows_per_forward, n_rows)


@torch.no_grad()
def mean_activations(
    bridge: Any, tokens: torch.Tensor, layers: Sequence[int], *, batch_tokens: int = 4096,
) -> dict[int, torch.Tensor]:
    """Dataset-mean MLP activation (``mlp.hook_post``) per layer: ``{layer: [d_mlp] float64}``,
    averaged over every token position of ``tokens [batch, pos]``."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    layers = sorted({int(layer) for layer in layers})
    sums = {layer: None for layer in layers}
    count = 0

    def accumulate(layer: int):
        def fn(activation: torch.Tensor, hook: Any) -> None:
            total = activation.detach().to(torch.float64).sum(dim=(0, 1)).cpu()
            sums[layer] = total if sums[layer] is None else sums[layer] + total

        return fn

    device = bridge.cfg.device
    rows = max(1, batch_tokens // tokens.shape[1])
    hooks = [(hook_name("mlp_post", layer), accumulate(layer)) for layer in layers]
    with bridge.hooks(fwd_hooks=hooks):
        for start, stop in _row_chunks(tokens.shape[0], rows):
            bridge(tokens[start:stop].to(device), return_type="logits")
            count += (stop - start) * tokens.shape[1]
    missing = [layer for layer in layers if sums[layer] is None]
    if missing:  # pragma: no cover - guards a TL behaviour change
        raise RuntimeError(f"mlp.hook_post did not fire for layers {missing}")
    return {layer: sums[layer] / count for layer in layers}


@dataclass
class AblationEffects:
    """Per-token output entropy and next-token CE, clean and under each ablation set (float64, nats).

    ``entropy [batch, pos]``, ``ce [batch, pos-1]`` (CE of predicting token t+1 at position t);
    ``ablated_entropy [n_sets, batch, pos]``, ``ablated_ce [n_sets, batch, pos-1]``.
    """

    ablations: list[list[Neuron]]
    entropy: torch.Tensor
    ce: torch.Tensor
    ablated_entropy: torch.Tensor
    ablated_ce: torch.Tensor

    @property
    def delta_entropy(self) -> torch.Tensor:
        """``H(ablated) - H(clean)`` per set and token ``[n_sets, batch, pos]``."""
        return self.ablated_entropy - self.entropy

    @property
    def delta_ce(self) -> torch.Tensor:
        """``CE(ablated) - CE(clean)`` per set and token ``[n_sets, batch, pos-1]``."""
        return self.ablated_ce - self.ce


def _token_stats(logits: torch.Tensor, ids: torch.Tensor, slice_tokens: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy ``[rows, pos]`` and next-token CE ``[rows, pos-1]``, in float64, ``slice_tokens`` at a time."""
    rows, n_pos, vocab = logits.shape
    flat = logits.reshape(rows * n_pos, vocab)
    # Target of position t is token t+1; the last position of each row has none (dropped below).
    targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1).reshape(-1).to(logits.device)
    entropy = torch.empty(rows * n_pos, dtype=torch.float64)
    ce = torch.empty(rows * n_pos, dtype=torch.float64)
    for start in range(0, rows * n_pos, slice_tokens):
        stop = start + slice_tokens
        stats, _ = token_statistics(flat[start:stop], targets[start:stop], dtype=torch.float64)
        entropy[start:stop] = stats["entropy"].cpu()
        ce[start:stop] = stats["ce"].cpu()
    return entropy.view(rows, n_pos), ce.view(rows, n_pos)[:, :-1]


@torch.no_grad()
def ablation_effects(
    bridge: Any,
    tokens: torch.Tensor,
    ablations: Sequence[Sequence[Neuron]],
    means: Mapping[int, torch.Tensor] | None = None,
    *,
    batch_tokens: int = 4096,
) -> AblationEffects:
    """Mean-ablate each set of neurons (``[(layer, neuron), ...]``, any layers) and measure per token.

    Each set replaces its neurons' ``mlp.hook_post`` activations by ``means[layer][neuron]`` (default:
    :func:`mean_activations` over ``tokens``) at every position.  The clean run and all sets are
    stacked along the batch dimension: each forward pass holds up to ``batch_tokens`` tokens
    (at least one sequence), rows belonging to different sets, each modified by its own
    hook-applied replacement.
    """
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    n_seq, n_pos = tokens.shape
    sets = [[(int(layer), int(neuron)) for layer, neuron in s] for s in ablations]
    d_mlp = bridge.cfg.d_mlp
    for s in sets:
        for layer, neuron in s:
            if not (0 <= layer < bridge.cfg.n_layers and 0 <= neuron < d_mlp):
                raise ValueError(f"no neuron {neuron_label((layer, neuron))} in a {bridge.cfg.n_layers}×{d_mlp} MLP")
    layers = sorted({layer for s in sets for layer, _ in s})
    if means is None:
        means = mean_activations(bridge, tokens, layers, batch_tokens=batch_tokens)
    all_sets = [[]] + sets  # index 0: the clean run
    work = [(set_index, seq) for set_index in range(len(all_sets)) for seq in range(n_seq)]
    entropy = torch.empty(len(all_sets), n_seq, n_pos, dtype=torch.float64)
    ce = torch.empty(len(all_sets), n_seq, n_pos - 1, dtype=torch.float64)
    device = bridge.cfg.device
    rows_per_forward = max(1, batch_tokens // n_pos)

    for start, stop in _row_chunks(len(work), rows_per_forward):
        chunk = work[start:stop]
        set_idx = torch.tensor([s for s, _ in chunk])
        seq_idx = torch.tensor([q for _, q in chunk])
        replacements: dict[int, tuple[list[int], list[int], list[float]]] = {}
        for row, (s, _) in enumerate(chunk):
            for layer, neuron in all_sets[s]:
                rows, neurons, values = replacements.setdefault(layer, ([], [], []))
                rows.append(row)
                neurons.append(neuron)
                values.append(float(means[layer][neuron]))

        def replace(rows: list[int], neurons: list[int], values: list[float]):
            def fn(activation: torch.Tensor, hook: Any) -> torch.Tensor:
                activation = activation.clone()
                value = torch.tensor(values, dtype=activation.dtype, device=activation.device)
                activation[torch.tensor(rows, device=activation.device), :,
                           torch.tensor(neurons, device=activation.device)] = value[:, None]
                return activation

            return fn

        hooks = [(hook_name("mlp_post", layer), replace(*spec)) for layer, spec in replacements.items()]
        ids = tokens[seq_idx].to(device)
        with bridge.hooks(fwd_hooks=hooks):
            logits = bridge(ids, return_type="logits")
        h, c = _token_stats(logits, ids)
        entropy[set_idx, seq_idx] = h
        ce[set_idx, seq_idx] = c

    return AblationEffects(ablations=sets, entropy=entropy[0], ce=ce[0], ablated_entropy=entropy[1:],
                           ablated_ce=ce[1:])


# ----------------------------------------------------------------------------------------------
# The analysis
# ----------------------------------------------------------------------------------------------


def _shape(model: AnalysisModel) -> tuple[int, int, int]:
    cfg = model.bridge().cfg
    return int(cfg.n_layers), int(cfg.d_model), int(cfg.d_mlp)


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
        raise ValueError("no known entropy neurons for this shape: give a candidate ranking or neurons")
    top = ranking.head(top_k)
    return [(int(l), int(n)) for l, n in zip(top["layer"], top["neuron"])], f"top-{top_k} candidates"


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
    if not models:
        raise ValueError("no models given")
    labels = [m.label for m in models]
    reference = labels[0] if reference is None else reference
    if reference not in labels:
        raise ValueError(f"reference {reference!r} is not one of {labels}")
    timings: dict[str, dict[str, float]] = {label: {} for label in labels}
    for m in models:
        t0 = time.perf_counter()
        m.bridge()  # built once and cached by AnalysisModel
        timings[m.label]["bridge_s"] = time.perf_counter() - t0
    shapes = {_shape(m) for m in models}
    if len(shapes) != 1:
        raise ValueError(f"models differ in shape (n_layers, d_model, d_mlp): {sorted(shapes)}")
    n_layers, d_model, d_mlp = shapes.pop()
    rank_layer = n_layers - 1 if layer is None else int(layer)
    null_k = default_null_k(d_model) if null_k is None else int(null_k)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [batch, pos] with pos >= 2, got {tuple(tokens.shape)}")
    n_seq, n_pos = tokens.shape
    out_dir = Path(out_dir)

    rankings: dict[str, pd.DataFrame] = {}
    bases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for m in models:
        t0 = time.perf_counter()
        bridge = m.bridge()
        bases[m.label] = null_space_basis(unembedding(bridge), centre=norm_centres(bridge))
        rankings[m.label] = rank_candidates(bridge, rank_layer, null_k=null_k, basis=bases[m.label][0])
        timings[m.label]["ranking_s"] = time.perf_counter() - t0

    selected, selection = select_neurons((n_layers, d_model, d_mlp), rankings[reference], layer=layer,
                                         neurons=neurons, top_k=top_k)
    if selection == f"top-{top_k} candidates":
        selection += f" of {reference}"
    for lay, neu in selected:
        if not (0 <= lay < n_layers and 0 <= neu < d_mlp):
            raise ValueError(f"no neuron {neuron_label((lay, neu))} in a {n_layers}-layer model with d_mlp={d_mlp}")
    singles = [[n] for n in selected]
    cumulative = [selected[:i] for i in range(2, len(selected) + 1)]
    ablation_sets = singles + cumulative
    set_names = [neuron_label(n) for n in selected] + [f"top-{i}" for i in range(2, len(selected) + 1)]
    kinds = ["single"] * len(singles) + ["cumulative"] * len(cumulative)

    n_rows = len(models) * len(ablation_sets) * n_seq * n_pos
    token_sequences = np.arange(n_seq)
    if max_token_rows is not None and n_rows > max_token_rows:
        keep = max(1, max_token_rows // (len(models) * len(ablation_sets) * n_pos))
        token_sequences = np.sort(np.random.default_rng(seed).choice(n_seq, size=keep, replace=False))

    candidate_frames, spectrum_frames, token_frames = [], [], []
    ablation_rows, distribution_rows = [], []
    per_model: dict[str, Any] = {}
    chosen = set(selected)
    for m in models:
        bridge = m.bridge()
        ranking = rankings[m.label].copy()
        ranking.insert(0, "model", m.label)
        ranking["selected"] = [(int(l), int(n)) in chosen for l, n in zip(ranking["layer"], ranking["neuron"])]
        candidate_frames.append(ranking)

        basis, singular = bases[m.label]
        weights: dict[int, torch.Tensor] = {}
        for lay, neu in selected:
            if lay not in weights:
                weights[lay] = output_weights(bridge, lay)
            share = _spectrum_table(weights[lay][neu], basis)[0]
            spectrum_frames.append(pd.DataFrame({
                "model": m.label, "neuron": neuron_label((lay, neu)), "k": np.arange(1, len(share) + 1),
                "singular_value": singular.numpy(), "cumulative_share": share,
            }))

        t0 = time.perf_counter()
        means = mean_activations(bridge, tokens, sorted({l for l, _ in selected}), batch_tokens=batch_tokens)
        effects = ablation_effects(bridge, tokens, ablation_sets, means, batch_tokens=batch_tokens)
        timings[m.label]["ablation_s"] = time.perf_counter() - t0

        clean_h = effects.entropy.numpy()
        clean_ce = effects.ce.numpy()
        sub = token_sequences
        seq_grid, pos_grid = np.meshgrid(sub, np.arange(n_pos), indexing="ij")
        pad = np.full((len(sub), 1), np.nan)
        ce_padded = np.concatenate([clean_ce[sub], pad], axis=1)
        ablations_summary = {}
        for i, (name, kind, neuron_set) in enumerate(zip(set_names, kinds, ablation_sets)):
            dh = effects.delta_entropy[i].numpy()
            dce = effects.delta_ce[i].numpy()
            dce_padded = np.concatenate([dce[sub], pad], axis=1)
            token_frames.append(pd.DataFrame({
                "model": m.label, "ablation": name, "kind": kind, "n_neurons": len(neuron_set),
                "sequence": seq_grid.ravel(), "position": pos_grid.ravel(),
                "entropy": clean_h[sub].ravel(), "delta_entropy": dh[sub].ravel(),
                "abs_delta_entropy": np.abs(dh[sub]).ravel(),
                "ce": ce_padded.ravel(), "delta_ce": dce_padded.ravel(), "abs_delta_ce": np.abs(dce_padded).ravel(),
            }))
            row = {
                "model": m.label, "ablation": name, "kind": kind, "n_neurons": len(neuron_set),
                "neurons": " ".join(neuron_label(n) for n in neuron_set),
                "mean_activation": " ".join(f"{float(means[l][n]):.6g}" for l, n in neuron_set),
                **_ablation_stats(dh, dce, clean_h, n_bootstrap, seed),
                "clean_mean_entropy": float(clean_h.mean()), "clean_mean_ce": float(clean_ce.mean()),
            }
            ablation_rows.append(row)
            distribution_rows.extend(_distribution_rows(m.label, name, dh, dce))
            ablations_summary[name] = {k: v for k, v in row.items() if k not in ("model", "ablation")}

        by_neuron = rankings[m.label].set_index("neuron")
        per_model[m.label] = {
            "ln_free": bool(m.ln_free),
            "W_U": _unembedding_description(m),
            "top_candidates": [
                {"neuron": neuron_label((int(r.layer), int(r.neuron))), "score": float(r.score),
                 "w_out_norm": float(r.w_out_norm), "logit_var": float(r.logit_var),
                 "null_space_fraction": float(r.null_space_fraction)}
                for r in rankings[m.label].head(max(top_k, 1)).itertuples()
            ],
            "selected": {  # the ablated neurons' standing in this model's ranking (rank_layer only)
                neuron_label(n): {"rank": int(by_neuron.at[n[1], "rank"]), "score": float(by_neuron.at[n[1], "score"]),
                                  "null_space_fraction": float(by_neuron.at[n[1], "null_space_fraction"])}
                for n in selected if n[0] == rank_layer
            },
            "ablations": ablations_summary,
        }

    tables = {
        "candidates": pd.concat(candidate_frames, ignore_index=True),
        "null_space_spectrum": pd.concat(spectrum_frames, ignore_index=True),
        "ablations": pd.DataFrame(ablation_rows),
        "distributions": pd.DataFrame(distribution_rows),
        "per_token": pd.concat(token_frames, ignore_index=True),
    }
    table_paths = [str(write_table(table, out_dir, name)) for name, table in tables.items()]
    figure_paths = []
    for name, figure in _figures(tables, set_names).items():
        figure_paths.extend(str(p) for p in write_figure(figure, out_dir, name))

    summary = {
        "analysis": "entropy_neurons",
        "models": labels,
        "reference": reference,
        "rank_layer": rank_layer,
        "selection": selection,
        "neurons": [neuron_label(n) for n in selected],
        "ablations": {name: [neuron_label(n) for n in s] for name, s in zip(set_names, ablation_sets)},
        "tokens": {"n_sequences": n_seq, "length": n_pos},
        "per_token_sequences": "all" if len(token_sequences) == n_seq else token_sequences.tolist(),
        "null_k": null_k,
        "seed": seed,
        "n_bootstrap": n_bootstrap,
        "units": "nats; entropy at every position, CE of the next token (positions 0..pos-2)",
        "per_model": per_model,
        "reference_numbers_gpt2_small_p25": REFERENCE_GPT2_SMALL,
        "tables": table_paths,
        "figures": figure_paths,
    }
    write_summary(summary, out_dir)
    write_summary({"seconds": timings}, out_dir, TIMINGS)
    return summary


def _figures(tables: dict[str, pd.DataFrame], set_names: list[str]) -> dict[str, Any]:
    import plotly.express as px
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    figures = {}
    cand = tables["candidates"].copy()
    cand["neuron_label"] = [neuron_label((int(l), int(n))) for l, n in zip(cand["layer"], cand["neuron"])]
    cand["logit_var_floored"] = cand["logit_var"].clip(lower=1e-12)
    figures["candidates"] = px.scatter(
        cand, x="w_out_norm", y="logit_var_floored", color="selected", facet_col="model", log_y=True,
        hover_data=["neuron_label", "rank", "score", "null_space_fraction"],
        title="Entropy-neuron candidates: ‖w_out‖ vs LogitVar (ablated neurons highlighted; floor 1e-12)",
        labels={"w_out_norm": "‖w_out‖", "logit_var_floored": "LogitVar"})

    dist = tables["distributions"]
    models = list(dict.fromkeys(dist["model"]))
    metrics = [("abs_delta_entropy", "|ΔH| (nats)"), ("abs_delta_ce", "|ΔCE| (nats)")]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, subplot_titles=[t for _, t in metrics])
    colours = px.colors.qualitative.Plotly
    for row, (metric, _) in enumerate(metrics, start=1):
        for j, model in enumerate(models):
            part = dist[(dist["model"] == model) & (dist["metric"] == metric)].set_index("ablation").loc[set_names]
            fig.add_trace(go.Box(
                x=set_names, q1=part["q25"], median=part["median"], q3=part["q75"], lowerfence=part["q05"],
                upperfence=part["q95"], mean=part["mean"], name=model, legendgroup=model, showlegend=row == 1,
                marker_color=colours[j % len(colours)]), row=row, col=1)
    fig.update_layout(boxmode="group", title="Per-token effect of mean ablation (box: quartiles, whiskers: 5–95 %)")
    figures["ablation_distributions"] = fig

    abl = tables["ablations"]
    first = abl[abl["ablation"] == set_names[0]]
    curve = pd.concat([
        pd.DataFrame({"model": models, "n_neurons": 0, "relative_entropy_change_percent": 0.0}),
        first[["model", "n_neurons", "relative_entropy_change_percent"]],
        abl[abl["kind"] == "cumulative"][["model", "n_neurons", "relative_entropy_change_percent"]],
    ], ignore_index=True)
    figures["cumulative_entropy"] = px.line(
        curve.sort_values(["model", "n_neurons"], kind="stable"), x="n_neurons", y="relative_entropy_change_percent",
        color="model", markers=True, title="Cumulative mean ablation: change of the mean output entropy",
        labels={"n_neurons": "neurons ablated together (in list order)",
                "relative_entropy_change_percent": "Δ mean entropy (%)"})

    figures["null_space_spectrum"] = px.line(
        tables["null_space_spectrum"], x="k", y="cumulative_share", color="neuron", facet_col="model", log_x=True,
        title="Share of ‖w_out‖² in the bottom-k singular directions of W_U (centred, all-ones excluded)",
        labels={"k": "k", "cumulative_share": "share of ‖w_out‖²"})
    return figures
