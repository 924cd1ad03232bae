"""Residual-stream norms at position 0 vs the rest, and attention sinks.

**Residual norms.**  The L2 norm over ``d_model`` of the residual stream entering each block
(``resid_pre`` of layers ``0 .. n_layers - 1``) and of the final residual stream (the input of
``ln_f``, reported as layer ``n_layers``), at position 0 and averaged over the other positions.
They are read from the model's own transformers forward (``LoadedModel.hf()``, which computes
exactly the original network), not from a TransformerLens bridge: a LayerNorm model's bridge is in
compatibility mode, whose centred writing weights remove each component's mean over ``d_model``
and so change the residual norms.

**Attention sinks.**  ``a[l, b, h, q]`` is the attention weight that query position ``q`` of head
``h`` in layer ``l`` puts on key position 0, in sequence ``b``.  Two definitions of a sink rate,
both with a threshold τ (default 0.3):

* ``"head_mean"`` (Gu et al. 2024, *When Attention Sink Emerges in Language Models*): per head,
  the mean of ``a`` over sequences and query positions; a head is a sink head when that mean
  exceeds τ; the rate is the share of sink heads.
* ``"per_query"`` (the reference code's definition): the share of (sequence, head, query
  position) triples with ``a > τ``; per head, the same share over its (sequence, query) pairs.

Query position 0 is excluded by default from both (``exclude_first_query=True``): a causal query
at position 0 can only attend to itself, so ``a[..., 0] == 1`` always and would count as a sink
for any τ < 1, adding a floor of ``1 / n_pos`` that says nothing about the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from lnfree.arch import architecture
from lnfree.analysis.common import AnalysisModel, bridge_of, write_figure
from lnfree.analysis.palette import model_colours
from lnfree.evaluate.results import bootstrap_ci, write_summary, write_table
from lnfree.forms.bridge import LAST_POSITION_LOGITS, hook_name
from lnfree.errors import UsageError

__all__ = [
    "DEFAULT_THRESHOLD",
    "SINK_DEFINITIONS",
    "attention_to_first",
    "head_mean_attention",
    "per_query_share",
    "residual_norms",
    "residual_stream",
    "run",
    "sink_rate",
]

DEFAULT_THRESHOLD = 0.3
SINK_DEFINITIONS = ("head_mean", "per_query")


# ----------------------------------------------------------------------------------------------
# Residual norms
# ----------------------------------------------------------------------------------------------


def residual_stream(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The residual stream of a transformers model ``[n_layers + 1, n_seq, n_pos, d_model]``.

    Entries ``0 .. n_layers - 1`` are the inputs of the blocks (``hidden_states[l]`` of
    ``output_hidden_states=True``); entry ``n_layers`` is the input of the final norm (the final
    residual stream; transformers' last hidden state is taken *after* it).  No gradients; the
    unembedding computes the last position's logits only (``logits_to_keep=1``): none are read here.
    """
    arch = architecture(model)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    captured: list[torch.Tensor] = []
    final = model.get_submodule(arch.final_norm)
    handle = final.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
    try:
        with torch.no_grad():
            device = next(model.parameters()).device
            out = model(input_ids=tokens.to(device), output_hidden_states=True, logits_to_keep=1)
    finally:
        handle.remove()
    if len(captured) != 1:  # pragma: no cover - guards a transformers behaviour change
        raise RuntimeError(f"the final norm ran {len(captured)} times in one forward")
    return torch.stack([*out.hidden_states[:arch.n_layers], captured[0]])


