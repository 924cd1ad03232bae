"""Keep the original's attention patterns, the attention sink first (`train.attention_kl`).

Fixing a per-head key norm to one σ makes each key's length follow its token's residual scale. Position
0 (BOS, the attention sink) enters Gemma 3 270M's key norms at 0.17–0.84× the median token's scale, so
with the shared σ its key is too short and the sink breaks: over queries 16–63 the mean attention on
position 0 falls from 0.42 in the original (the vanilla control: 0.39) to 0.06 right after the key
norms are fixed and is 0.14 at the end of a removal, while each row's entropy grows from 1.8 to 2.4
nats (`experiments/results/gemma3-270m/robust/`). Heads that can no longer rest on the sink spread
their attention over the context, which is where the removal's CE gap sits (positions 16–63, every
kind of token). Nothing in the CE or the logits' KL points at the sink directly.

The loss: the mean over blocks, sequences, heads and queries from position 1 of KL(teacher row ‖
student row), each row the attention distribution of one query (MiniLM's self-attention transfer, Wang et
al. 2020, arXiv 2002.10957, there on the last layer only). Both models run transformers' eager attention,
which returns the probabilities (SDPA does not); at a context of 64 it costs little.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from lnfree.arch import architecture
from lnfree.errors import UsageError
from lnfree.removal.losses.massive import Captured

#: The probability below which a student's attention weight counts as this (log of zero aside).
FLOOR = 1e-8


class AttentionKl(BaseModel):
    """`train.attention_kl`: from step `start` on, pull every head's attention rows towards the teacher's."""

    model_config = ConfigDict(extra="forbid")
    weight: float = Field(1.0, ge=0, description="its weight in the loss")
    start: int = Field(0, ge=0, description="the first step it is on")


class AttentionPatterns(Captured):
    """Keeps every block's attention probabilities (batch, heads, queries, keys) of the latest forward pass:
    forward hooks on the attention modules, which are switched to eager attention (the one that returns them)."""

    def __init__(self, model: nn.Module):
        arch = architecture(model)
        model.set_attn_implementation("eager")
        super().__init__([model.get_submodule(arch.block(i, arch.attention)) for i in range(arch.n_layers)])
        self.handles = [module.register_forward_hook(self._keep) for module in self.modules]

    def _keep(self, module: nn.Module, args: tuple, output) -> None:
        if not self.active:
            return
        if not isinstance(output, tuple) or len(output) < 2 or output[1] is None:
            raise UsageError("train.attention_kl needs the attention probabilities: this model's attention "
                             "does not return them under eager attention")
        setattr(module, self.attribute, output[1])


def attention_kl_loss(student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
    """Mean over blocks of the mean over (sequence, head, query ≥ 1) of KL(teacher row ‖ student row), fp32."""
    if len(student) != len(teacher) or not student:
        raise ValueError(f"attention_kl: {len(student)} student and {len(teacher)} teacher blocks")
    total = torch.zeros((), device=student[0].device)
    for s, t in zip(student, teacher, strict=True):
        p = t[:, :, 1:].detach().float()
        log_q = s[:, :, 1:].float().clamp_min(FLOOR).log()
        total = total + (torch.xlogy(p, p) - p * log_q).sum(-1).mean()
    return total / len(student)
