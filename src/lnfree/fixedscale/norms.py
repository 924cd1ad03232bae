"""Fixed-scale norms: the modules that replace a model's LayerNorms or RMSNorms during removal.

A LayerNorm computes (x − mean(x)) / std(x) · w + b per token, an RMSNorm x / rms(x) · w.
Everything but the division by the per-token scale is linear. A `ScaleState` decides what that
division uses: the real per-token scale (while the norm is "real") or a frozen scalar σ (once it
is "fixed"). σ is an exponential moving average of the batch-mean per-token scale, fed by
grad-enabled training forwards (or an explicit measurement) while the norm is real, and frozen
when it is switched.

Three module swaps cover every family (`lnfree.arch` says which goes where):
- `FixedScaleNorm` replaces a norm whose output feeds its consumers directly;
- `SplitNorm` replaces the attention-input norm, whose Q/K and V paths are switched separately;
  it owns the norm's parameters and both scale states, and computes the part of the norm the
  paths share (all of it while both are real, nothing while they differ);
- `NormalisedProjection` replaces each projection reading a `SplitNorm`'s output and finishes
  that norm per output column (Q/K columns through one state, V columns through the other).
Parameter names stay those of the replaced modules, so state-dict keys do not change. The scale
states are `lnfree.fixedscale.state`; the maths they share, `lnfree.fixedscale.functional`.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lnfree.fixedscale.functional import NormKind, centred_times, real_norm, real_norm_and_rstd, rms_times
from lnfree.fixedscale.rescaled import RescaledProjection
from lnfree.fixedscale.state import ScaleState


class FixedScaleNorm(nn.Module):
    """Drop-in replacement for a LayerNorm or RMSNorm whose division can be frozen to a fixed σ.

    Keeps the parameter names `weight` (and `bias` for LayerNorm), so state-dict keys of the
    replaced module are unchanged. Identical to the real norm until `state.switch_to_fixed()`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, state: ScaleState):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self.state
        if state.gathering:  # the statistics come from the norm's own reciprocal scale
            out, rstd = real_norm_and_rstd(x, state.kind, self.weight, self.bias, state.eps)
            state.gather(rstd)
            return out
        return state.normalise(x, self.weight, self.bias)


