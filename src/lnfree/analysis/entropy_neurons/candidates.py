"""Entropy-neuron candidates: neuron identifiers, the weights as the bridge applies them, and scores.

The candidate score ``‖w_out‖ / LogitVar`` and the null-space fraction of ``w_out`` of every MLP
neuron, from the ``W_U`` and ``W_out`` of a model's TransformerLens bridge ("Which weights" in
:mod:`lnfree.analysis.entropy_neurons.run`, which re-exports the public names).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from lnfree.errors import UsageError
from lnfree.forms.bridge import norm_centres, norm_weight

Neuron = tuple[int, int]  # (layer, neuron index)

#: Known entropy neurons (layer, neuron), keyed by (n_layer, d_model) of the GPT-2 shape they belong to.
KNOWN_ENTROPY_NEURONS: dict[tuple[int, int], list[Neuron]] = {
    (12, 768): [(11, 584), (11, 2123), (11, 2870)],  # GPT-2 small
    (24, 1024): [(23, 3144), (23, 1083), (23, 1108)],  # GPT-2 medium
}

_EPS = 1e-30
#: Vocabulary columns of ``W_U`` per block in the float64 maths below (8192 × d_model: 40 MB for Gemma 3).
COLUMN_CHUNK = 8192


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
        raise UsageError(f"duplicate neurons in {neurons}")
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


@dataclass(frozen=True)
class UnembeddingColumns:
    """:func:`unembedding` made ``chunk`` vocabulary columns at a time: the same float64 values, never the
    whole matrix in float64 (Gemma 3's would take 1.3 GB, twice while it is centred)."""

    weight: torch.Tensor  # the bridge's W_U [d_model, d_vocab], as it holds it
    scale: torch.Tensor | None  # a weight its final norm still applies [d_model], float64
    centre: bool  # centre each column over d_model
    chunk: int = COLUMN_CHUNK

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def blocks(self) -> Iterator[torch.Tensor]:
        """The columns, ``chunk`` at a time: float64 ``[d_model, chunk]`` blocks in vocabulary order."""
        for start in range(0, self.weight.shape[1], self.chunk):
            cols = self.weight[:, start:start + self.chunk].detach().to(torch.float64).cpu()
            if self.scale is not None:
                cols = cols * self.scale[:, None]
            yield centred(cols, dim=0) if self.centre else cols


def unembedding_columns(bridge: Any, chunk: int = COLUMN_CHUNK) -> UnembeddingColumns:
    """``W_U [d_model, d_vocab]`` as the bridge applies it ("Which weights" in
    :mod:`lnfree.analysis.entropy_neurons.run`), centred over ``d_model``, float64, read ``chunk`` columns
    at a time (what :func:`logit_variance`, :func:`null_space_basis` and :func:`rank_candidates` use).

    A weight still held by the bridge's final norm (a partially LN-free model's own ``ln_f``) is
    folded in; after ``fold_ln`` (LN models) it is all ones, and LN-free bridges have none.
    """
    W_U = bridge.W_U
    norm = getattr(getattr(bridge, "ln_final", None), "original_component", None)
    weight = norm_weight(bridge, norm) if norm is not None else None
    scale = None
    if isinstance(weight, torch.Tensor) and weight.shape == (W_U.shape[0],):
        scale = weight.to(torch.float64).cpu()
    return UnembeddingColumns(W_U, scale, norm_centres(bridge), chunk)


def unembedding(bridge: Any) -> torch.Tensor:
    """:func:`unembedding_columns` as one float64 matrix ``[d_model, d_vocab]`` (8 bytes per weight)."""
    return torch.cat(list(unembedding_columns(bridge).blocks()), dim=1)


def _column_blocks(W_U: torch.Tensor | UnembeddingColumns, chunk: int) -> Iterator[torch.Tensor]:
    """``W_U``'s columns in float64 blocks (its own blocks for :class:`UnembeddingColumns`)."""
    if isinstance(W_U, UnembeddingColumns):
        yield from W_U.blocks()
        return
    W = torch.as_tensor(W_U)
    for start in range(0, W.shape[1], chunk):
        yield W[:, start:start + chunk].to(torch.float64)


def output_weights(bridge: Any, layer: int) -> torch.Tensor:
    """``W_out [d_mlp, d_model]`` of ``layer`` as the bridge applies it, centred over ``d_model``, float64."""
    W_out = bridge.blocks[layer].mlp.W_out.detach().to(torch.float64).cpu()
    return centred(W_out, dim=-1) if norm_centres(bridge) else W_out


def _as_rows(vectors: torch.Tensor) -> torch.Tensor:
    vectors = torch.as_tensor(vectors, dtype=torch.float64)
    return vectors.unsqueeze(0) if vectors.ndim == 1 else vectors


def logit_variance(
    w_out: torch.Tensor, W_U: torch.Tensor | UnembeddingColumns, *, chunk: int = COLUMN_CHUNK,
) -> torch.Tensor:
    """``Var_v cos(w_out[i], W_U[:, v])`` for every row ``i`` (population variance over the vocabulary).

    ``w_out`` is ``[n, d_model]`` (or one ``[d_model]`` vector), ``W_U`` ``[d_model, d_vocab]`` (or
    :class:`UnembeddingColumns`).  Computed ``chunk`` columns at a time in float64 through the
    d_model×d_model second-moment matrix of the unit-normalised columns, so memory stays O(d_model²)
    for any vocabulary.  Zero columns count as cosine 0.
    """
    w = _as_rows(w_out)
    d, vocab = W_U.shape
    second = torch.zeros(d, d, dtype=torch.float64)
    first = torch.zeros(d, dtype=torch.float64)
    for cols in _column_blocks(W_U, chunk):
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


def null_space_basis(
    W_U: torch.Tensor | UnembeddingColumns, *, chunk: int = COLUMN_CHUNK, centre: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left singular directions of the centred ``W_U``, smallest singular value first.

    Returns ``(directions [d_model, d_model-1], singular_values [d_model-1])``: the all-ones
    direction (an exact null direction of a centred ``W_U``, removed by every LayerNorm) is
    excluded, so ``directions[:, :k]`` are the k bottom non-trivial directions.  Uses the
    eigendecomposition of ``C W_U W_Uᵀ C`` (any vocabulary size, including d_vocab < d_model).
    With ``centre=False`` (RMSNorm families, whose norms do not centre) ``W_U`` is used as it is
    and all ``d_model`` directions are returned. ``W_U`` (or :class:`UnembeddingColumns`) is read
    ``chunk`` columns at a time in float64.
    """
    d = W_U.shape[0]
    gram = torch.zeros(d, d, dtype=torch.float64)
    for cols in _column_blocks(W_U, chunk):
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
            raise UsageError("give W_U or a precomputed basis")
        basis, _ = null_space_basis(W_U, centre=centre)
    k = default_null_k(w.shape[1]) if k is None else int(k)
    if not 1 <= k <= basis.shape[1]:
        raise UsageError(f"k must be in [1, {basis.shape[1]}], got {k}")
    projected = w @ basis[:, :k]
    return (projected**2).sum(dim=1) / (w**2).sum(dim=1).clamp_min(_EPS)


def rank_candidates(
    bridge: Any, layer: int | None = None, *, null_k: int | None = None, basis: torch.Tensor | None = None,
) -> pd.DataFrame:
    """Every neuron of ``layer`` (default: last) ranked by ``‖w_out‖ / LogitVar``, best first.

    Columns: layer, neuron, rank (1 = best), score, w_out_norm, logit_var, null_space_fraction
    (bottom ``null_k`` directions), null_k.  ``basis``: a precomputed :func:`null_space_basis`
    of :func:`unembedding_columns` (``bridge``) directions, to avoid decomposing ``W_U`` twice.
    """
    n_layers = bridge.cfg.n_layers
    layer = n_layers - 1 if layer is None else int(layer)
    if not 0 <= layer < n_layers:
        raise UsageError(f"layer {layer} out of range for {n_layers} layers")
    W_U = unembedding_columns(bridge)
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


def null_space_spectrum(w_out: torch.Tensor, basis: torch.Tensor) -> np.ndarray:
    """Cumulative share of ``‖w‖²`` in the bottom-k directions, for every k, per row (``w_out`` as
    :func:`output_weights` gives it, ``basis`` from :func:`null_space_basis`)."""
    w = _as_rows(w_out)
    shares = (w @ basis) ** 2 / (w**2).sum(dim=1, keepdim=True).clamp_min(_EPS)
    return shares.cumsum(dim=1).numpy()