def residual_norms(model: Any, tokens: torch.Tensor, *, batch_size: int = 8) -> torch.Tensor:
    """L2 norms of :func:`residual_stream` over ``d_model``: ``[n_layers + 1, n_seq, n_pos]`` (float32)."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    norms = []
    for start in range(0, tokens.shape[0], batch_size):
        resid = residual_stream(model, tokens[start:start + batch_size])
        norms.append(torch.linalg.vector_norm(resid.float(), dim=-1).cpu())
    return torch.cat(norms, dim=1)


def _norm_rows(norms: torch.Tensor, label: str, *, seed: int, n_resamples: int) -> list[dict]:
    """Tidy rows: per layer, mean norm at position 0 and over positions 1.. (with sequence-bootstrap CIs)."""
    n_sites = norms.shape[0]
    rows = []
    for layer in range(n_sites):
        site = "final" if layer == n_sites - 1 else "resid_pre"
        per_seq = {"0": norms[layer, :, 0].double().numpy(), "1+": norms[layer, :, 1:].double().mean(-1).numpy()}
        for positions, values in per_seq.items():
            low, high = bootstrap_ci(values, n_resamples=n_resamples, seed=seed)
            rows.append({"model": label, "layer": layer, "site": site, "positions": positions,
                         "mean_norm": float(values.mean()), "ci_low": low, "ci_high": high,
                         "n_sequences": int(values.shape[0])})
    return rows


# ----------------------------------------------------------------------------------------------
# Attention sinks
# ----------------------------------------------------------------------------------------------


def attention_to_first(bridge: Any, tokens: torch.Tensor, *, batch_size: int = 8) -> torch.Tensor:
    """Attention to key position 0, ``[n_layers, n_seq, n_heads, n_pos]`` (query positions last).

    Read from each layer's ``attn.hook_pattern`` of a TransformerLens bridge (the pattern is the
    same with or without compatibility mode: folding LayerNorm does not change it); the unembedding
    sees only the last position (no logits are read).
    """
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    n_layers = bridge.cfg.n_layers
    batches = []
    for start in range(0, tokens.shape[0], batch_size):
        store: dict[int, torch.Tensor] = {}

        def saver(layer: int):
            def fn(pattern: torch.Tensor, hook: Any) -> None:
                store[layer] = pattern[..., 0].detach().float().cpu()  # [batch, head, query]

            return fn

        hooks = [*((hook_name("pattern", layer), saver(layer)) for layer in range(n_layers)), LAST_POSITION_LOGITS]
        with torch.no_grad(), bridge.hooks(fwd_hooks=hooks):
            bridge(tokens[start:start + batch_size].to(bridge.cfg.device), return_type=None)
        if len(store) != n_layers:  # pragma: no cover - guards a TL behaviour change
            raise RuntimeError(f"attention patterns of {n_layers - len(store)} layers were not captured")
        batches.append(torch.stack([store[layer] for layer in range(n_layers)]))
    return torch.cat(batches, dim=1)


def _queries(attn0: torch.Tensor, exclude_first_query: bool) -> torch.Tensor:
    attn0 = torch.as_tensor(attn0)
    if attn0.ndim != 4:
        raise UsageError(f"expected attention to position 0 as [layer, seq, head, query], got {tuple(attn0.shape)}")
    if exclude_first_query:
        if attn0.shape[-1] < 2:
            raise UsageError("need at least two query positions when excluding query 0")
        return attn0[..., 1:]
    return attn0


def head_mean_attention(attn0: torch.Tensor, *, exclude_first_query: bool = True) -> torch.Tensor:
    """Per head, attention to position 0 averaged over sequences and query positions: ``[layer, head]``."""
    return _queries(attn0, exclude_first_query).double().mean(dim=(1, 3))


def per_query_share(
    attn0: torch.Tensor, *, threshold: float = DEFAULT_THRESHOLD, exclude_first_query: bool = True,
) -> torch.Tensor:
    """Per head, the share of (sequence, query) pairs whose attention to position 0 exceeds ``threshold``."""
    return (_queries(attn0, exclude_first_query) > threshold).double().mean(dim=(1, 3))


def sink_rate(
    attn0: torch.Tensor, definition: str, *, threshold: float = DEFAULT_THRESHOLD, exclude_first_query: bool = True,
) -> float:
    """Attention sink rate of ``attn0 [layer, seq, head, query]`` under a named definition.

    ``"head_mean"``: share of heads whose :func:`head_mean_attention` exceeds ``threshold``.
    ``"per_query"``: share of (sequence, head, query) triples above ``threshold`` (every head
    has the same number of triples, so it is also the mean of :func:`per_query_share`).
    """
    if definition == "head_mean":
        return float((head_mean_attention(attn0, exclude_first_query=exclude_first_query) > threshold)
                     .double().mean())
    if definition == "per_query":
        return float(per_query_share(attn0, threshold=threshold, exclude_first_query=exclude_first_query).mean())
    raise UsageError(f"unknown sink definition {definition!r}; known: {SINK_DEFINITIONS}")


# ----------------------------------------------------------------------------------------------
# Figures and run()
# ----------------------------------------------------------------------------------------------


def _norm_figure(table):
    import plotly.graph_objects as go

    figure = go.Figure()
    colours = model_colours(list(dict.fromkeys(table["model"])))
    for (label, positions), part in table.groupby(["model", "positions"], sort=False):
        part = part.sort_values("layer")
        figure.add_scatter(
            x=part["layer"], y=part["mean_norm"], mode="lines+markers",
            name=f"{label}, position {'0' if positions == '0' else '1+ (mean)'}",
            line={"dash": "solid" if positions == "0" else "dot", "color": colours[label]},
            error_y={"type": "data", "array": part["ci_high"] - part["mean_norm"],
                     "arrayminus": part["mean_norm"] - part["ci_low"]},
        )
    n_layers = int(table["layer"].max())
    figure.update_layout(
        title="Residual-stream L2 norm: position 0 vs the other positions",
        xaxis={"title": "layer (resid_pre; last = final residual, input of ln_f)",
               "tickvals": list(range(n_layers + 1)),
               "ticktext": [str(i) for i in range(n_layers)] + ["final"]},
        yaxis={"title": "‖resid‖₂", "type": "log"},
    )
    return figure


def _sink_heatmap(matrix: np.ndarray, label: str, threshold: float):
    import plotly.graph_objects as go

    n_layers, n_heads = matrix.shape
    figure = go.Figure(go.Heatmap(
        z=matrix, x=[f"H{h}" for h in range(n_heads)], y=[f"L{layer}" for layer in range(n_layers)],
        zmin=0, zmax=1, colorscale="Viridis", colorbar={"title": "attn to pos 0"},
        hovertemplate="layer %{y}, head %{x}: %{z:.3f}<extra></extra>",
    ))
    figure.update_layout(
        title=f"{label}: mean attention to position 0 per head (queries 1.., sink if > {threshold:g})",
        xaxis_title="head", yaxis_title="layer", yaxis_autorange="reversed",
    )
    return figure


def run(
    models: list[AnalysisModel], out_dir: str | Path, *, tokens: torch.Tensor, seed: int = 0,
    threshold: float = DEFAULT_THRESHOLD, exclude_first_query: bool = True, n_bootstrap: int = 1000,
    batch_size: int = 8,
) -> dict:
    """Residual norms (position 0 vs rest) and attention sink rates for every model on ``tokens``.

    Files in ``out_dir``: ``residual_norms.csv`` (model × layer × position group "0"/"1+", mean
    norm with a bootstrap CI over sequences), ``attention_sinks_heads.csv`` (model × layer × head:
    head-mean attention to position 0, per-query share above τ, sink flag), ``attention_sinks.csv``
    (model × definition: rate), figures ``residual_norms.html`` and ``attention_to_first_<label>.html``,
    and ``residual_summary.json`` (returned).
    """
    import pandas as pd

    out_dir = Path(out_dir)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    norm_rows, head_rows, rate_rows, figures, per_model = [], [], [], [], {}
    for model in models:
        norms = residual_norms(model.loaded.hf(), tokens, batch_size=batch_size)
        rows = _norm_rows(norms, model.label, seed=seed, n_resamples=n_bootstrap)
        norm_rows += rows
        with bridge_of(model) as bridge:
            attn0 = attention_to_first(bridge, tokens, batch_size=batch_size)
        means = head_mean_attention(attn0, exclude_first_query=exclude_first_query)
        shares = per_query_share(attn0, threshold=threshold, exclude_first_query=exclude_first_query)
        n_layers, n_heads = means.shape
        for layer in range(n_layers):
            for head in range(n_heads):
                head_rows.append({
                    "model": model.label, "layer": layer, "head": head,
                    "mean_attention_to_first": float(means[layer, head]),
                    "per_query_share": float(shares[layer, head]),
                    "head_mean_sink": bool(means[layer, head] > threshold),
                })
        rates = {d: sink_rate(attn0, d, threshold=threshold, exclude_first_query=exclude_first_query)
                 for d in SINK_DEFINITIONS}
        for definition, rate in rates.items():
            rate_rows.append({"model": model.label, "definition": definition, "threshold": threshold,
                              "exclude_first_query": exclude_first_query, "sink_rate": rate})
        by_layer = {(r["layer"], r["positions"]): r["mean_norm"] for r in rows}
        ratios = [by_layer[(layer, "0")] / by_layer[(layer, "1+")] for layer in range(n_layers + 1)]
        per_model[model.label] = {
            "ln_free": bool(model.ln_free),
            "sink_rate": rates,
            "norm_position_0": [by_layer[(layer, "0")] for layer in range(n_layers + 1)],
            "norm_other_positions": [by_layer[(layer, "1+")] for layer in range(n_layers + 1)],
            # per layer (entry 0: the embedding, which position 0 shares with every token in RoPE families)
            "norm_ratio_position_0": ratios,
            "max_norm_ratio_position_0": max(ratios),
            "max_norm_ratio_position_0_after_block_0": max(ratios[1:]),
        }
        figures += write_figure(_sink_heatmap(means.numpy(), model.label, threshold), out_dir,
                                f"attention_to_first_{model.label}")
    norm_table = pd.DataFrame(norm_rows)
    written = [write_table(norm_table, out_dir, "residual_norms"),
               write_table(pd.DataFrame(head_rows), out_dir, "attention_sinks_heads"),
               write_table(pd.DataFrame(rate_rows), out_dir, "attention_sinks")]
    figures += write_figure(_norm_figure(norm_table), out_dir, "residual_norms")
    summary = {
        "analysis": "residual_norms_and_attention_sinks",
        "n_sequences": int(tokens.shape[0]),
        "sequence_length": int(tokens.shape[1]),
        "seed": seed,
        "threshold": threshold,
        "exclude_first_query": exclude_first_query,
        "sink_definitions": {
            "head_mean": "share of heads whose attention to position 0, averaged over sequences and "
                         "query positions, exceeds the threshold (Gu et al. 2024)",
            "per_query": "share of (sequence, head, query position) triples whose attention to "
                         "position 0 exceeds the threshold (reference code)",
        },
        "norm_layers": "resid_pre of layers 0..n_layers-1, then the final residual (input of ln_f)",
        "models": per_model,
        "tables": [str(p) for p in written],
        "figures": [str(p) for p in figures],
    }
    summary["summary_path"] = str(write_summary(summary, out_dir, "residual_summary"))
    return summary
