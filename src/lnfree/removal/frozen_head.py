"""A frozen head under 16-bit autocast: one kept copy of its weight, transposed, instead of a cast per forward.

Under `train.freeze_embeddings` a tied head (Gemma 3's: 262,144 × 640 weights) never changes, yet autocast
casts it to bf16 at every forward that reaches it (0.3–0.37 CPU-s on an Intel Xeon with AMX, one thread),
and the backward's product of the logits' gradient with that [vocabulary, hidden] copy runs a slow kernel on a
CPU: 0.75 s at 256 tokens against 0.28 s for the same product from a [hidden, vocabulary] copy, (Wᵀ·gᵀ)ᵀ; the
head's forward and backward at 256 tokens 1.91 s against 0.72 (`benchmarks/results/frozen_head.txt`).
`FrozenHead` keeps that transposed copy (`kept_transposed`) while the weight is unchanged and multiplies by it
both ways. Its forward is bit for bit autocast's; its backward sums the bf16 products in another order (the input
gradient within 0.3 % of its largest value). Outside autocast, or for a weight that trains, it is the plain
`nn.Linear`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

#: The kept copies, by weight: (its version, storage and dtype, the [in, out] copy).
_KEPT = WeakIdKeyDictionary()


def kept_transposed(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` (out × in) in `dtype`, transposed (in × out), detached. A weight without gradient that needs a
    cast is cast once into a contiguous copy, kept while the weight is unchanged (its version and storage); a
    trained one, or one already in `dtype`, comes as a transposed view (nothing kept)."""
    if weight.requires_grad or weight.dtype == dtype:
        return weight.detach().to(dtype).t()
    key = (weight._version, weight.data_ptr(), dtype)
    kept = _KEPT.get(weight)
    if kept is None or kept[0] != key:
        kept = _KEPT[weight] = (key, weight.detach().to(dtype).t().contiguous())
    return kept[1]


def product_backward(grad: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """d loss / d input of `input @ weight_t` from `grad` (d loss / d output, …, out): from a kept copy
    (contiguous in × out) (weight_t · gradᵀ)ᵀ over the rows of `grad`, the order whose CPU kernel is the fast one
    for a large output width; from a transposed view grad · weight_tᵀ, as `nn.Linear`'s backward."""
    if not weight_t.is_contiguous():
        return grad @ weight_t.t()
    rows = grad.reshape(-1, grad.shape[-1])
    return (weight_t @ rows.t()).t().reshape(*grad.shape[:-1], weight_t.shape[0])


class _Product(torch.autograd.Function):
    """`x @ weight_t` (weight_t frozen), its input gradient by `product_backward`."""

    @staticmethod
    def forward(ctx, x, weight_t):
        ctx.save_for_backward(weight_t)
        return x @ weight_t

    @staticmethod
    def backward(ctx, grad):
        (weight_t,) = ctx.saved_tensors
        return product_backward(grad, weight_t), None


class FrozenHead(nn.Linear):
    """`nn.Linear` that, while its weight takes no gradient and autocast is on, multiplies by
    `kept_transposed` in autocast's dtype (the same logits; see the module's docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if self.weight.requires_grad or not torch.is_autocast_enabled(device):
            return super().forward(x)
        dtype = torch.get_autocast_dtype(device)
        out = _Product.apply(x.to(dtype), kept_transposed(self.weight, dtype))
        return out if self.bias is None else out + self.bias.to(dtype)


def use_frozen_head(model: nn.Module, name: str) -> None:
    """Swap `model`'s linear module `name` (the unembedding, `Architecture.unembedding`) for a `FrozenHead`
    holding the same parameters (a tied weight stays tied; the state dict is unchanged). A head that is not a
    plain `nn.Linear`, or holds hooks, is left as it is."""
    head = model.get_submodule(name)
    if type(head) is not nn.Linear or head._forward_hooks or head._forward_pre_hooks or head._backward_hooks:
        return
    frozen = FrozenHead(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
    frozen.weight, frozen.bias = head.weight, head.bias
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, frozen)