class SplitNorm(nn.Module):
    """The attention-input norm with separate scale states for the Q/K and the V path.

    It sits where the norm was and owns the norm's `weight` (and `bias`) under the original names;
    the `NormalisedProjection`s reading its output finish the norm per path. What it returns
    depends on `mode()` (Python mirrors only, so no host sync and the same answer on a
    checkpointing recompute):
    - "real" (both paths real, not blending): the real norm, computed once for every projection; its reciprocal
      scale feeds both paths' statistics;
    - "fixed" (both fixed, one σ each): the Q/K path's fixed-scale norm (σ folded into the weight
      vector, one pass); projections reading it need nothing more for Q/K columns and fold
      σ_qk/σ_v into their V columns' weights (`RescaledProjection`);
    - "split" (anything else): the raw input; each projection normalises per path.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, qk: ScaleState, v: ScaleState):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None
        self.qk = qk
        self.v = v

    @property
    def kind(self) -> NormKind:
        return self.qk.kind

    def mode(self) -> Literal["real", "fixed", "split"]:
        """How the norm is shared between the paths (see the class docstring)."""
        qk, v = self.qk, self.v
        if not (qk.is_fixed or qk.is_blending or v.is_fixed or v.is_blending):
            return "real"
        plain = not (qk.wants_context or v.wants_context or qk.guarded or v.guarded)
        if qk.is_fixed and v.is_fixed and plain:
            return "fixed"
        return "split"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = self.mode()
        if mode == "real":
            if not self.qk.gathering:
                return real_norm(x, self.kind, self.weight, self.bias, self.qk.eps)
            out, rstd = real_norm_and_rstd(x, self.kind, self.weight, self.bias, self.qk.eps)
            self.qk.gather(rstd)
            self.v.gather(rstd)
            return out
        if mode == "fixed":
            if self.kind == "rms":
                return rms_times(x, self.weight, self.qk.sigma)
            return centred_times(x, self.weight, self.bias, self.qk.sigma)
        for state in (self.qk, self.v):
            if state.gathering:
                state.observe(x)
        return x

    def path(self, name: str) -> ScaleState:
        return self.qk if name == "qk" else self.v


class NormalisedProjection(nn.Module):
    """A projection that reads a `SplitNorm`'s input and applies that norm per output column.

    `v_columns` selects the output features on the V path: None (all Q/K), "all", a slice or a
    LongTensor of column indices (e.g. GPT-NeoX, whose fused Q/K/V columns interleave per head).
    `weight` keeps the replaced module's layout: (in, out) for GPT-2's Conv1D (`in_out=True`),
    (out, in) for `nn.Linear`. The norm module is shared, not owned (it is registered at the
    norm's own place in the model).
    """

    def __init__(self, proj: nn.Module, norm: SplitNorm, v_columns, in_out: bool):
        super().__init__()
        self.weight = nn.Parameter(proj.weight.detach().clone())
        self.bias = nn.Parameter(proj.bias.detach().clone()) if getattr(proj, "bias", None) is not None else None
        self.in_out = in_out
        self.out_features = self.weight.shape[1] if in_out else self.weight.shape[0]
        if isinstance(v_columns, torch.Tensor):
            v_columns = v_columns.long()
            qk = torch.ones(self.out_features, dtype=torch.bool)
            qk[v_columns] = False
            self.register_buffer("v_index", v_columns, persistent=False)
            self.register_buffer("qk_index", qk.nonzero().squeeze(1), persistent=False)
            v_columns = "index"
        self.v_columns = v_columns
        object.__setattr__(self, "norm", norm)  # not a submodule: its parameters live at the norm's place

    def extra_repr(self) -> str:
        return f"out_features={self.out_features}, v_columns={self.v_columns}"

    def matrix(self) -> torch.Tensor:
        """The weight as (in, out)."""
        return self.weight if self.in_out else self.weight.t()

    def _columns(self, path: str):
        """Column selector of a path: a slice, or an index tensor."""
        v = self.v_columns
        if v == "index":
            return self.v_index if path == "v" else self.qk_index
        if v is None:
            return slice(None) if path == "qk" else slice(0, 0)
        if v == "all":
            return slice(None) if path == "v" else slice(0, 0)
        return v if path == "v" else slice(0, v.start)  # a slice of V columns at the end

    def _project(self, h: torch.Tensor, columns) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        bias = self.bias[columns] if self.bias is not None else None
        if not self.in_out:  # nn.Linear's layout: F.linear gives the weight's gradient in that layout (no copy)
            return F.linear(flat, self.weight[columns], bias)
        w = self.weight[:, columns]
        return torch.mm(flat, w) if bias is None else torch.addmm(bias, flat, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        shape = x.shape[:-1] + (self.out_features,)
        mode = norm.mode()
        if mode == "real":  # `x` is the real norm's output: one matmul
            return self._project(x, slice(None)).view(shape)
        paths = [p for p in ("qk", "v") if not _empty(self._columns(p), self.out_features)]
        if mode == "fixed":  # `x` is the Q/K path's fixed-scale norm of the input
            return self._fixed_columns(x, paths).view(shape)
        states = [norm.path(p) for p in paths]
        if len(paths) == 1:  # `x` is the raw input: this path's norm, one matmul
            h = states[0].normalise(x, norm.weight, norm.bias)
            return self._project(h, slice(None)).view(shape)
        parts = []
        for path, state in zip(paths, states):
            columns = self._columns(path)
            parts.append((columns, self._project(state.normalise(x, norm.weight, norm.bias), columns)))
        if self.v_columns == "index":
            out = parts[0][1].new_empty(parts[0][1].shape[0], self.out_features)
            for columns, part in parts:
                out = out.index_copy(1, columns, part)
        else:  # contiguous: the Q/K columns precede the V columns
            out = torch.cat([part for _, part in parts], dim=-1)
        return out.view(shape)

    def _fixed_columns(self, h: torch.Tensor, paths: list[str]) -> torch.Tensor:
        """Every path fixed, `h` = the Q/K path's normalised input: Q/K columns are h @ W + bias, one
        matmul; V columns need the V path's σ instead, which `RescaledProjection` folds into a copy
        of the weight (see there). A projection without V columns (Llama's q_proj, k_proj) is a plain matmul."""
        if "v" not in paths:
            return self._project(h, slice(None))
        r = self.norm.qk.sigma / self.norm.v.sigma
        columns = slice(None) if paths == ["v"] else self._columns("v")
        flat = h.reshape(-1, h.shape[-1])
        return RescaledProjection.apply(flat, self.weight, self.bias, self.norm.bias, r, columns, self.in_out)


def _empty(columns, width: int) -> bool:
    if isinstance(columns, torch.Tensor):
        return columns.numel() == 0
    return len(range(width)[columns]) == 0
