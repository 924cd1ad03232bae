"""Direct logit attribution (DLA) against the direct effect (DE), per attention head and MLP layer.

At every position ``p`` of a sequence that has a next token, the target is that next token
``t = tokens[:, p + 1]`` (the token the model predicts at ``p``; the last position has no target).
For each residual component ``c`` (token and position embedding, every attention head, each
layer's attention output bias and MLP output):

* ``DLA(c)`` is the component's contribution to the target logit read through the final norm at
  the run's own cached scale: ``LN_cached(c) · W_U[:, t]``, computed by
  :func:`lnfree.analysis.attribution.direct_logit_attribution`.  The DLAs of all components plus the
  unembedding (and final-norm) bias sum to the target logit.
* ``DE(c)`` is what the target logit loses when the component is removed from the final
  residual stream and the final norm is recomputed on what is left:
  ``logit_t(x) − logit_t(x − c)``, with ``x`` the residual entering the final norm.

For an LN-free model the final norm is the identity, the logit is linear in ``x`` and DE equals
DLA exactly.  With a real final LayerNorm, removing ``c`` changes the scale and the centring, so
DLA (a linearisation at the cached scale) differs from DE.  Their disagreement is summarised by

* per component: ``NMAE = mean|DLA − DE| / mean|DE|`` over samples (sequence × position), and
* globally: ``Σ|DLA − DE| / Σ|DE|`` over all heads × samples, with a seeded percentile bootstrap
  CI that resamples whole sequences (:func:`lnfree.analysis.common.ratio_of_means_ci` on the
  per-sequence sums).

LayerNorm models are analysed through their TransformerLens bridge in compatibility mode (LN
folded, writing weights centred), the coordinate system in which DLA with the cached scale is
defined; DE is computed in float64 from that bridge's final residual and weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lnfree.analysis.common import AnalysisModel, bridge_of, logit_rows, write_figure
from lnfree.analysis.palette import BAR_LABEL, quantity_colour
from lnfree.evaluate.results import ratio_of_means_ci, write_summary, write_table
from lnfree.analysis.attribution import (
    ResidualDecomposition, direct_logit_attribution, fixed_final_norm, is_layernorm, residual_decomposition,
)
from lnfree.forms.bridge import norm_weight
from lnfree.errors import UsageError

__all__ = [
    "DlaResult",
    "component_table",
    "dla_and_direct_effect",
    "final_norm",
    "global_nmae",
    "head_nmae_matrix",
    "run",
]


@dataclass
class DlaResult:
    """DLA and DE of every residual component for next-token targets.

    Arrays are indexed ``[component, sequence, position]`` over positions ``0 .. n_pos - 2``
    (position ``p`` predicts ``tokens[:, p + 1]``).
    """

    labels: list[str]  # "embed", "pos_embed", "L{l}H{h}", "L{l}.attn_bias", "L{l}.mlp"
    kinds: list[str]  # "embed", "pos_embed", "head", "attn_bias", "mlp"
    layers: list[int | None]  # the component's layer (None for the embeddings)
    heads: list[int | None]  # the head index (None unless kind == "head")
    dla: torch.Tensor  # [n_components, n_seq, n_pos - 1], float32 (the bridge's dtype)
    de: torch.Tensor  # [n_components, n_seq, n_pos - 1], float64
    bias: torch.Tensor  # [n_seq, n_pos - 1]: unembedding (+ final-norm) bias at the target
    target_logits: torch.Tensor  # [n_seq, n_pos - 1]: the model's logit of the target token
    targets: torch.Tensor  # [n_seq, n_pos - 1]: the target token ids (tokens[:, 1:])

    def mask(self, kind: str) -> np.ndarray:
        """Boolean mask over components of one kind."""
        return np.array([k == kind for k in self.kinds])


def _describe(label: str) -> tuple[str, int | None, int | None]:
    """(kind, layer, head) of a :class:`ResidualDecomposition` label."""
    if label in ("embed", "pos_embed"):
        return label, None, None
    layer_part, _, rest = label.partition(".")
    if rest == "attn_bias":
        return "attn_bias", int(layer_part[1:]), None
    if rest == "mlp":
        return "mlp", int(layer_part[1:]), None
    layer, _, head = label[1:].partition("H")
    return "head", int(layer), int(head)


def final_norm(bridge: Any, resid: torch.Tensor) -> torch.Tensor:
    """The bridge's final norm applied to ``resid [..., d_model]``, recomputed from scratch.

    Identity for a LN-free bridge (``cfg.normalization_type is None``).  Otherwise a LayerNorm
    (or an RMSNorm: no centring) with the bridge's ``cfg.eps`` and the final norm's weight and
    bias (1 and 0 after ``fold_ln``), computed in ``resid``'s dtype.
    """
    if bridge.cfg.normalization_type is None:
        fixed = fixed_final_norm(bridge)
        if fixed is None:
            return resid
        return fixed.linear(resid) + (0 if fixed.bias is None else fixed.bias.to(resid.dtype))
    if bridge.cfg.normalization_type not in ("LN", "LNPre", "RMS", "RMSPre"):
        raise UsageError(f"unsupported final norm {bridge.cfg.normalization_type!r}")
    centred = resid - resid.mean(-1, keepdim=True) if is_layernorm(bridge) else resid
    normed = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + float(bridge.cfg.eps))
    norm = bridge.ln_final.original_component
    weight = norm_weight(bridge, norm)
    bias = getattr(norm, "bias", None)
    if weight is not None:
        normed = normed * weight.to(resid.dtype)
    if bias is not None:
        normed = normed + bias.detach().to(resid.dtype)
    return normed


def _check_final_norm(bridge: Any) -> None:
    """Refuse pass-through bridges whose final norm is real (a partially LN-free model whose final norm
    is not fixed): DLA needs the final norm fixed, absent, or folded (a LayerNorm model)."""
    if bridge.cfg.normalization_type is not None or fixed_final_norm(bridge) is not None:
        return
    norm = getattr(bridge.ln_final, "original_component", None)
    if norm is not None and not isinstance(norm, torch.nn.Identity):
        raise UsageError(
            f"the bridge's final norm is a real {type(norm).__name__} behind a pass-through slot (a partially "
            "LN-free model): DLA/DE need the final norm fixed (an LN-free model, or one with only the final "
            "norm fixed) or a LayerNorm model"
        )


def _final_norm_state(model: AnalysisModel) -> str:
    """What DLA reads the logits through, said in the output: exact unless the final norm is real."""
    if model.ln_free:
        return "none (LN-free): DLA = DE exactly"
    if model.loaded.norms["ln_f"]["fixed"]:
        return "fixed (partially LN-free, final norm fixed): DLA = DE exactly"
    return "real: DLA linearises it at the cached scale"


def _slice(decomposition: ResidualDecomposition, index: int) -> ResidualDecomposition:
    """The decomposition of one sequence of a batch (kept as a batch of one)."""
    keep = slice(index, index + 1)
    return ResidualDecomposition(
        components=decomposition.components[:, keep],
        labels=decomposition.labels,
        final_resid=decomposition.final_resid[keep],
        final_scale=None if decomposition.final_scale is None else decomposition.final_scale[keep],
        logits=decomposition.logits[keep],
    )


#: Components whose DE is computed at once (bounds memory: chunk × positions × d_model float64).
COMPONENT_CHUNK = 64


def _target_logit_without(bridge: Any, x: torch.Tensor, comps: torch.Tensor, W_t: torch.Tensor) -> torch.Tensor:
    """logit_t(x − c) for each component c, with the final norm recomputed, from reductions over d_model.

    ``x [P, d]``, ``comps [C, P, d]``, ``W_t [P, d]`` (each position's target column); returns
    ``[C, P]``. For a LayerNorm, with centred x̃, c̃: var(x − c) = var x − 2·cov(x, c) + var c and
    (x̃ − c̃)·(w ⊙ W_t), so no ``[C, P, d]`` normalised copy is ever materialised (an RMSNorm
    alike, uncentred).
    """
    if bridge.cfg.normalization_type is None:
        fixed = fixed_final_norm(bridge)
        if fixed is None:
            return ((x.unsqueeze(0) - comps) * W_t).sum(-1)
        bias = 0 if fixed.bias is None else (fixed.bias * W_t).sum(-1)
        return (fixed.linear(x.unsqueeze(0) - comps) * W_t).sum(-1) + bias
    norm = bridge.ln_final.original_component
    weight = norm_weight(bridge, norm)
    bias = getattr(norm, "bias", None)
    w_t = W_t if weight is None else W_t * weight.double()
    centre = is_layernorm(bridge)
    x_c = x - x.mean(-1, keepdim=True) if centre else x
    c_c = comps - comps.mean(-1, keepdim=True) if centre else comps
    var = (x_c.pow(2).mean(-1) - 2 * (c_c * x_c).mean(-1) + c_c.pow(2).mean(-1)).clamp_min(0)
    projected = (x_c * w_t).sum(-1) - (c_c * w_t).sum(-1)
    logit = projected / torch.sqrt(var + float(bridge.cfg.eps))
    if bias is not None:
        logit = logit + (bias.detach().double() * W_t).sum(-1)
    return logit


def _one_sequence(bridge: Any, decomposition: ResidualDecomposition, targets: torch.Tensor):
    """DLA, DE, bias and target logit of one sequence (``decomposition`` holds a batch of one)."""
    n_pred = targets.shape[0]
    unique, inverse = torch.unique(targets, return_inverse=True)
    contributions, bias = direct_logit_attribution(bridge, decomposition, unique)  # [C, 1, P, U], [U]
    positions = torch.arange(n_pred, device=contributions.device)
    dla = contributions[:, 0, positions, inverse]  # [C, n_pred]
    bias_t = bias[inverse]
    target_logits = decomposition.logits[0, positions, targets]

    # DE in float64: logit_t(x) − logit_t(x − c) with the final norm recomputed on x − c.
    W_t = bridge.W_U.detach()[:, targets].double().T  # [n_pred, d_model]
    x = decomposition.final_resid[0, :n_pred].double()  # [n_pred, d_model]
    full = (final_norm(bridge, x) * W_t).sum(-1)  # [n_pred]
    ablated = torch.cat([
        _target_logit_without(bridge, x, chunk[:, 0, :n_pred].double(), W_t)
        for chunk in decomposition.components.split(COMPONENT_CHUNK)
    ])  # [C, n_pred]
    de = full.unsqueeze(0) - ablated
    return dla, de, bias_t, target_logits


def dla_and_direct_effect(bridge: Any, tokens: torch.Tensor, *, batch_size: int = 8) -> DlaResult:
    """DLA and DE of every component (per head) of ``bridge`` on ``tokens [n_seq, n_pos]``.

    Targets are the next tokens: position ``p`` is scored on ``tokens[:, p + 1]``, for
    ``p = 0 .. n_pos - 2``.  Runs the bridge without gradients in batches of ``batch_size``
    sequences, fewer where their logits would pass `lnfree.analysis.common.LOGITS_BUDGET` (a
    sequence's numbers are its own: the batch changes at most the forward pass's fp32 rounding).
    Works for exact LN-free bridges (DE == DLA up to rounding) and LayerNorm bridges in
    compatibility mode (DLA at the cached final-norm scale, DE with the norm recomputed).
    """
    _check_final_norm(bridge)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise UsageError(f"tokens must be [n_seq, n_pos] with n_pos >= 2, got {tuple(tokens.shape)}")
    dla, de, bias, target_logits = [], [], [], []
    labels: list[str] | None = None
    batch_size = logit_rows(tokens.shape[1], bridge.cfg.d_vocab, batch_size)
    for start in range(0, tokens.shape[0], batch_size):
        batch = tokens[start:start + batch_size]
        decomposition = residual_decomposition(bridge, batch, per_head=True)
        labels = decomposition.labels
        targets = batch[:, 1:].to(decomposition.logits.device)
        for i in range(batch.shape[0]):
            d, e, b, t = _one_sequence(bridge, _slice(decomposition, i), targets[i])
            dla.append(d.cpu())
            de.append(e.cpu())
            bias.append(b.cpu())
            target_logits.append(t.cpu())
        del decomposition  # its logits, before the next batch's forward pass makes its own
    assert labels is not None
    described = [_describe(label) for label in labels]
    return DlaResult(
        labels=list(labels),
        kinds=[k for k, _, _ in described],
        layers=[layer for _, layer, _ in described],
        heads=[head for _, _, head in described],
        dla=torch.stack(dla, dim=1),
        de=torch.stack(de, dim=1),
        bias=torch.stack(bias),
        target_logits=torch.stack(target_logits),
        targets=tokens[:, 1:].clone(),
    )


def component_table(result: DlaResult, label: str = ""):
    """One row per component: NMAE = mean|DLA−DE| / mean|DE|, mean DLA, mean DE and friends.

    Columns: ``model, component, kind, layer, head, nmae, mean_abs_diff, mean_abs_de,
    mean_abs_dla, mean_dla, mean_de, max_abs_diff, n_samples`` (samples = sequence × position).
    """
    import pandas as pd

    dla = result.dla.double().flatten(1).numpy()
    de = result.de.double().flatten(1).numpy()
    diff = np.abs(dla - de)
    mean_abs_de = np.abs(de).mean(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        nmae = diff.mean(1) / mean_abs_de
    return pd.DataFrame({
        "model": label,
        "component": result.labels,
        "kind": result.kinds,
        "layer": pd.array(result.layers, dtype="Int64"),
        "head": pd.array(result.heads, dtype="Int64"),
        "nmae": nmae,
        "mean_abs_diff": diff.mean(1),
        "mean_abs_de": mean_abs_de,
        "mean_abs_dla": np.abs(dla).mean(1),
        "mean_dla": dla.mean(1),
        "mean_de": de.mean(1),
        "max_abs_diff": diff.max(1),
        "n_samples": dla.shape[1],
    })


def global_nmae(
    result: DlaResult, *, kind: str = "head", n_resamples: int = 1000, seed: int = 0, level: float = 0.95,
) -> dict:
    """Σ|DLA − DE| / Σ|DE| over all components of ``kind`` × samples, with a bootstrap CI.

    The CI resamples sequences: per-sequence sums of the numerator and the denominator go to
    :func:`~lnfree.analysis.common.ratio_of_means_ci` (seeded).  Returns ``{"nmae", "ci_low",
    "ci_high", "level", "n_components", "n_sequences", "n_positions"}``.
    """
    mask = torch.as_tensor(result.mask(kind))
    if not bool(mask.any()):
        raise UsageError(f"no components of kind {kind!r}")
    dla = result.dla[mask].double()
    de = result.de[mask].double()
    numerators = (dla - de).abs().sum(dim=(0, 2)).numpy()  # per sequence
    denominators = de.abs().sum(dim=(0, 2)).numpy()
    low, high = ratio_of_means_ci(numerators, denominators, n_resamples=n_resamples, seed=seed, level=level)
    return {
        "nmae": float(numerators.sum() / denominators.sum()),
        "ci_low": low,
        "ci_high": high,
        "level": level,
        "n_components": int(mask.sum()),
        "n_sequences": int(dla.shape[1]),
        "n_positions": int(dla.shape[2]),
    }


def head_nmae_matrix(table) -> np.ndarray:
    """Per-head NMAE of one model's :func:`component_table` as a ``[n_layers, n_heads]`` array."""
    heads = table[table["kind"] == "head"]
    n_layers = int(heads["layer"].max()) + 1
    n_heads = int(heads["head"].max()) + 1
    matrix = np.full((n_layers, n_heads), np.nan)
    for layer, head, value in zip(heads["layer"], heads["head"], heads["nmae"]):
        matrix[int(layer), int(head)] = value
    return matrix


def _heatmap(matrix: np.ndarray, label: str):
    import plotly.graph_objects as go

    n_layers, n_heads = matrix.shape
    figure = go.Figure(go.Heatmap(
        z=matrix, x=[f"H{h}" for h in range(n_heads)], y=[f"L{layer}" for layer in range(n_layers)],
        colorscale="Viridis", colorbar={"title": "NMAE"},
        hovertemplate="layer %{y}, head %{x}: NMAE %{z:.3g}<extra></extra>",
    ))
    figure.update_layout(
        title=f"{label}: |DLA − DE| / |DE| per head (next-token target)",
        xaxis_title="head", yaxis_title="layer", yaxis_autorange="reversed",
    )
    return figure


def _global_bar(summaries: dict[str, dict]):
    import plotly.graph_objects as go

    labels = list(summaries)
    figure = go.Figure()
    for kind, key in (("heads", "heads"), ("MLPs", "mlps")):
        values = [summaries[m][key]["nmae"] for m in labels]
        upper = [summaries[m][key]["ci_high"] - summaries[m][key]["nmae"] for m in labels]
        lower = [summaries[m][key]["nmae"] - summaries[m][key]["ci_low"] for m in labels]
        figure.add_bar(name=kind, x=labels, y=values, marker_color=quantity_colour(kind), **BAR_LABEL,
                       error_y={"type": "data", "array": upper, "arrayminus": lower})
    figure.update_layout(barmode="group", title="Global NMAE of DLA vs DE (95% bootstrap CI over sequences)",
                         yaxis_title="Σ|DLA − DE| / Σ|DE|")
    return figure


def run(
    models: list[AnalysisModel], out_dir: str | Path, *, tokens: torch.Tensor, seed: int = 0,
    n_bootstrap: int = 1000, batch_size: int = 8,
) -> dict:
    """DLA vs DE for every model on ``tokens``; writes tables, figures and ``summary.json``.

    Files in ``out_dir``: ``dla_components.csv`` (one row per model × component, see
    :func:`component_table`), ``dla_global.csv`` (one row per model × component kind "head"/"mlp"),
    ``dla_nmae_heads_<label>.html`` (layer × head heatmap per model) and ``dla_global_nmae.html``.
    Returns the summary (also written): per model the global NMAE of heads and of MLPs with CIs.
    """
    import pandas as pd

    out_dir = Path(out_dir)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    tables, global_rows, figures, per_model = [], [], [], {}
    for model in models:
        with bridge_of(model) as bridge:
            result = dla_and_direct_effect(bridge, tokens, batch_size=batch_size)
        table = component_table(result, model.label)
        tables.append(table)
        stats = {key: global_nmae(result, kind=kind, n_resamples=n_bootstrap, seed=seed)
                 for key, kind in (("heads", "head"), ("mlps", "mlp"))}
        reconstruction = (result.dla.double().sum(0) + result.bias.double() - result.target_logits.double())
        heads = table[table["kind"] == "head"]
        worst = heads.loc[heads["nmae"].idxmax()]
        per_model[model.label] = {
            "ln_free": bool(model.ln_free),
            "final_norm": _final_norm_state(model),
            **stats,
            "max_head_nmae": float(worst["nmae"]),
            "max_head_nmae_component": str(worst["component"]),
            "median_head_nmae": float(heads["nmae"].median()),
            "max_abs_dla_minus_de_heads": float(heads["max_abs_diff"].max()),
            "dla_reconstruction_max_abs_error": float(reconstruction.abs().max()),
        }
        for key, kind in (("heads", "head"), ("mlps", "mlp")):
            global_rows.append({"model": model.label, "kind": kind, **stats[key]})
        figures += write_figure(_heatmap(head_nmae_matrix(table), model.label), out_dir,
                                f"dla_nmae_heads_{model.label}")
    written = [write_table(pd.concat(tables, ignore_index=True), out_dir, "dla_components"),
               write_table(pd.DataFrame(global_rows), out_dir, "dla_global")]
    figures += write_figure(_global_bar(per_model), out_dir, "dla_global_nmae")
    summary = {
        "analysis": "dla_vs_direct_effect",
        "target": "next token (tokens[:, p + 1] at position p)",
        "n_sequences": int(tokens.shape[0]),
        "sequence_length": int(tokens.shape[1]),
        "seed": seed,
        "n_bootstrap": n_bootstrap,
        "models": per_model,
        "tables": [str(p) for p in written],
        "figures": [str(p) for p in figures],
    }
    summary["summary_path"] = str(write_summary(summary, out_dir, "dla_summary"))
    return summary
