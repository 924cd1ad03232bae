"""What :func:`lnfree.analysis.patching.run.run` writes: the tables' rows, the figures and each model's summary."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lnfree.analysis.common import write_figure
from lnfree.analysis.palette import BAR_LABEL, quantity_colour
from lnfree.analysis.patching.agreement import agreement_per_prompt, agreement_summary
from lnfree.analysis.patching.methods import PatchingResult
from lnfree.evaluate.results import write_table

__all__ = ["agreement_rows", "cell_rows", "model_summary", "prompt_rows", "write_figures", "write_tables"]

_GRID_NAMES = {"resid_pre": "resid_pre (layer x position)", "z": "attention heads (layer x head)"}


def model_summary(ln_free: bool, result: PatchingResult, kinds: Sequence[str], *, n_bootstrap: int,
                  seed: int) -> dict[str, Any]:
    """One model's entry in ``patching_summary.json``: its prompts, logit differences and agreement per kind."""
    prompts = result.prompts
    return {
        "ln_free": bool(ln_free),
        "n_prompts": len(prompts),
        "templates_dropped": prompts.dropped_templates,  # templates whose tokens do not align with the rest
        "clean_logit_diff_mean": float(result.clean_ld.mean()),
        "corrupted_logit_diff_mean": float(result.corrupted_ld.mean()),
        "ioi_accuracy_clean": float((result.clean_ld > 0).float().mean()),
        "min_abs_gap": float(result.gap.abs().min()),
        "agreement": {kind: agreement_summary(result.activation[kind], result.attribution[kind], result.changed[kind],
                                              units=prompts.pair, n_bootstrap=n_bootstrap, seed=seed)
                      for kind in kinds},
    }  # fmt: skip


def agreement_rows(label: str, agreement: dict[str, dict[str, Any]]) -> list[dict]:
    """Rows of ``patching_agreement.csv`` for one model: one per kind and statistic, with its CI."""
    return [{"model": label, "kind": kind, "statistic": stat, **val, "n_prompts": agree["n_prompts"],
             "n_units": agree["n_units"], "n_cells": agree["n_cells"]}
            for kind, agree in agreement.items() for stat, val in agree.items() if isinstance(val, dict)]  # fmt: skip


def cell_rows(label: str, result: PatchingResult) -> list[dict]:
    """Rows of ``patching_cells.csv`` for one model: one per kind, prompt, layer and cell (normalised values)."""
    p = result.prompts
    rows = []
    for kind in result.activation:
        act, att, changed = result.activation[kind], result.attribution[kind], result.changed[kind]
        n, n_layers, n_cells = act.shape
        for i in range(n):
            for layer in range(n_layers):
                for c in range(n_cells):
                    rows.append({
                        "model": label, "kind": kind, "prompt": i, "pair": p.pair[i], "order": p.orders[i],
                        "layer": layer, "cell": c,
                        "cell_label": p.position_labels[c] if kind == "resid_pre" else f"H{c}",
                        "activation": float(act[i, layer, c]), "attribution": float(att[i, layer, c]),
                        "changed": bool(changed[i, layer, c]),
                    })  # fmt: skip
    return rows


def prompt_rows(label: str, result: PatchingResult) -> list[dict]:
    """Rows of ``patching_prompts.csv`` for one model: each prompt, its logit differences, NMAE and r per kind."""
    p = result.prompts
    per_kind = {k: agreement_per_prompt(result.activation[k], result.attribution[k], result.changed[k])
                for k in result.activation}  # fmt: skip
    rows = []
    for i in range(len(p)):
        row = {
            "model": label, "prompt": i, "pair": p.pair[i], "order": p.orders[i], "template": p.templates[i],
            "clean": p.clean_texts[i], "corrupted": p.corrupted_texts[i], "io": p.io_names[i], "s": p.s_names[i],
            "clean_logit_diff": float(result.clean_ld[i]), "corrupted_logit_diff": float(result.corrupted_ld[i]),
            "gap": float(result.gap[i]),
        }  # fmt: skip
        for k, (nmae, r) in per_kind.items():
            row[f"nmae_{k}"], row[f"pearson_r_{k}"] = float(nmae[i]), float(r[i])
        rows.append(row)
    return rows


