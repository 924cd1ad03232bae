"""Silence position 0's own MLPs (`train.position0_mlp`), so that its σ can fade at the MLP-input norms.

Position 0 (BOS, the attention sink) keeps its own σ at every norm until the `pos0_special` stage
fades it into the general one. At an MLP-input norm that σ is many times the general one (Gemma 3
270M: up to 12.5×), so the fade hands position 0's MLP a growing input; a gated MLP answers
quadratically, position 0's residual grows, and the next block's MLP answers quadratically again,
until it overflows and the other tokens, which read its keys and values, follow. Yet what position
0's MLPs write matters little: on Gemma 3 270M, zeroing it from block 1 up cost +0.11 nats and let
the MLP-input fade go to the end (`experiments/results/gemma3-270m/README.md`). Position 0 is the
same token in every sequence, so its MLP input is one fixed vector per block, and silencing it is
a constraint on one input, not a change of what the MLPs do for the rest.

The loss: Σ over blocks from `from_block` of (position 0's MLP-output scale / the typical token's)²,
the typical scale being the detached mean over the tokens neither at position 0 nor EOT.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from lnfree.arch import architecture
from lnfree.removal.losses.massive import Captured, typical_scale
from lnfree.errors import UsageError


class Position0Mlp(BaseModel):
    """`train.position0_mlp`: from step `start` on, pull what position 0's MLPs write (blocks from
    `from_block` up) towards zero, relative to what a typical token's write."""

    model_config = ConfigDict(extra="forbid")
    weight: float = Field(1.0, ge=0, description="its weight in the loss")
    start: int = Field(0, ge=0, description="the first step it is on")
    from_block: int = Field(1, ge=0, description="the first block whose MLP it silences at position 0 (block 0 "
                            "usually writes the massive activation itself)")


class MlpOutputs(Captured):
    """Keeps each MLP's output (blocks from the lowest of `from_blocks` up, each checked against the
    model's depth) of the latest forward pass: forward hooks on the MLP output projections."""

    def __init__(self, model: nn.Module, from_blocks: list[int]):
        arch = architecture(model)
        if max(from_blocks) >= arch.n_layers:
            raise UsageError(f"position0_mlp.from_block is {max(from_blocks)}, but the model has {arch.n_layers} blocks")
        self.first_block = from_block = min(from_blocks)
        super().__init__([model.get_submodule(arch.block(i, arch.mlp_out)) for i in range(from_block, arch.n_layers)])
        self.handles = [module.register_forward_hook(self.keep_output) for module in self.modules]


def position0_mlp_loss(outputs: list[torch.Tensor], input_ids: torch.Tensor, eot_token_id: int) -> torch.Tensor:
    """Σ over `outputs` of the mean over sequences of (position 0's RMS / the typical token's RMS)²."""
    total = torch.zeros((), device=input_ids.device)
    for y in outputs:
        with torch.no_grad():  # the typical scale is a detached target: keep no fp32 copy of y for backward
            typical = typical_scale(torch.sqrt(y.float().pow(2).mean(-1) + 1e-12), input_ids, eot_token_id)
        position0 = torch.sqrt(y[:, 0].float().pow(2).mean(-1) + 1e-12)
        total = total + (position0 / typical).pow(2).mean()
    return total
