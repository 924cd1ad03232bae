"""A projection whose V columns see the norm's input at another fixed scale, in one matmul.

When both paths of an attention-input norm are fixed, the projection receives the Q/K path's
normalised input h. With r = σ_qk/σ_v and the norm's bias b, the V path's normalised input is
r·h + (1 − r)·b, so the projection's V columns are h @ (r·W_V) + bias_V + (1 − r)·(b @ W_V) and its
other columns h @ W + bias.

`RescaledProjection` folds r into a copy of the weight and writes its own backward: the V columns
cost a few passes over the weight's V block, independent of the number of tokens, instead of
passes over the activations and autograd's slice bookkeeping.
"""

from __future__ import annotations

import torch

Columns = slice | torch.Tensor  # a slice of output columns, or their indices


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul's dtype: autocast's if active (a custom Function's backward runs outside autocast,
    so the forward casts explicitly and saves the cast tensors), else the inputs' promoted dtype."""
    device = h.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(h.dtype, weight.dtype)


def _scale_columns_(t: torch.Tensor, columns: Columns, r: torch.Tensor) -> None:
    if isinstance(columns, slice):
        t[:, columns].mul_(r)
    else:
        t.index_copy_(1, columns, t.index_select(1, columns) * r)


def _add_outer_to_columns_(t: torch.Tensor, columns: Columns, rows: torch.Tensor, cols: torch.Tensor) -> None:
    """t[:, columns] += rows ⊗ cols."""
    if isinstance(columns, slice):
        t[:, columns].addr_(rows, cols)
    else:
        t.index_add_(1, columns, torch.outer(rows, cols))


class RescaledProjection(torch.autograd.Function):
    """h @ W + bias (2-D `h`) with the V `columns` computed at r = σ_qk/σ_v (see the module docstring).

    `weight` is in (in, out) layout if `in_out`, else nn.Linear's (out, in); `bias` and `norm_bias`
    may be None; `r` (a 0-d tensor) receives no gradient.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, norm_bias, r, columns: Columns, in_out: bool):
        dtype = _compute_dtype(h, weight)
        matrix = weight if in_out else weight.t()  # (in, out) view
        folded = matrix.to(dtype, copy=True)  # one copy, already in the matmul's dtype
        _scale_columns_(folded, columns, r)
        shift = bias
        if norm_bias is not None:
            offset = (1 - r) * (norm_bias.to(matrix.dtype) @ matrix[:, columns])
            shift = torch.zeros(matrix.shape[1], dtype=matrix.dtype, device=matrix.device) if bias is None else bias.clone()
            shift[columns] += offset
        hc = h.to(dtype)
        out = torch.mm(hc, folded) if shift is None else torch.addmm(shift.to(dtype), hc, folded)
        ctx.save_for_backward(hc, folded, weight, norm_bias, r, columns if torch.is_tensor(columns) else None)
        ctx.columns = None if torch.is_tensor(columns) else columns
        ctx.in_out = in_out
        return out

    @staticmethod
    def backward(ctx, grad):
        hc, folded, weight, norm_bias, r, column_index = ctx.saved_tensors
        columns = ctx.columns if column_index is None else column_index
        needs_h, needs_w, needs_bias, needs_norm_bias = ctx.needs_input_grad[:4]
        grad = grad.to(folded.dtype)
        grad_h = grad_w = grad_bias = grad_norm_bias = None
        if needs_h:
            grad_h = torch.mm(grad, folded.t())
        column_sums = grad.sum(0, dtype=torch.float32) if needs_bias or norm_bias is not None else None
        if needs_bias:
            grad_bias = column_sums.to(weight.dtype)
        # The gradient of the V columns' offset (1 − r)·(b @ W_V), per column: (1 − r)·Σ_tokens grad.
        offset_grad = None if norm_bias is None else ((1 - r) * column_sums[columns]).to(weight.dtype)
        if needs_w:  # in the weight's own layout (no transposed copy); `as_in_out` views it as (in, out)
            grad_w = torch.mm(hc.t(), grad) if ctx.in_out else torch.mm(grad.t(), hc)
            grad_w = grad_w.to(weight.dtype)
            as_in_out = grad_w if ctx.in_out else grad_w.t()
            _scale_columns_(as_in_out, columns, r)
            if offset_grad is not None:
                _add_outer_to_columns_(as_in_out, columns, norm_bias.to(weight.dtype), offset_grad)
        if needs_norm_bias:
            matrix = weight if ctx.in_out else weight.t()
            grad_norm_bias = (matrix[:, columns] @ offset_grad).to(norm_bias.dtype)
        return grad_h, grad_w, grad_bias, grad_norm_bias, None, None, None
