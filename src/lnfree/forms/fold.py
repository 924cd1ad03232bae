"""Exactly LN-free weights: fold every fixed-scale norm into the layers around it (in memory only).

A fixed-scale norm is linear: (C·x)/σ · w + b, with C the centring (LayerNorm) or the identity
(RMSNorm). Folded into a consumer with (in, out) weight W and bias c it becomes
W' = C·diag(w/σ)·W and c' = b·W + c, per path for the attention-input norm (σ_qk on the Q/K
columns, σ_v on the V columns); a per-head norm (Qwen3's q_norm / k_norm) scales the rows of the
projection producing its input. The final norm folds into an untied unembedding, which gains a
bias when the norm has one. Every norm then becomes an `nn.Identity`.

The folded model must not be saved as its transformers class (reloading would recreate default
norms and drop the head bias, silently): its class refuses `save_pretrained`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lnfree.errors import LnfreeError
from lnfree.fixedscale import surgery
from lnfree.arch import architecture
from lnfree.arch.base import in_out, v_mask


class FoldError(LnfreeError, ValueError):
    """A model that cannot be folded."""


class FoldedModel:
    """Mixin of every folded model: refuses `save_pretrained`."""

    def save_pretrained(self, *args, **kwargs):
        raise TypeError(
            "a folded LN-free model cannot be saved as its transformers class (it would reload with norms "
            "and without its unembedding bias); save the eps-trick export (lnfree.forms.export.write_export) instead"
        )


_FOLDED_CLASSES: dict[type, type] = {}


def folded_class(cls: type) -> type:
    """The subclass of a transformers model class used for folded LN-free models."""
    if cls not in _FOLDED_CLASSES:
        name = f"Folded{cls.__name__}"
        sub = type(name, (FoldedModel, cls), {"__module__": __name__})
        globals()[name] = sub
        _FOLDED_CLASSES[cls] = sub
    return _FOLDED_CLASSES[cls]


#: Output features folded at once: bounds the fp64 temporaries (8,192 columns of Gemma 3's unembedding:
#: 40 MB, where all 262,144 of them would take 1.3 GB per copy). Each column's numbers are its own.
FOLD_CHUNK = 8192


def _fold_into(proj: nn.Module, conv1d: bool, columns: torch.Tensor, scale: torch.Tensor,
               norm_bias: torch.Tensor | None, centred: bool, original: torch.Tensor) -> None:
    """Fold a norm (scale w/σ, optional bias, centring) into `columns` of a consumer, from its original weight,
    `FOLD_CHUNK` columns at a time (each is read before it is written: `original` may be the live weight)."""
    if norm_bias is not None and proj.bias is None:
        raise FoldError(f"a {type(proj).__name__} without bias cannot absorb the norm's bias")
    target = in_out(proj.weight, conv1d)
    for part in columns.split(FOLD_CHUNK):
        w = original[:, part].double()  # (in, out)
        folded = w * scale[:, None]
        if centred:
            folded = folded - folded.mean(dim=0, keepdim=True)
        target[:, part] = folded.to(target.dtype)
        if norm_bias is not None:
            proj.bias[part] += (norm_bias.double() @ w).to(proj.bias.dtype)


def _head_with_bias(head: nn.Module, bias: bool) -> nn.Linear:
    """An untied copy of the unembedding as an `nn.Linear` (with a zero bias when asked)."""
    out_features, in_features = head.weight.shape
    new = nn.Linear(in_features, out_features, bias=bias or head.bias is not None,
                    dtype=head.weight.dtype, device=head.weight.device)
    new.weight.copy_(head.weight)
    if new.bias is not None:
        new.bias.copy_(head.bias if head.bias is not None else torch.zeros_like(new.bias))
    return new


@torch.no_grad()
def fold(model: nn.Module) -> nn.Module:
    """Fold every fixed-scale norm of an installed model into the next layer (exact, fp64 maths).

    Refuses models with real norms: a real norm's per-token division cannot be folded.
    """
    arch = architecture(model)
    states = surgery.scale_states(model)
    real = [name for name, s in states.items() if not s.is_fixed]
    if real:
        raise FoldError(f"only fixed-scale norms can be folded; {len(real)} are real (e.g. {real[0]})")
    if any(s.wants_context for s in states.values()):
        raise FoldError("a special σ (position 0 / EOT) is active; it cannot be folded into weights")
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    reference = next(model.parameters())
    folded = surgery.original_class(model)(config).to(device=reference.device, dtype=reference.dtype).eval()
    wanted = folded.state_dict()
    folded.load_state_dict({k: v for k, v in model.state_dict().items() if k in wanted}, strict=False)
    if arch.tied:  # the head must be its own parameter before the final norm folds into it
        head, source = folded.get_submodule(arch.unembedding), model.get_submodule(arch.unembedding).weight
        if head.weight is folded.get_input_embeddings().weight or head.weight.shape != source.shape:
            head.weight = nn.Parameter(source.detach().clone())
        else:  # its own already: filled in place (no second vocabulary-sized copy alive at once)
            head.weight.copy_(source)
    centred = arch.norm_kind == "layer"
    for site in arch.sites():
        norm = model.get_submodule(site.module)
        weight = norm.weight.double()
        bias = norm.bias if norm.bias is not None else None
        for consumer in site.consumers:
            if site.module == arch.final_norm and bias is not None:
                folded.set_submodule(consumer.path, _head_with_bias(folded.get_submodule(consumer.path), True))
            proj = folded.get_submodule(consumer.path)
            conv1d = arch.conv1d and consumer.path != arch.unembedding
            # read before written, column by column (the unembedding's copy would be 0.67 GB for Gemma 3)
            original = in_out(proj.weight, conv1d).detach()
            width = original.shape[1]
            if site.folds_into_producer:  # rows of the producer: (W x + c) (per head), times w/σ per dimension
                scale = (weight / norm.state.sigma.double()).repeat(width // weight.numel())
                target = in_out(proj.weight, conv1d)
                target.copy_((original.double() * scale[None, :]).to(target.dtype))
                if proj.bias is not None:
                    proj.bias.copy_((proj.bias.double() * scale).to(proj.bias.dtype))
                continue
            if site.split:
                mask = v_mask(consumer.v_columns, width)
                paths = [(~mask, norm.qk), (mask, norm.v)]
            else:
                paths = [(torch.ones(width, dtype=torch.bool), norm.state)]
            for columns, state in paths:
                if columns.any():
                    _fold_into(proj, conv1d, columns.nonzero().squeeze(1), weight / state.sigma.double(), bias,
                               centred, original)
        folded.set_submodule(site.module, nn.Identity())
    folded.__class__ = folded_class(type(folded))
    return folded
