"""A projection whose V columns see the norm's input at another fixed scale, in one matmul.

When both paths of an attention-input norm are fixed, the projection receives the Q/K path's
normalised input h. With r = σ_qk/σ_v and the norm's bias b, the V path's normalised input is
r·h + (1 − r)·b, so the projection's V columns are h @ (r·W_V) + bias_V + (1 − r)·(b @ W_V) and its
other columns h @ W + bias.

`RescaledProjection` folds r into a copy of the weight's V block (a matmul of its own that writes
its columns of the output) and writes its own backward: the V columns cost a few passes over the
weight's V block, independent of the number of tokens, instead of passes over the activations
and autograd's slice bookkeeping.
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


def _matmul_parts(matrix: torch.Tensor, columns: Columns, r: torch.Tensor, dtype: torch.dtype) -> list[tuple[slice, torch.Tensor]]:
    """The (output columns, (in, out) matrix) pairs the projection multiplies `h` by, in `dtype`.

    V columns given as a slice (GPT-2's c_attn, Llama's v_proj) are a separate matmul by r·W_V
    beside the untouched other columns: only the V block is copied. Index columns (interleaved
    per head) fold r into a copy of the whole matrix, one matmul.
    """
    if isinstance(columns, slice):
        width = matrix.shape[1]
        start, stop, step = columns.indices(width)
        if step != 1:
            raise ValueError(f"V columns given as a slice must be contiguous, got {columns}")
        before, after = slice(0, start), slice(stop, width)
        parts = [(before, matrix[:, before].to(dtype)), (columns, matrix[:, columns].to(dtype) * r),
                 (after, matrix[:, after].to(dtype))]
        return [(c, part) for c, part in parts if part.shape[1]]  # in column order
    folded = matrix.to(dtype, copy=True)
    _scale_columns_(folded, columns, r)
    return [(slice(None), folded)]


def _product(h: torch.Tensor, matrix: torch.Tensor, shift: torch.Tensor | None, out: torch.Tensor | None = None):
    return torch.mm(h, matrix, out=out) if shift is None else torch.addmm(shift, h, matrix, out=out)


class RescaledProjection(torch.autograd.Function):
    """h @ W + bias (2-D `h`) with the V `columns` computed at r = σ_qk/σ_v (see the module docstring).

    `weight` is in (in, out) layout if `in_out`, else nn.Linear's (out, in); `bias` and `norm_bias`
    may be None; `r` (a 0-d tensor) receives no gradient.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, norm_bias, r, columns: Columns, in_out: bool):
        dtype = _compute_dtype(h, weight)
        matrix = weight if in_out else weight.t()  # (in, out) view
        shift = bias
        if norm_bias is not None:
            offset = (1 - r) * (norm_bias.to(matrix.dtype) @ matrix[:, columns])
            shift = torch.zeros(matrix.shape[1], dtype=matrix.dtype, device=matrix.device) if bias is None else bias.clone()
            shift[columns] += offset
        hc = h.to(dtype)
        parts = _matmul_parts(matrix, columns, r, dtype)
        shifts = [None if shift is None else shift[c].to(dtype) for c, _ in parts]
        if torch.compiler.is_compiling():  # dynamo cannot trace `out=` into a strided view; inductor fuses the cat
            out = torch.cat([_product(hc, part, b) for (_, part), b in zip(parts, shifts)], dim=1)
        else:  # each part's matmul writes its columns of `out` directly
            out = hc.new_empty(hc.shape[0], matrix.shape[1])
            for (part_columns, part), b in zip(parts, shifts):
                _product(hc, part, b, out=out[:, part_columns])
        ctx.save_for_backward(hc, weight, norm_bias, r, columns if torch.is_tensor(columns) else None,
                              *(part for _, part in parts))
        ctx.columns = None if torch.is_tensor(columns) else columns
        ctx.part_columns = [part_columns for part_columns, _ in parts]
        ctx.in_out = in_out
        return out

    @staticmethod
    def backward(ctx, grad):
        hc, weight, norm_bias, r, column_index, *parts = ctx.saved_tensors
        columns = ctx.columns if column_index is None else column_index
        needs_h, needs_w, needs_bias, needs_norm_bias = ctx.needs_input_grad[:4]
        grad = grad.to(hc.dtype)
        grad_h = grad_w = grad_bias = grad_norm_bias = None
        if needs_h:  # Σ over parts of grad[:, part's columns] @ partᵀ
            for part_columns, part in zip(ctx.part_columns, parts):
                term_grad, term_matrix = grad[:, part_columns], part.t()
                grad_h = torch.mm(term_grad, term_matrix) if grad_h is None else grad_h.addmm_(term_grad, term_matrix)
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
