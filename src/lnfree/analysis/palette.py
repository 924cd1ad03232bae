"""One colour per model and one per quantity, in every figure of every analysis.

Plotly colours traces in the order they are added, so the same model (or the same patched
quantity) would change colour between figures, and between the panels of one figure, whenever the
order differs. Every figure takes its colours from here instead: the usual labels have fixed
colours, any other label the next unused one of a fixed list, in the order the models were given.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The models a comparison usually holds: the original blue, the vanilla control green, LN-free red.
MODEL_COLOURS = {"original": "#636EFA", "vanilla": "#00CC96", "ln_free": "#EF553B"}
#: Quantities drawn side by side: DLA of heads vs MLPs, patching of the residual stream vs head outputs.
QUANTITY_COLOURS = {"heads": "#AB63FA", "MLPs": "#FFA15A", "resid_pre": "#19D3F3", "z": "#FF6692"}
#: For any other label, in order (none of the colours above).
OTHER_COLOURS = ("#B6E880", "#FF97FF", "#FECB52", "#8C564B", "#7F7F7F", "#17BECF", "#BCBD22", "#1F3A93")
#: Text on bars whose height is near zero (a bar of 1e-7 is invisible): the value, always shown.
BAR_LABEL = {"texttemplate": "%{y:.2g}", "textposition": "outside", "cliponaxis": False}


def model_colours(labels: Sequence[str]) -> dict[str, str]:
    """A colour for each model label: the fixed one of `MODEL_COLOURS`, else the next of `OTHER_COLOURS`."""
    others = iter(OTHER_COLOURS * (1 + len(labels) // len(OTHER_COLOURS)))
    return {label: MODEL_COLOURS.get(label) or next(others) for label in labels}


def quantity_colour(name: str, position: int = 0) -> str:
    """The colour of a quantity (`QUANTITY_COLOURS`), else the `position`-th of `OTHER_COLOURS`."""
    return QUANTITY_COLOURS.get(name) or OTHER_COLOURS[position % len(OTHER_COLOURS)]
