"""Weights read outside their module's forward, as they are under FSDP2 or not.

FSDP2 registers each weight as a DTensor holding this process's shard, and swaps the whole weight in only
while the module of its group runs (the root's, or, with a group per block, the block's). A loss that reads
a weight after the forward (a norm's weight times its input, a neuron's gain) or re-runs a submodule (an
MLP on scaled tokens) gathers it here. Its gradient is then each process's share of the *average* over
processes, as FSDP (and DDP) average every other gradient: summed, the weights move world-size times too far
(`tests/test_distributed.py`). Off FSDP every function returns its input or calls the module as it is.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.func import functional_call


def gathered(weight: torch.Tensor) -> torch.Tensor:
    """`weight` whole, differentiable into its shard (gradient averaged over processes); else `weight`."""
    if isinstance(weight, DTensor):
        return weight.full_tensor(grad_placements=[Partial("avg")] * weight.device_mesh.ndim)
    return weight


def whole(value: torch.Tensor) -> torch.Tensor:
    """A value FSDP holds in parts (a DTensor: a shard, or partial norms of sharded gradients) as one tensor."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def call_gathered(module: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    """`module(*args)` outside its FSDP group's forward: with its weights gathered where they are sharded."""
    params = dict(module.named_parameters())
    if not any(isinstance(p, DTensor) for p in params.values()):
        return module(*args)
    return functional_call(module, {name: gathered(p) for name, p in params.items()}, args)


@torch.no_grad()
def scale_(weight: torch.Tensor, factor: torch.Tensor) -> None:
    """`weight *= factor` (broadcast) in place, on a plain weight or on this process's shard of it."""
    if isinstance(weight, DTensor):
        factor = DTensor.from_local(factor, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim,
                                    run_check=False)
    weight.mul_(factor)
