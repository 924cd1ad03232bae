"""A bound on every MLP neuron's gain, read from the weights alone (`train.neuron_gain`).

Once its input norm is fixed, a gated MLP neuron's output grows with the square of its input's scale:
for a large input s·v (v of unit norm), silu or gelu of the gate is about linear, and the neuron writes
s² (g·v)(u·v) d, whose largest size over v is s² |g| |u| (1 + |cos(g, u)|) / 2 |d| (v bisecting g and ±u), with
g and u the gate and up rows (the input norm's weight folded in) and d the output column: the neuron's *gain*
(a non-gated MLP's: |w| |d|, linear in s). In SmolLM2-135M the neurons of largest gain are exactly those that
write and erase its massive activations: block 2's 90 and 430 (15.7× and 9.3× the block's median gain;
no other neuron of blocks 0–10 is above 6.5×), block 11's 1229 and 1487 (28×, 16×), block 27's 903 and
block 28's 678 (86×, 120×; `experiments/smollm2/neuron_gain.py`). The first two also write the tokens that
run away when ln_2 are fixed. A loss on activations sees such a token only when the text holds one; this
one acts on the weights, on every token, seen or not. (Measured there: bounded at 4× the median, as a loss
or projected, they still write the runaway tokens, whose input is the larger part of the product;
`experiments/results/smollm2-135m/README.md`.)

The loss is Σ over blocks and neurons of max(0, log gain − log(ratio × the block's median gain))², the
median taken from the current weights and detached (no reference to keep: the same on every resume), so
it pulls the outliers towards the block's typical neuron and leaves the rest alone. Alignment of gate and
up (Smooth-SwiGLU, arXiv 2409.12517, traces SwiGLU outliers to it) is part of the gain.

A loss moves the weights about one learning rate a step (Adam): on SmolLM2-135M, 200 steps of this loss
alone at a fine-tuning rate of 1e-4 take the summed excess from 30.6 to 28.9 (block 2's from 2.58 to 2.26).
`project` bounds the gains at once instead: after every optimiser step each neuron above the bound has its
output row scaled down to it, which scales what the neuron writes, for every input, by the same factor.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from lnfree.arch import architecture
from lnfree.arch.base import in_out
from lnfree.fixedscale.norms import FixedScaleNorm
from lnfree.removal.losses.sharded import gathered, scale_


class NeuronGain(BaseModel):
    """The bound's settings (`train.neuron_gain`; a list of them by `start`, as `train.scale_tail`)."""

    model_config = ConfigDict(extra="forbid")
    ratio: float = Field(4.0, gt=1, description="gains above this many times their block's median gain are pulled "
                         "back")
    weight: float = Field(1.0, ge=0, description="its weight in the loss")
    start: int = Field(0, ge=0, description="the first step it is on")
    project: bool = Field(False, description="also scale, after every optimiser step, each neuron's output row "
                          "down to the bound (its weight must still be > 0 for the setting to be on)")


class GainWeights:
    """Per block, the weights that set its MLP neurons' gains: the input projections, the output projection
    and the MLP-input norm (None in a family without one), of an installed model or a plain one."""

    def __init__(self, model: nn.Module):
        arch = architecture(model)
        norms = {site.layer: site.module for site in arch.sites() if site.stage == "ln_2"}
        self.conv1d, self.offset = arch.conv1d, arch.norm_weight_offset
        self.blocks = []
        for layer in range(arch.n_layers):
            inputs, output = arch.neurons(layer)
            norm = model.get_submodule(norms[layer]) if layer in norms else None
            self.blocks.append(([model.get_submodule(p) for p in inputs], model.get_submodule(output), norm))

    def gains(self) -> list[torch.Tensor]:
        """Per block, each neuron's gain (fp32, differentiable in the weights, gathered where FSDP shards them)."""
        return [neuron_gains([in_out(gathered(p.weight), self.conv1d).t() for p in inputs],
                             in_out(gathered(output.weight), self.conv1d),
                             self.norm_weight(norm))
                for inputs, output, norm in self.blocks]

    def norm_weight(self, norm: nn.Module | None) -> torch.Tensor | None:
        """What the norm multiplies by: an installed norm holds it, a plain one may store it less an offset
        (Gemma's weight − 1)."""
        if norm is None:
            return None
        weight = gathered(norm.weight)
        return weight if isinstance(norm, FixedScaleNorm) else weight + self.offset


def neuron_gains(rows: list[torch.Tensor], out: torch.Tensor, norm_weight: torch.Tensor | None) -> torch.Tensor:
    """Gains of one MLP's neurons: `rows` the input projections as (neurons, hidden) (gate first, then up,
    for a gated MLP), `out` the output projection as (neurons, hidden), `norm_weight` the input norm's
    weight as it multiplies (installed norms hold it so) or None."""
    rows = [r.float() if norm_weight is None else r.float() * norm_weight.float() for r in rows]
    out_norm = out.float().norm(dim=1)
    if len(rows) == 1:
        return rows[0].norm(dim=1) * out_norm
    gate, up = rows
    gate_norm, up_norm = gate.norm(dim=1), up.norm(dim=1)
    cos = (gate * up).sum(1) / (gate_norm * up_norm).clamp_min(1e-30)
    return gate_norm * up_norm * (1 + cos.abs()) / 2 * out_norm


def neuron_gain_loss(gains: list[torch.Tensor], ratio: float) -> torch.Tensor:
    """Σ over blocks and neurons of max(0, log(gain / (ratio × the block's detached median gain)))²."""
    total = torch.zeros((), device=gains[0].device)
    for gain in gains:
        log_gain = gain.clamp_min(1e-30).log()
        excess = log_gain - (log_gain.detach().median() + math.log(ratio))
        total = total + excess.clamp_min(0).pow(2).sum()
    return total


@torch.no_grad()
def project_gains(weights: GainWeights, ratio: float) -> None:
    """Scale the output row of every neuron whose gain exceeds `ratio` × its block's median gain so that its
    gain is that bound (what it writes scales by the same factor for every input), in place."""
    for gain, (_, output, _) in zip(weights.gains(), weights.blocks, strict=True):
        factor = ((ratio * gain.median()) / gain).clamp(max=1.0).to(output.weight.dtype)
        scale_(output.weight, factor[:, None] if weights.conv1d else factor[None, :])  # each neuron's output row
