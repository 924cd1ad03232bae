"""A scale ceiling for fixed norms during training: no token leaves a fixed norm above `ratio`× σ.

Once a norm in front of a gated MLP divides by a frozen σ, a token that enters it at r× the typical
scale leaves the MLP at about r²× the typical output, and the next fixed blocks square that again:
SmolLM2-135M's removals ran smoothly for 250 steps and then overflowed within four, after a single
rare token ran away (`experiments/results/smollm2-135m/attempts/`). With a ceiling a fixed (or
blending) norm divides by max(σ, real scale / ratio): exactly the fixed norm for every token below
`ratio`× σ, the real norm times `ratio` above it. The forward stays finite, the token keeps a
gradient, and the scale loss (`train.scale_loss_weight`) pulls it back under the ceiling.

The ceiling is training scaffolding, never part of the model: it is a Python attribute of each
`ScaleState` (not saved), set every step from the config (`at(step)`), so resume is exact. It is
released at the end: from `release_start` it rises geometrically to `ratio` × 1000 over
`release_steps`, then it is gone, and the last steps, evaluation and export see the plain fixed
norms.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from lnfree.fixedscale.state import ScaleState

#: How far the ceiling rises while it is released, before it is removed.
RELEASE_RISE = 1000.0


class ScaleCeiling(BaseModel):
    """Bound each fixed norm's per-token output during training (`removal.scale_ceiling`)."""

    model_config = ConfigDict(extra="forbid")
    ratio: float = Field(8.0, gt=1, description="a fixed norm divides by at least the real per-token scale / ratio")
    release_start: int | None = Field(None, ge=0, description="first step of the release (default: max_steps − "
                                      "2 × release_steps: released, then trained without it)")
    release_steps: int = Field(100, ge=1, description="steps over which the ceiling rises ×1000 before it is removed")
    position0: bool = Field(True, description="bound position 0 too; false: never (it is in every sequence, so the "
                            "loss always sees it, and a bound would hide its growth); needs removal.special_pos0")

    def release_at(self, max_steps: int) -> int:
        """The first step of the release in a run of `max_steps` steps."""
        return self.release_start if self.release_start is not None else max_steps - 2 * self.release_steps

    def at(self, step: int, max_steps: int) -> float:
        """The ceiling at `step` (inf once released)."""
        start = self.release_at(max_steps)
        if step < start:
            return self.ratio
        done = (step - start) / self.release_steps
        return self.ratio * RELEASE_RISE**done if done < 1 else math.inf


def set_ceiling(model: nn.Module, ceiling: float, position0: bool | None = None) -> None:
    """Give every scale state of `model` the ceiling `ceiling` (inf: none); `position0` False spares
    position 0 wherever it has its own σ (None: as it was)."""
    for module in model.modules():
        if isinstance(module, ScaleState):
            module.ceiling = ceiling
            if position0 is not None:
                module.ceiling_spares_pos0 = not position0


@contextlib.contextmanager
def watching(model: nn.Module) -> Iterator[Callable[[], int]]:
    """Count, inside the block, the tokens whose divisor the ceiling raised at any norm of `model`;
    yields a function that returns the count (one device sync). A count of 0 means the forward passes
    in the block computed the model without its ceiling (up to fp32 rounding: the guarded route
    rounds differently)."""
    states = [m for m in model.modules() if isinstance(m, ScaleState)]
    for state in states:
        state.ceiling_hits = torch.zeros((), dtype=torch.long, device=state.sigma.device)
    try:
        yield lambda: int(sum(int(state.ceiling_hits) for state in states))
    finally:
        for state in states:
            state.ceiling_hits = None