def _heatmap_figure(label: str, result: PatchingResult):
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go

    kinds = list(result.activation)
    titles = [f"{method} patching: {_GRID_NAMES.get(k, k)}" for k in kinds for method in ("activation", "attribution")]
    fig = make_subplots(rows=len(kinds), cols=2, subplot_titles=titles, horizontal_spacing=0.12, vertical_spacing=0.18)
    p = result.prompts
    for r, kind in enumerate(kinds, start=1):
        act = result.activation[kind].mean(0).numpy()
        att = result.attribution[kind].mean(0).numpy()
        bound = float(max(np.abs(act).max(), np.abs(att).max(), 1e-9))
        x = ([f"{i}:{lab}" for i, lab in enumerate(p.position_labels)] if kind == "resid_pre"
             else [f"H{h}" for h in range(act.shape[1])])  # fmt: skip
        y = [f"L{layer}" for layer in range(act.shape[0])]
        for c, grid in enumerate((act, att), start=1):
            fig.add_trace(go.Heatmap(
                z=grid, x=x, y=y, zmin=-bound, zmax=bound, colorscale="RdBu", reversescale=True,
                colorbar={"len": 0.4, "y": 1 - (r - 0.5) / len(kinds), "title": "norm."}, showscale=c == 2,
                hovertemplate="%{y} %{x}: %{z:.3f}<extra></extra>",
            ), row=r, col=c)  # fmt: skip
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=f"{label}: IOI patching, mean over {len(p)} prompts (1 = the clean−corrupted gap)",
                      height=380 * len(kinds))  # fmt: skip
    return fig


def _scatter_figure(results: dict[str, PatchingResult]):
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go

    labels = list(results)
    kinds = list(next(iter(results.values())).activation) if results else []
    fig = make_subplots(rows=len(kinds), cols=len(labels), subplot_titles=[
        f"{label}: {k}" for k in kinds for label in labels])  # fmt: skip
    for r, kind in enumerate(kinds, start=1):
        for c, label in enumerate(labels, start=1):
            res = results[label]
            keep = res.changed[kind].numpy()
            a = res.activation[kind].numpy()[keep]
            b = res.attribution[kind].numpy()[keep]
            lo, hi = float(min(a.min(initial=0), b.min(initial=0))), float(max(a.max(initial=0), b.max(initial=0)))
            fig.add_trace(go.Scattergl(x=a, y=b, mode="markers",
                                       marker={"size": 3, "opacity": 0.5, "color": quantity_colour(kind)},
                                       name=f"{label} {kind}", showlegend=False), row=r, col=c)  # fmt: skip
            fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", line={"dash": "dot", "color": "grey"},
                                     showlegend=False), row=r, col=c)  # fmt: skip
            fig.update_xaxes(title_text="activation patching", row=r, col=c)
            fig.update_yaxes(title_text="attribution patching", row=r, col=c)
    fig.update_layout(title="Attribution vs activation patching per cell and prompt (normalised)",
                      height=420 * max(len(kinds), 1))  # fmt: skip
    return fig


def _agreement_figure(table: list[dict]):
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go

    stats = ("nmae", "pearson_r")
    titles = ["NMAE (global, lower is better)", "Pearson r (mean per prompt)"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=titles)
    kinds = list(dict.fromkeys(r["kind"] for r in table))
    for c, stat in enumerate(stats, start=1):
        for kind in kinds:
            rows = [r for r in table if r["kind"] == kind and r["statistic"] == stat]
            fig.add_trace(go.Bar(
                x=[r["model"] for r in rows], y=[r["value"] for r in rows], name=kind, legendgroup=kind,
                showlegend=c == 1, marker_color=quantity_colour(kind), **BAR_LABEL,
                error_y={"type": "data", "symmetric": False,
                         "array": [r["ci_high"] - r["value"] for r in rows],
                         "arrayminus": [r["value"] - r["ci_low"] for r in rows]},
            ), row=1, col=c)  # fmt: skip
    fig.update_layout(barmode="group", title="Attribution vs activation patching agreement (95% bootstrap CI)",
                      height=450)  # fmt: skip
    return fig


def write_tables(out_dir: Path, cells: list[dict], prompts: list[dict], agreement: list[dict]) -> list[Path]:
    """Write ``patching_cells.csv``, ``patching_prompts.csv`` and ``patching_agreement.csv``; their paths."""
    import pandas as pd

    return [
        write_table(pd.DataFrame(cells), out_dir, "patching_cells"),
        write_table(pd.DataFrame(prompts), out_dir, "patching_prompts"),
        write_table(pd.DataFrame(agreement), out_dir, "patching_agreement"),
    ]


def write_figures(out_dir: Path, results: dict[str, PatchingResult], agreement: list[dict]) -> list[Path]:
    """Write the heatmaps of each model, then the scatter and agreement figures of all; the files written."""
    figures: list[Path] = []
    for label, result in results.items():
        figures += write_figure(_heatmap_figure(label, result), out_dir, f"patching_heatmaps_{label}")
    if results:
        figures += write_figure(_scatter_figure(results), out_dir, "patching_scatter")
        figures += write_figure(_agreement_figure(agreement), out_dir, "patching_agreement")
    return figures
