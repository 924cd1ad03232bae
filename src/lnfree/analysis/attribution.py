"""The residual stream of a bridge split into each component's direct contribution, and direct logit
attribution (DLA) through the final norm: exact for a LN-free bridge and for one whose final norm is
fixed (one σ for every token), the linearisation at the run's own scale for a real final norm.

See `lnfree.forms.bridge` for the bridges themselves and the hook names used here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from lnfree.arch.base import norm_eps
from lnfree.forms.bridge import as_batch, hook_name, norm_weight
from lnfree.fixedscale.norms import FixedScaleNorm
from lnfree.errors import UsageError


@dataclass
class FixedFinalNorm:
    """A pass-through bridge's final norm when it is a fixed-scale norm: x ↦ centre(x) · scale + bias.

    The partially LN-free case that direct logit attribution needs: with the final norm fixed the
    logits are affine in the final residual stream, whatever the norms inside the blocks do.
    """

    scale: torch.Tensor  # weight / σ, [d_model]
    bias: Optional[torch.Tensor]  # [d_model] or None
    centre: bool  # LayerNorm: subtract the mean first

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """The norm without its bias, in ``x``'s dtype."""
        x = x - x.mean(-1, keepdim=True) if self.centre else x
        return x * self.scale.to(x.dtype)


def fixed_final_norm(bridge: Any) -> Optional[FixedFinalNorm]:
    """The final norm of a pass-through bridge as an affine map when it is a fixed-scale norm (one σ
    for every token), else None (an identity, a real norm, or a normalising bridge)."""
    if _is_normalised(bridge):
        return None
    norm = getattr(bridge.ln_final, "original_component", None)
    if not isinstance(norm, FixedScaleNorm) or not norm.state.is_fixed or norm.state.wants_context:
        return None
    scale = (norm.weight.detach().double() / norm.state.sigma.double())
    bias = norm.bias.detach().double() if norm.bias is not None else None
    return FixedFinalNorm(scale, bias, norm.state.kind == "layer")


def _is_normalised(bridge: Any) -> bool:
    return bridge.cfg.normalization_type is not None


def is_layernorm(bridge: Any) -> bool:
    """True when the bridge's norms centre their input (LayerNorm), False for RMSNorm or none."""
    return str(bridge.cfg.normalization_type or "").startswith("LN")


def _has_pos_embed(bridge: Any) -> bool:
    """True for learned positional embeddings added to the residual stream (GPT-2), not rotary ones."""
    return "pos_embed" in dict(bridge.named_children())


@dataclass
class ResidualDecomposition:
    """The final residual stream split into the direct contributions of each component.

    ``components.sum(0)`` equals the residual stream entering the final norm (``ln_final.hook_in``).
    """

    components: torch.Tensor  # [n_components, batch, pos, d_model]
    labels: list[str]  # "embed", "pos_embed" (learned positions only), then per layer "L{l}.attn" (or "L{l}H{h}"...,
    #                    "L{l}.attn_bias") and "L{l}.mlp"
    final_resid: torch.Tensor  # [batch, pos, d_model]
    final_scale: Optional[torch.Tensor]  # [batch, pos, 1] ln_final's scale; None for LN-free bridges
    logits: torch.Tensor  # [batch, pos, d_vocab]


