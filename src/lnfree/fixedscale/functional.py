"""The per-token scale maths of a norm, as functions: the real LayerNorm / RMSNorm (and the reciprocal
scale it divides by), the per-token scale, and the fixed-scale forms (the norm's linear part divided by
a frozen σ) that `ScaleState` and the norm modules compute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lnfree.arch.base import NormKind  # the family says which kind (`Architecture.norm_kind`)


def second_moment(x: torch.Tensor, kind: NormKind) -> torch.Tensor:
    """Per-token quantity the norm divides by the root of: variance (LayerNorm) or mean square (RMSNorm)."""
    return x.var(dim=-1, unbiased=False) if kind == "layer" else x.pow(2).mean(dim=-1)


def token_scale(x: torch.Tensor, kind: NormKind, eps: float) -> torch.Tensor:
    """Per-token scale as the real norm computes it (fp32, detached): std for LayerNorm, RMS for RMSNorm."""
    with torch.no_grad():
        return torch.sqrt(second_moment(x.detach().float(), kind) + eps)


def real_norm(x: torch.Tensor, kind: NormKind, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The real LayerNorm / RMSNorm, computed as transformers computes it."""
    if kind == "layer":
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def real_norm_and_rstd(
    x: torch.Tensor, kind: NormKind, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The real norm and the per-token reciprocal scale it multiplied by, shape (..., 1), computed once.

    LayerNorm goes through `torch.native_layer_norm` (the kernel behind `F.layer_norm`), which returns
    its reciprocal std. Autocast lists `layer_norm` but not `native_layer_norm`, so under autocast the
    inputs are cast to fp32 here, as autocast would.
    """
    if kind == "layer":
        if torch.is_autocast_enabled(x.device.type):
            x, weight = x.float(), weight.float()
            bias = bias.float() if bias is not None else None
        out, _, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
        return out, rstd
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (h * rstd).to(x.dtype), rstd


#: A LayerNorm kernel with this eps divides by the constant √eps = 2⁵⁰: in fp32 (the kernel's
#: arithmetic, also under autocast) var + 2¹⁰⁰ rounds to 2¹⁰⁰ for every variance below 2⁷⁶, and
#: the kernel's gradient through its variance is 2⁻¹⁰⁰ times smaller than the rest.
CONSTANT_EPS = 2.0**100
CONSTANT_SCALE = 2.0**50  # √CONSTANT_EPS: scaling by it or its inverse is exact


def centred_times(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  sigma: torch.Tensor | None = None) -> torch.Tensor:
    """(x − mean(x)) · weight / σ + bias (σ = 1 if None; σ receives no gradient) in one fused
    LayerNorm kernel (forward and backward).

    The kernel divides by the constant 2⁵⁰ (see CONSTANT_EPS) and the weight is scaled by 2⁵⁰/σ
    (one multiply), so this is exactly the centring, the weight and the bias for any input variance
    below 2⁷⁶; it costs what a real LayerNorm costs instead of three elementwise passes each way.
    fp16 weights (a model loaded in fp16, not fp16 autocast over fp32 weights) cannot hold
    2⁵⁰ × weight, and torch.compile fuses the elementwise form better: there it is computed
    elementwise.
    """
    if weight.dtype == torch.float16 or torch.compiler.is_compiling():
        # Under torch.compile the elementwise form fuses into one kernel with a single reduction,
        # cheaper than the LayerNorm kernel's decomposition (which also computes the variance).
        out = centre(x, "layer") * (weight if sigma is None else weight / sigma)
        return out if bias is None else out + bias
    factor = CONSTANT_SCALE if sigma is None else CONSTANT_SCALE / sigma  # σ has no gradient: one op on the weight
    return F.layer_norm(x, (x.shape[-1],), weight * factor, bias, CONSTANT_EPS)


def rms_times(x: torch.Tensor, weight: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x / σ · weight, the fixed-scale RMSNorm, in fp32 (as transformers computes RMSNorm) and in one
    pass when σ is one number: x · (weight / σ). The result has transformers' dtype (weight's and
    x's promoted)."""
    if sigma.dim() == 0:
        return (x.float() * (weight.float() / sigma)).to(torch.promote_types(weight.dtype, x.dtype))
    return weight * (x.float() / sigma).to(x.dtype)


def scale_from_rstd(rstd: torch.Tensor) -> torch.Tensor:
    """Per-token scales (fp32, detached, shape of the tokens) from a norm's reciprocal scales (..., 1)."""
    return rstd.detach().float().reciprocal().squeeze(-1)


def centre(x: torch.Tensor, kind: NormKind) -> torch.Tensor:
    """The linear part of the norm before its division: mean removal for LayerNorm, nothing for RMSNorm."""
    return x - x.mean(dim=-1, keepdim=True) if kind == "layer" else x

