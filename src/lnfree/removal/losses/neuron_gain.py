"""A bound on every MLP neuron's gain, read from the weights alone (`train.neuron_gain`).

Once its input norm is fixed, a gated MLP neuron's output grows with the square of its input's scale:
for a large input s·v (v of unit norm), silu or gelu of the gate is about linear, and the neuron writes
s² (g·v)(u·v) d, whose largest size over v is s² |g| |u| (1 + |cos(g, u)|) / 2 |d| (v bisecting g and ±u), with
g and u the gate and up rows (the input norm's weight folded in) and d the output column: the neuron's *gain*
(a non-gated MLP's: |w| |d|, linear in s). In SmolLM2-135M the neurons of largest gain are exactly those that
write and erase its massive activations: block 2's 90 and 430 (15.7× and 9.3× the block's median gain;
no other neuron of blocks 0–10 is above 6.5×), block 11's 1229 and 1487 (28×, 16×), block 27's 903 and
block 28's 678 (86×, 120×; `experiments/results/smollm2-135m/neuron_gain/`) (`experiments/smollm2/neuron_gain.py`). The first two also write the tokens that
run away when ln_2 are fixed (`experiments/results/smollm2-135m/`). A loss on activations sees such a token
only when the text holds one; this one acts on the weights, so it bounds every token, seen or not.

The loss is Σ over blocks and neurons of max(0, log gain − log(ratio × the block's median gain))², the
median taken from the current weights and detached (no reference to keep: the same on every resume), so
it pulls the outliers towards the block's typical neuron and leaves the rest alone. Alignment of gate and
up (Smooth-SwiGLU, arXiv 2409.12517, traces SwiGLU outliers to it) is part of the gain.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from lnfree.arch import architecture
from lnfree.arch.base import in_out
from lnfree.fixedscale.norms import FixedScaleNorm


class NeuronGain(BaseModel):
    """The bound's settings (`train.neuron_gain`; a list of them by `start`, as `train.scale_tail`)."""

    model_config = ConfigDict(extra="forbid")
    ratio: float = Field(4.0, gt=1, description="gains above this many times their block's median gain are pulled "
                         "back")
    weight: float = Field(1.0, ge=0, description="its weight in the loss")
    start: int = Field(0, ge=0, description="the first step it is on")


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
        """Per block, each neuron's gain (fp32, differentiable in the weights)."""
        return [neuron_gains([in_out(p.weight, self.conv1d).t() for p in inputs], in_out(output.weight, self.conv1d),
                             self.norm_weight(norm))
                for inputs, output, norm in self.blocks]

    def norm_weight(self, norm: nn.Module | None) -> torch.Tensor | None:
        """What the norm multiplies by: an installed norm holds it, a plain one may store it less an offset
        (Gemma's weight − 1)."""
        if norm is None or isinstance(norm, FixedScaleNorm):
            return None if norm is None else norm.weight
        return norm.weight + self.offset


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
