"""The figures :func:`lnfree.analysis.entropy_neurons.run.run` writes, drawn from its tables (plotly)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from lnfree.analysis.entropy_neurons.candidates import neuron_label
from lnfree.analysis.palette import model_colours


def figures(tables: dict[str, pd.DataFrame], set_names: list[str]) -> dict[str, Any]:
    """The figures, by file name: ``candidates``, ``ablation_distributions``, ``cumulative_entropy`` and
    ``null_space_spectrum``; ``set_names`` are the ablations in order (single ones first)."""
    models = list(dict.fromkeys(tables["distributions"]["model"]))
    return {
        "candidates": candidates_figure(tables["candidates"]),
        "ablation_distributions": distributions_figure(tables["distributions"], set_names, models),
        "cumulative_entropy": cumulative_entropy_figure(tables["ablations"], set_names, models),
        "null_space_spectrum": null_space_spectrum_figure(tables["null_space_spectrum"]),
    }


def candidates_figure(candidates: pd.DataFrame) -> Any:
    """‖w_out‖ against LogitVar of every neuron, one panel per model, the ablated neurons highlighted."""
    import plotly.express as px

    cand = candidates.copy()
    cand["neuron_label"] = [neuron_label((int(l), int(n))) for l, n in zip(cand["layer"], cand["neuron"])]
    cand["logit_var_floored"] = cand["logit_var"].clip(lower=1e-12)
    return px.scatter(
        cand, x="w_out_norm", y="logit_var_floored", color="selected", facet_col="model", log_y=True,
        hover_data=["neuron_label", "rank", "score", "null_space_fraction"],
        title="Entropy-neuron candidates: ‖w_out‖ vs LogitVar (ablated neurons highlighted; floor 1e-12)",
        labels={"w_out_norm": "‖w_out‖", "logit_var_floored": "LogitVar"})


def distributions_figure(dist: pd.DataFrame, set_names: list[str], models: list[str]) -> Any:
    """Box plots of the per-token |ΔH| and |ΔCE| of each ablation and model, from the quantile table."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    metrics = [("abs_delta_entropy", "|ΔH| (nats)"), ("abs_delta_ce", "|ΔCE| (nats)")]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, subplot_titles=[t for _, t in metrics])
    colours = model_colours(models)
    for row, (metric, _) in enumerate(metrics, start=1):
        for model in models:
            part = dist[(dist["model"] == model) & (dist["metric"] == metric)].set_index("ablation").loc[set_names]
            fig.add_trace(go.Box(
                x=set_names, q1=part["q25"], median=part["median"], q3=part["q75"], lowerfence=part["q05"],
                upperfence=part["q95"], mean=part["mean"], name=model, legendgroup=model, showlegend=row == 1,
                marker_color=colours[model]), row=row, col=1)
    fig.update_layout(boxmode="group", title="Per-token effect of mean ablation (box: quartiles, whiskers: 5–95 %)")
    return fig


def cumulative_entropy_figure(abl: pd.DataFrame, set_names: list[str], models: list[str]) -> Any:
    """Relative change of the mean output entropy against the number of neurons ablated together."""
    import plotly.express as px

    first = abl[abl["ablation"] == set_names[0]]
    curve = pd.concat([
        pd.DataFrame({"model": models, "n_neurons": 0, "relative_entropy_change_percent": 0.0}),
        first[["model", "n_neurons", "relative_entropy_change_percent"]],
        abl[abl["kind"] == "cumulative"][["model", "n_neurons", "relative_entropy_change_percent"]],
    ], ignore_index=True)
    return px.line(
        curve.sort_values(["model", "n_neurons"], kind="stable"), x="n_neurons", y="relative_entropy_change_percent",
        color="model", color_discrete_map=model_colours(models), category_orders={"model": models}, markers=True,
        title="Cumulative mean ablation: change of the mean output entropy",
        labels={"n_neurons": "neurons ablated together (in list order)",
                "relative_entropy_change_percent": "Δ mean entropy (%)"})


def null_space_spectrum_figure(spectrum: pd.DataFrame) -> Any:
    """Each selected neuron's cumulative share of ‖w_out‖² in the bottom-k directions, against k."""
    import plotly.express as px

    return px.line(
        spectrum, x="k", y="cumulative_share", color="neuron", facet_col="model", log_x=True,
        title="Share of ‖w_out‖² in the bottom-k singular directions of W_U (centred, all-ones excluded)",
        labels={"k": "k", "cumulative_share": "share of ‖w_out‖²"})
