"""A hinge that keeps every MLP neuron within a multiple of its range in the original model (`train.neuron_range`).

With its norms fixed, a gated MLP's output grows with the square of its input, and a neuron that the
original kept small can grow far past anything it did before: in Gemma 3 270M part-way through a
removal, ' possible' drove block 4's neuron 1830 to 270× its largest activation at any other
position of the sequence while the MLP's input was only 1.8× the median token's, and the blocks above
overflowed (experiments/results/gemma3-270m/robust/). The hinge measures each neuron's range on the
frozen original (the distillation teacher: the same numbers on every resume, nothing to store) and
pulls back every activation above `ratio` × that range.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from lnfree.arch import architecture
from lnfree.removal.losses.massive import Captured


class NeuronRange(BaseModel):
    """The hinge's settings (`train.neuron_range`; a list of them by `start`, as `train.scale_tail`)."""

    model_config = ConfigDict(extra="forbid")
    ratio: float = Field(8.0, gt=1, description="activations above this many times the neuron's range in the "
                         "original are pulled back")
    weight: float = Field(1.0, ge=0, description="its weight in the loss")
    start: int = Field(0, ge=0, description="the first step it is on")


class NeuronActivations(Captured):
    """Keeps every block's MLP neuron activations (the input of its output projection) of the latest forward."""

    def __init__(self, model: nn.Module):
        arch = architecture(model)
        super().__init__([model.get_submodule(arch.neurons(i)[1]) for i in range(arch.n_layers)])
        self.handles = [module.register_forward_pre_hook(self.keep_input) for module in self.modules]


@torch.no_grad()
def neuron_ranges(model: nn.Module, batches, autocast) -> list[torch.Tensor]:
    """Per block, each neuron's largest |activation| at the positions after the first over `batches` of
    ids (fp32, on the model's device), at least the block's median over neurons: a neuron that the few
    probe batches barely woke is not pinned near zero (Gemma 3 270M, 2,016 probe tokens: the original
    itself exceeds 8× these ranges at 7e-7 of its activations on held-out text, 3.5e-6 without the
    floor). Position 0's massive activations are its own business."""
    activations = NeuronActivations(model)
    ranges: list[torch.Tensor] | None = None
    try:
        for ids in batches:
            activations.clear()
            with autocast():
                model(input_ids=ids, use_cache=False)
            peaks = [a[:, 1:].float().abs().flatten(0, 1).amax(0) for a in activations.take()]
            ranges = peaks if ranges is None else [torch.maximum(r, p) for r, p in zip(ranges, peaks)]
    finally:
        activations.remove()
        activations.clear()
    if ranges is None:
        raise ValueError("neuron_ranges needs at least one batch")
    return [torch.maximum(r, r.median()) for r in ranges]


def neuron_range_loss(activations: list[torch.Tensor], ranges: list[torch.Tensor], ratio: float) -> torch.Tensor:
    """Sum over blocks, tokens (position 0 aside) and neurons of max(0, log(|a| / (ratio × range)))², per
    sequence: a sum, as `lnfree.removal.losses.massive.scale_tail_loss`, so one runaway neuron weighs like a sequence's CE."""
    total = torch.zeros((), device=activations[0].device)
    for a, limit in zip(activations, ranges, strict=True):
        log_a = a[:, 1:].float().abs().clamp_min(1e-30).log()
        excess = log_a - (limit.clamp_min(1e-30).log() + math.log(ratio))
        total = total + excess.clamp_min(0).pow(2).sum()
    return total / activations[0].shape[0]