def residual_decomposition(bridge: Any, input_ids: Any, *, per_head: bool = False) -> ResidualDecomposition:
    """Run ``bridge`` on ``input_ids`` and split its final residual stream by component.

    Components: token embedding, position embedding, and for each layer the attention output
    (``per_head``: one entry per head from ``attn.hook_result`` plus the output bias ``b_O``) and
    the MLP output.  Runs without gradient tracking; the bridge's ``use_attn_result`` flag is
    restored afterwards.
    """
    ids = as_batch(input_ids, bridge)
    n_layers = bridge.cfg.n_layers
    embeddings = ["embed", "pos_embed"] if _has_pos_embed(bridge) else ["embed"]
    wanted: dict[str, str] = {name: hook_name(name) for name in embeddings}
    for layer in range(n_layers):
        wanted[f"attn{layer}"] = hook_name("result" if per_head else "attn_out", layer)
        wanted[f"mlp{layer}"] = hook_name("mlp_out", layer)
    wanted["final"] = hook_name("ln_final_in")
    post = per_head and _has_output_norms(bridge)
    if post:  # a head's share of the attention output goes through the (linearised) output norm
        for layer in range(n_layers):
            wanted[f"post_in{layer}"] = f"blocks.{layer}.ln1_post.hook_in"
            if _is_normalised(bridge):
                wanted[f"post_scale{layer}"] = f"blocks.{layer}.ln1_post.hook_scale"
    if _is_normalised(bridge):
        wanted["scale"] = hook_name("ln_final_scale")

    store: dict[str, torch.Tensor] = {}

    def saver(key: str):
        def fn(tensor: torch.Tensor, hook: Any) -> None:
            store[key] = tensor.detach().clone()

        return fn

    previous = bool(getattr(bridge.cfg, "use_attn_result", False))
    if per_head and not previous:
        bridge.set_use_attn_result(True)
    try:
        with torch.no_grad(), bridge.hooks(fwd_hooks=[(name, saver(key)) for key, name in wanted.items()]):
            logits = bridge(ids, return_type="logits")
    finally:
        if per_head and not previous:
            bridge.set_use_attn_result(False)
    missing = sorted(set(wanted) - set(store))
    if missing:  # pragma: no cover - guards a TL behaviour change
        raise RuntimeError(f"hooks did not fire: {[wanted[k] for k in missing]}")

    parts = [store[name] for name in embeddings]
    labels = list(embeddings)
    for layer in range(n_layers):
        if per_head:
            result = store[f"attn{layer}"]  # [batch, pos, head, d_model]
            if post:
                result = result * _output_norm_factor(bridge, layer, store).unsqueeze(-2)
            parts.extend(result.unbind(-2))
            labels.extend(f"L{layer}H{h}" for h in range(result.shape[-2]))
            b_O = bridge.blocks[layer].attn.b_O
            if b_O is not None:  # Llama-family attention has no output bias
                parts.append(b_O.detach().expand_as(store["embed"]).clone())
                labels.append(f"L{layer}.attn_bias")
        else:
            parts.append(store[f"attn{layer}"])
            labels.append(f"L{layer}.attn")
        parts.append(store[f"mlp{layer}"])
        labels.append(f"L{layer}.mlp")
    return ResidualDecomposition(
        components=torch.stack(parts),
        labels=labels,
        final_resid=store["final"],
        final_scale=store.get("scale"),
        logits=logits.detach(),
    )


def _has_output_norms(bridge: Any) -> bool:
    return hasattr(bridge.blocks[0], "ln1_post")


def _output_norm_factor(bridge: Any, layer: int, store: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per token, what block ``layer``'s attention-output norm multiplies each channel by, [batch, pos,
    d_model] (or [d_model]): weight / scale. Exact for a fixed norm or an identity (folded); for a real
    norm, the linearisation at the run's own scale (as the final norm's in DLA)."""
    norm = bridge.blocks[layer].ln1_post.original_component
    x = store[f"post_in{layer}"]
    if isinstance(norm, nn.Identity):
        return torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    weight = norm_weight(bridge, norm).to(x.dtype)
    if f"post_scale{layer}" in store:
        return weight / store[f"post_scale{layer}"]
    if isinstance(norm, FixedScaleNorm):
        if norm.state.is_fixed and not norm.state.wants_context:
            return weight / norm.state.sigma.to(x.dtype)
        if norm.state.is_fixed or norm.state.is_blending:
            raise UsageError(f"block {layer}'s attention-output norm has a per-token σ: no per-head split")
        eps = norm.state.eps
    else:
        eps = norm_eps(norm)
    return weight / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def direct_logit_attribution(
    bridge: Any, decomposition: ResidualDecomposition, token_ids: Optional[Sequence[int] | torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Direct contribution of each residual component to the logits.

    Returns ``(contributions [n_components, batch, pos, n_tokens], bias [n_tokens])`` with
    ``contributions.sum(0) + bias == logits[..., token_ids]`` exactly (up to float rounding).
    For a LN-free bridge a component ``c`` contributes ``c @ W_U``; for a LayerNorm bridge the
    final norm is linearised at the run's own scale: ``((c - mean(c)) / scale * w) @ W_U``, with
    ``w`` and the norm bias (identity after ``fold_ln``) taken from the bridge.  ``token_ids``
    restricts the vocabulary columns (all of them by default).
    """
    W_U = bridge.W_U.detach()  # [d_model, d_vocab]
    b_U = bridge.b_U.detach()
    if token_ids is not None:
        index = torch.as_tensor(token_ids, dtype=torch.long, device=W_U.device)
        W_U, b_U = W_U[:, index], b_U[index]
    comps = decomposition.components
    if not _is_normalised(bridge):
        fixed = fixed_final_norm(bridge)
        if fixed is None:
            return comps @ W_U, b_U.clone()
        bias = b_U.clone() if fixed.bias is None else b_U + fixed.bias.to(W_U.dtype) @ W_U
        return fixed.linear(comps) @ W_U, bias
    if decomposition.final_scale is None:
        raise ValueError("the decomposition has no final LayerNorm scale but the bridge normalises")
    norm = bridge.ln_final.original_component
    weight = norm_weight(bridge, norm)
    bias = norm.bias.detach() if getattr(norm, "bias", None) is not None else None
    centred = comps - comps.mean(-1, keepdim=True) if is_layernorm(bridge) else comps
    normed = centred / decomposition.final_scale
    if weight is not None:
        normed = normed * weight
    total_bias = b_U.clone() if bias is None else b_U + bias @ W_U
    return normed @ W_U, total_bias
