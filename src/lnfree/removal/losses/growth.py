"""A hinge on how much each MLP sublayer amplifies a token that arrives too large (`train.local_growth`).

With h the residual entering a block's MLP sublayer and M(h) what the sublayer adds to it (its input norm,
the MLP, its output norm where the family has one), all with their norms fixed at their current σ, a token
scaled by c leaves the sublayer with

    r_c = |c·h + M(c·h)| / (c·|h + M(h)|),    g_c = 1 + log(r_c) / log(c),

the factor by which the sublayer multiplies the token's log-excess of scale log(c). A real norm makes M
scale-invariant (g_c < 1: an excess shrinks), a GELU MLP behind a fixed norm is about 1-homogeneous (g_c ≈ 1:
this project's LN-free GPT-2s stay bounded on every token id), a gated MLP behind one grows with c² (g_c up to
about 2). Blocks with g_c above 1
compound a small excess into an overflow: in SmolLM2-135M the original's g_2 has medians 1.06-1.15 in blocks
1-11 (2.16 in block 0) and 1.00-1.03 in blocks 12-28, where every removal ran fine top-down and broke once
blocks 12-9 were fixed (`experiments/robust/local_growth.py`, `experiments/results/smollm2-135m/`).

From step `start`, every block is measured this way on `tokens` of each text micro-batch's tokens (position 0
aside, an even stride over the rest; h detached, so the loss acts on the sublayer's own weights), also the
blocks whose norms are still real (as they will be once fixed: a preview of every switch ahead), and each
token adds max(0, g_c − `limit`)², averaged over the tokens and summed over blocks, times `weight`; logged as
`growth`. The stability margin (`lnfree.removal.losses.margin`) hinges the same growth globally, on one token
of one row at one block per micro-step; this one is local and dense, and costs an MLP forward and backward of
2 × `tokens` tokens per block.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from lnfree.arch import architecture
from lnfree.fixedscale.functional import centred_times, rms_times
from lnfree.removal.losses.massive import Captured
from lnfree.removal.losses.sharded import call_gathered, gathered


class LocalGrowth(BaseModel):
    """The hinge's settings (`train.local_growth`; a list of them by `start`, as `train.scale_tail`)."""

    model_config = ConfigDict(extra="forbid")
    factor: float = Field(2.0, gt=1, description="c: the token's residual is scaled by this")
    limit: float = Field(1.1, gt=0, description="growth factors g_c above this are pulled back")
    tokens: int = Field(64, ge=1, description="text tokens of each micro-batch measured at every block")
    weight: float = Field(1.0, ge=0, description="its weight in the loss")
    start: int = Field(0, ge=0, description="the first step it is on")


class MlpSublayers(Captured):
    """Per block the MLP-input norm, the MLP and the MLP-output norm (None where the family has none) of a
    model with lnfree's norms installed, keeping the input of each MLP-input norm of the latest forward."""

    def __init__(self, model: nn.Module):
        arch = architecture(model)
        by_stage = {(site.stage, site.layer): site.module for site in arch.sites()}
        self.blocks = [(model.get_submodule(by_stage[("ln_2", i)]), model.get_submodule(arch.block(i, arch.mlp)),
                        model.get_submodule(by_stage[("post_mlp", i)]) if ("post_mlp", i) in by_stage else None)
                       for i in range(arch.n_layers)]
        super().__init__([pre for pre, _, _ in self.blocks])
        self.handles = [module.register_forward_pre_hook(self.keep_input) for module in self.modules]

    def added(self, block: int, h: torch.Tensor) -> torch.Tensor:
        """M(h): what block `block`'s MLP sublayer adds to the residual `h`, its norms fixed at their σ (called
        outside the block's forward: its weights gathered where FSDP shards them)."""
        pre, mlp, post = self.blocks[block]
        out = call_gathered(mlp, fixed_form(pre, h))
        return out if post is None else fixed_form(post, out)


def fixed_form(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An installed norm (`lnfree.fixedscale.norms.FixedScaleNorm`) as it is once fixed: its linear part over
    its σ, whatever its state now (no special σ: the tokens measured are past position 0)."""
    sigma, weight = norm.state.sigma, gathered(norm.weight)
    if norm.state.kind == "rms":
        return rms_times(x, weight, sigma)
    return centred_times(x, weight, None if norm.bias is None else gathered(norm.bias), sigma)


def strided(h: torch.Tensor, n: int) -> torch.Tensor:
    """`n` tokens of (batch, sequence, hidden) `h`, position 0 aside, at an even stride over the rest."""
    flat = h[:, 1:].reshape(-1, h.shape[-1])
    stride = max(1, flat.shape[0] // n)
    return flat[::stride][:n]


def growth_factors(sublayers: MlpSublayers, block: int, h: torch.Tensor, factor: float) -> torch.Tensor:
    """g_c of each token (row) of `h` at `block` (module docstring), with gradient into the sublayer."""
    base = (h + sublayers.added(block, h)).float().norm(dim=-1)
    scaled = (factor * h + sublayers.added(block, factor * h)).float().norm(dim=-1)
    return 1 + (scaled.log() - base.log() - math.log(factor)) / math.log(factor)


def local_growth_loss(sublayers: MlpSublayers, inputs: list[torch.Tensor], setting: LocalGrowth) -> torch.Tensor:
    """Sum over blocks of the mean over the measured tokens of max(0, g_c − limit)² (`inputs`: each block's
    MLP-input norm input from the text forward, as `sublayers.take()` gives them)."""
    total = torch.zeros((), device=inputs[0].device)
    for norm, h in zip(sublayers.sources, inputs, strict=True):
        block = sublayers.modules.index(norm)
        g = growth_factors(sublayers, block, strided(h.detach(), setting.tokens), setting.factor)
        total = total + (g - setting.limit).clamp_min(0).pow(2).mean()
    return total
