"""`train.optimizer = "muon"`: Muon for the hidden weight matrices, AdamW for everything else.

Muon orthogonalises each matrix's momentum (Newton–Schulz), so no single direction of a weight grows much
faster than the others; outlier-safe pre-training (arXiv 2506.19697) credits it with keeping massive
activations from forming. Embeddings and the head stay with AdamW, as Muon's authors advise, and so do
vectors (Muon takes 2-D parameters only). Each Muon update is scaled to the RMS of a typical AdamW update
(torch's `adjust_lr_fn="match_rms_adamw"`), so both parts follow the run's one learning-rate curve.

`Muon` is torch.optim.Muon's update (the same defaults; `tests/test_muon.py` checks the two agree) with the
Newton–Schulz iteration in a dtype of our choice: torch's runs it in bf16, which a CPU without native bf16
emulates at many times fp32's cost.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lnfree.removal.precision import auto_bf16

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's quintic iteration
NS_STEPS = 5


def orthogonalise(grad: torch.Tensor, dtype: torch.dtype, eps: float = 1e-7) -> torch.Tensor:
    """Newton–Schulz's approximation of U·Vᵀ for grad = U·S·Vᵀ, computed in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, orthogonalised (in `ns_dtype`), scaled to AdamW's RMS, decoupled weight decay."""

    def __init__(self, params: list[nn.Parameter], *, lr: float, weight_decay: float, momentum: float = 0.95,
                 ns_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # noqa: D102
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - momentum)
                update = orthogonalise(p.grad.lerp(buf, momentum), self.ns_dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimiser over two: `param_groups` lists both parts' groups (setting a group's `lr` reaches the
    part that owns it), `step`/`zero_grad` run both, the state dict holds both."""

    def __init__(self, muon_params: list[nn.Parameter], adamw_groups: list[dict[str, Any]], *, lr: float,
                 weight_decay: float, betas: tuple[float, float], fused: bool | None) -> None:
        native = auto_bf16(muon_params[0].device, cpu_opt_in=True)
        self.muon = Muon(muon_params, lr=lr, weight_decay=weight_decay,
                         ns_dtype=torch.bfloat16 if native else torch.float32)
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, fused=fused)
        super().__init__([p for g in self.adamw.param_groups for p in g["params"]] + list(muon_params), {"lr": lr})
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # noqa: D102
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:  # noqa: D102
        dtype = str(self.muon.ns_dtype).removeprefix("torch.")
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict(), "ns_dtype": dtype}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Both parts' states; the Newton–Schulz dtype the run started with (a resumed run continues exactly)."""
        if set(state_dict) != {"muon", "adamw", "ns_dtype"}:
            raise ValueError("this checkpoint's optimiser state is not Muon's (train.optimizer differs from its run's)")
        self.muon.ns_dtype = getattr(torch, state_dict["ns_dtype"])
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups


def muon_matrices(model: nn.Module, params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The trained 2-D parameters that are neither an input embedding nor the output head."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        tables.add(id(head.weight))
    return [p for p in params if p.dim() == 2 and id(p) not in tables]
