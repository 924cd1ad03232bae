"""TransformerLens (4.x) bridges around models of every supported family, with or without norms.

TransformerLens 4 dropped ``HookedTransformer``; its analysis object is ``TransformerBridge``, which
wraps a live Hugging Face module and exposes the familiar hook points (``run_with_cache``,
``run_with_hooks``, ``hooks``) and weight views (``W_U``, ``b_U``, ``W_O``...).  This module builds
bridges for the two kinds of model lnfree deals with, without ever touching the network:

* :func:`bridge_from_folded` -- an *exactly LayerNorm-free* model (any family of ``lnfree.arch``)
  whose norms are ``nn.Identity`` (the fixed scales and affine parameters folded into the
  projections and an untied unembedding that may carry a bias).  The bridge has
  ``cfg.normalization_type = None`` and pass-through norm slots, so its logits equal the HF model's
  and the residual stream decomposes linearly into logits.
* :func:`bridge_from_layernorm` -- an ordinary GPT-2 with real ``nn.LayerNorm`` modules (any eps,
  including the "eps-trick" export with ``eps=1e12`` and huge weights).  By default the bridge is put
  in compatibility mode (``fold_ln`` + centring of the writing weights), the coordinate system in
  which direct logit attribution through the final LayerNorm's scale is meaningful.

Helpers for analyses: :func:`bridge_logits`, :func:`hook_name` (the exact hook-point names).
`lnfree.analysis.attribution` splits a bridge's residual stream by component and gives each component's direct
logit attribution (exact per-component logit contributions for both kinds of bridge).

TransformerLens 4.3 APIs used
-----------------------------
* ``transformer_lens.model_bridge.sources._bridge_builder.build_bridge_from_module(model,
  "GPT2LMHeadModel", hf_config=..., post_adapter_hook=...)`` builds a bridge from an in-memory
  module.  (``TransformerBridge.boot_transformers(name)`` would download from the Hub.)
* ``post_adapter_hook(adapter)`` swaps the three norm slots of the GPT-2 adapter's
  ``component_mapping`` (``"ln_final"``, and ``"ln1"``/``"ln2"`` in ``component_mapping["blocks"]
  .submodules``) for plain ``GeneralizedComponent`` pass-throughs and sets
  ``adapter.cfg.normalization_type = None`` -- exactly what TL's own native adapter does for
  norm-free models (``supported_architectures/native.py``, ``_make_norm_bridge``).
* ``TransformerBridge.enable_compatibility_mode(disable_warnings=True, center_unembed=...)``.
* ``TransformerBridge.set_use_attn_result(True)`` before reading per-head ``attn.hook_result``.
* ``TransformerBridge.hooks(fwd_hooks=..., bwd_hooks=...)`` (context manager) for caching and
  gradients, and the weight views ``W_U``, ``b_U``, ``blocks[l].attn.b_O``.
* ``transformer_lens.model_bridge.sources._bridge_builder.detect_tokenizer_bos_eos``.

Traps found (TL 4.3.0, transformers 5.23)
-----------------------------------------
* ``build_bridge_from_module`` rewires the module tree it is given in place (bridge components
  replace submodules; compatibility mode rewrites weights): always give it a deep copy.
* Passing ``tokenizer=`` to ``build_bridge_from_module`` runs ``get_tokenizer_with_bos``, which
  *reloads* the tokenizer with ``AutoTokenizer.from_pretrained(init_kwargs["name_or_path"])`` --
  a Hub call for a tokenizer loaded by name, and a ``KeyError: 'name_or_path'`` for a tokenizer
  built in memory.  We build without a tokenizer and attach a copy afterwards (see
  :func:`_attach_tokenizer`).
* ``NormalizationBridge`` does not call the wrapped LayerNorm in the default mode: it recomputes
  a LayerNorm from ``cfg.eps`` (taken from ``config.layer_norm_epsilon``), ignoring the module's
  own ``eps``.  A model whose LN modules' eps differs from its config (e.g. an eps-trick model with
  a stale config) gives logits off by ~1e5.  We set the bridge config's eps from the modules.
  It also cannot wrap an ``nn.Identity`` (``AttributeError``), hence the pass-through slots.
* ``enable_compatibility_mode`` centres the unembedding by default, which shifts every position's
  logits by a constant (log-probabilities are unchanged, raw logits are not).  We default to
  ``center_unembed=False`` so the bridge's logits equal the HF model's.  After ``fold_ln`` the
  bridge's LN modules have weight 1 / bias 0 but ``cfg.normalization_type`` stays ``"LN"``.
* The bridge re-implements GPT-2 attention itself (after splitting ``c_attn``): it always scales
  scores by ``1/sqrt(d_head)`` and ignores ``config.scale_attn_weights=False`` (logits then differ
  by ~1e-3).  Such configs are rejected.  ``scale_attn_by_inverse_layer_idx`` and
  ``reorder_and_upcast_attn`` are honoured.
* A hook function's ``hook.name`` is often not the name it was registered under: legacy names are
  aliases, and e.g. ``blocks.0.hook_resid_pre`` fires as ``blocks.0.hook_in`` in both modes, while
  ``hook_embed``, ``blocks.0.attn.hook_z`` and ``blocks.0.mlp.hook_post`` fire as ``embed.hook_out``,
  ``blocks.0.attn.o.hook_in`` and ``blocks.0.mlp.out.hook_in`` outside compatibility mode only.
  ``run_with_cache(names_filter=[...])`` likewise stores canonical keys.  Key results by your own
  variables (closures), as `lnfree.analysis.attribution.residual_decomposition` does.
* ``enable_compatibility_mode`` on a LN-free bridge skips the LN fold and the writing-weight
  centring (``normalization_type`` is None) but still centres the unembedding unless told not to.
* The per-head ``hook_result`` exists only while ``cfg.use_attn_result`` is on (toggle with
  ``set_use_attn_result``); heads summed plus ``blocks[l].attn.b_O`` give ``hook_attn_out``.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import nn

from lnfree.arch import Architecture, architecture
from lnfree.arch.base import norm_eps
from lnfree.fixedscale.norms import FixedScaleNorm
from lnfree.errors import UsageError

__all__ = [
    "HOOK_NAMES",
    "LAST_POSITION_LOGITS",
    "as_batch",
    "bridge_from_folded",
    "bridge_from_layernorm",
    "bridge_logits",
    "hook_name",
    "is_layernorm_free",
    "norm_centres",
    "norm_weight",
]

#: Hook-point names (TL 4.3 legacy-compatible aliases; they resolve in both modes).
HOOK_NAMES: dict[str, str] = {
    "embed": "hook_embed",  # [batch, pos, d_model]
    "pos_embed": "hook_pos_embed",  # [batch, pos, d_model]; learned positional embeddings only
    "resid_pre": "blocks.{layer}.hook_resid_pre",  # [batch, pos, d_model]
    "resid_mid": "blocks.{layer}.hook_resid_mid",  # [batch, pos, d_model]
    "resid_post": "blocks.{layer}.hook_resid_post",  # [batch, pos, d_model]
    "attn_out": "blocks.{layer}.hook_attn_out",  # [batch, pos, d_model], includes b_O
    "mlp_out": "blocks.{layer}.hook_mlp_out",  # [batch, pos, d_model], includes b_out
    "q": "blocks.{layer}.attn.hook_q",  # [batch, pos, head, d_head]
    "k": "blocks.{layer}.attn.hook_k",  # [batch, pos, head, d_head]
    "v": "blocks.{layer}.attn.hook_v",  # [batch, pos, head, d_head]
    "z": "blocks.{layer}.attn.hook_z",  # [batch, pos, head, d_head]
    "result": "blocks.{layer}.attn.hook_result",  # [batch, pos, head, d_model]; needs use_attn_result
    "attn_scores": "blocks.{layer}.attn.hook_attn_scores",  # [batch, head, q_pos, k_pos]
    "pattern": "blocks.{layer}.attn.hook_pattern",  # [batch, head, q_pos, k_pos]
    "mlp_pre": "blocks.{layer}.mlp.hook_pre",  # [batch, pos, d_mlp]
    "mlp_post": "blocks.{layer}.mlp.hook_post",  # [batch, pos, d_mlp]
    "ln1_scale": "blocks.{layer}.ln1.hook_scale",  # [batch, pos, 1]; LN bridges only
    "ln2_scale": "blocks.{layer}.ln2.hook_scale",  # [batch, pos, 1]; LN bridges only
    "ln_final_in": "ln_final.hook_in",  # [batch, pos, d_model]: the final residual stream
    "ln_final_scale": "ln_final.hook_scale",  # [batch, pos, 1]; LN bridges only
    "logits": "unembed.hook_out",  # [batch, pos, d_vocab]
}


def hook_name(kind: str, layer: Optional[int] = None) -> str:
    """The bridge hook-point name for ``kind`` (a key of :data:`HOOK_NAMES`) at ``layer``."""
    try:
        template = HOOK_NAMES[kind]
    except KeyError:
        raise KeyError(f"unknown hook kind {kind!r}; known: {sorted(HOOK_NAMES)}") from None
    if "{layer}" in template:
        if layer is None:
            raise UsageError(f"hook kind {kind!r} needs a layer index")
        return template.format(layer=layer)
    return template


# ----------------------------------------------------------------------------------------------
# Building bridges
# ----------------------------------------------------------------------------------------------


def _build_bridge_from_module():
    # Imported lazily: transformer_lens is heavy to import, and only this module needs it.
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    return build_bridge_from_module


def _check(model: nn.Module) -> Architecture:
    arch = architecture(model)
    arch.check_bridge()
    return arch


def _attach_tokenizer(bridge: Any, tokenizer: Any) -> None:
    """Give ``bridge`` a copy of ``tokenizer`` without TL's reload-from-``name_or_path`` step."""
    if tokenizer is None:
        return
    from transformer_lens.model_bridge.sources._bridge_builder import detect_tokenizer_bos_eos

    tok = copy.deepcopy(tokenizer)  # TL sets pad/bos tokens in place; keep the caller's intact
    if tok.eos_token is None:
        raise UsageError("the tokenizer needs an eos_token")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.bos_token is None:
        tok.bos_token = tok.eos_token
    if tok.padding_side is None:
        tok.padding_side = "right"
    if len(tok) > bridge.cfg.d_vocab:
        raise UsageError(f"tokenizer has {len(tok)} tokens but the model's vocabulary is {bridge.cfg.d_vocab}")
    bridge.cfg.tokenizer_prepends_bos, bridge.cfg.tokenizer_appends_eos = detect_tokenizer_bos_eos(tok)
    bridge.tokenizer = tok  # first assignment: only infers d_vocab if unset (it is set)
    driver = getattr(bridge, "_driver", None)
    if driver is not None and hasattr(driver, "tokenizer"):
        driver.tokenizer = tok


def _norm_slots(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(site.module, model.get_submodule(site.module)) for site in architecture(model).sites()]


def is_layernorm_free(model: nn.Module) -> bool:
    """True when every norm of ``model`` is an ``nn.Identity``."""
    return all(isinstance(module, nn.Identity) for _, module in _norm_slots(model))


def _pass_through_norms(arch: Architecture):
    """A ``post_adapter_hook`` making every norm component of TL's adapter a pass-through."""
    from transformer_lens.model_bridge.generalized_components.base import GeneralizedComponent

    spec = arch.bridge

    def hook(adapter: Any) -> None:
        adapter.cfg.normalization_type = None
        mapping = adapter.component_mapping
        mapping["ln_final"] = GeneralizedComponent(name=spec.final_norm, config=adapter.cfg)
        blocks = mapping["blocks"]
        for key, name in spec.norms.items():
            blocks.submodules[key] = GeneralizedComponent(name=name, config=adapter.cfg)
        for key, name in spec.attn_norms.items():
            blocks.submodules["attn"].submodules[key] = GeneralizedComponent(name=name, config=adapter.cfg)

    return hook


def bridge_from_folded(model: nn.Module, tokenizer: Any = None, *, private: bool = False) -> Any:
    """An exact ``TransformerBridge`` around an LN-free model (norms folded away).

    Every norm of ``model`` must be an ``nn.Identity``; its ``lm_head`` may be an
    untied ``nn.Linear`` with a bias (the folded ``ln_f`` bias), which the bridge's unembedding
    applies (``bridge.b_U``).  The bridge has ``cfg.normalization_type = None`` and its ``ln1``,
    ``ln2`` and ``ln_final`` are pass-throughs (they only fire ``hook_in``/``hook_out``).  The
    caller's model and tokenizer are not modified, unless ``private``: a model made for this bridge
    alone (e.g. ``fold``'s), which the bridge then takes over instead of copying (one copy fewer).
    """
    _check(model)
    not_free = [name for name, module in _norm_slots(model) if not isinstance(module, nn.Identity)]
    if not_free:
        raise UsageError(f"model is not LayerNorm-free: {', '.join(not_free)} are not nn.Identity")
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(f"the unembedding must be an nn.Linear, got {type(head).__name__}")
    d_vocab = head.weight.shape[0]
    if d_vocab != model.config.vocab_size:
        raise UsageError(f"the unembedding has {d_vocab} outputs, expected {model.config.vocab_size}")

    return _pass_through_bridge(model, tokenizer, private)


def bridge_with_own_norms(model: nn.Module, tokenizer: Any = None, *, private: bool = False) -> Any:
    """An exact ``TransformerBridge`` whose norm slots call ``model``'s own norm modules.

    For partially LN-free models: each norm may be any module (a real norm, an ``lnfree``
    fixed-scale ``FixedScaleNorm`` or an identity); the bridge's
    pass-through slots run them as they are. The residual stream is then not linear in the
    components wherever a norm is real, so per-component attribution is exact only through
    fixed-scale norms. The caller's model is not modified, unless ``private`` (see :func:`bridge_from_folded`).
    """
    _check(model)
    if not isinstance(model.get_output_embeddings(), nn.Linear):
        raise TypeError(f"the unembedding must be an nn.Linear, got {type(model.get_output_embeddings()).__name__}")
    return _pass_through_bridge(model, tokenizer, private)


def _private(model: nn.Module, private: bool) -> nn.Module:
    """The module tree a bridge may rewire: ``model`` itself when it is ``private``, else a deep copy."""
    return (model if private else copy.deepcopy(model)).eval()


def _pass_through_bridge(model: nn.Module, tokenizer: Any, private: bool = False) -> Any:
    arch = _check(model)
    head = model.get_output_embeddings()
    d_vocab = head.weight.shape[0]
    expected_bias = head.bias.detach().clone() if head.bias is not None else torch.zeros(d_vocab, dtype=head.weight.dtype)
    local = _private(model, private)
    # The head is its own module (possibly with a bias); nothing must re-tie it to the embedding.
    local.config.tie_word_embeddings = False
    local_head = local.get_output_embeddings()  # the bridge replaces the attribute with its own component
    bridge = _build_bridge_from_module()(
        local, arch.bridge_architecture, hf_config=local.config, post_adapter_hook=_pass_through_norms(arch)
    )
    if bridge.cfg.normalization_type is not None:  # pragma: no cover - guards a TL behaviour change
        raise RuntimeError("TransformerLens reset normalization_type on a LN-free bridge")

    # The unembedding must honour the head's bias (TL's UnembeddingBridge calls the wrapped
    # nn.Linear, and only adds a zero buffer when there is no bias).  Check rather than trust.
    unembed = bridge.unembed.original_component
    if unembed is not local_head:  # pragma: no cover - guards a TL behaviour change
        raise RuntimeError("the bridge's unembedding does not wrap the model's unembedding")
    if not torch.equal(bridge.b_U.detach().cpu(), expected_bias.detach().cpu()):  # pragma: no cover
        raise RuntimeError("the bridge's unembedding bias differs from the model's head bias")

    _attach_tokenizer(bridge, tokenizer)
    bridge.lnfree_norm_kind = arch.norm_kind
    bridge.lnfree_norm_weight_offset = arch.norm_weight_offset
    return bridge


def _common_eps(model: nn.Module) -> float:
    eps_values = set()
    for name, module in _norm_slots(model):
        try:
            eps_values.add(norm_eps(module))
        except TypeError:
            raise TypeError(f"{name} is a {type(module).__name__}, expected the family's real norm") from None
    if len(eps_values) != 1:
        raise UsageError(f"the norms use different eps values {sorted(eps_values)}; TransformerLens uses one cfg.eps")
    return eps_values.pop()


def _make_affine(model: nn.Module) -> None:
    """Give every LayerNorm of ``model`` (a private copy) a weight and a bias, as TL expects."""
    ref = next(model.parameters())
    for _, module in _norm_slots(model):
        if not isinstance(module, nn.LayerNorm):
            continue
        if module.weight is None:
            module.weight = nn.Parameter(torch.ones(module.normalized_shape, dtype=ref.dtype, device=ref.device))
        if module.bias is None:
            module.bias = nn.Parameter(torch.zeros(module.normalized_shape, dtype=ref.dtype, device=ref.device))
        module.elementwise_affine = True


def _folds_value_biases(model: nn.Module, arch: Architecture) -> bool:
    """Whether TL's ``fold_value_biases`` step can change anything: not for an RMSNorm model without
    attention biases (no value bias to fold, no output bias to centre), where it would only copy every
    weight once more (1.7 GB for Gemma 3 270M) before the bridge takes them."""
    if arch.norm_kind == "layer":
        return True
    return any(name.endswith("bias") for i in range(arch.n_layers)
               for name, _ in model.get_submodule(arch.block(i, arch.attention)).named_parameters())


def bridge_from_layernorm(
    model: nn.Module,
    tokenizer: Any = None,
    *,
    compatibility_mode: bool = True,
    center_unembed: bool = False,
    private: bool = False,
) -> Any:
    """A ``TransformerBridge`` around a model with real norms (LayerNorm or RMSNorm).

    Works for any eps, including the eps-trick format (``eps=1e12``, weights scaled by
    ``1e6/sigma``): the bridge's ``cfg.eps`` is taken from the LayerNorm modules (which must share
    one eps), not from ``config.layer_norm_epsilon``.  With ``compatibility_mode`` (default) the
    LayerNorms are folded into the following layers and the writing weights centred (TL's
    ``enable_compatibility_mode``); ``center_unembed`` is off by default so that the bridge's
    logits equal the HF model's (centring shifts each position's logits by a constant).  The
    caller's model and tokenizer are not modified, unless ``private`` (see :func:`bridge_from_folded`).
    """
    arch = _check(model)
    eps = _common_eps(model)

    local = _private(model, private)
    _make_affine(local)
    arch.set_eps(local.config, eps)  # TL's norm bridge reads cfg.eps, not the module's eps
    value_biases = _folds_value_biases(local, arch)
    bridge = _build_bridge_from_module()(local, arch.bridge_architecture, hf_config=local.config)
    if float(bridge.cfg.eps) != eps:  # pragma: no cover - guards a TL behaviour change
        raise RuntimeError(f"bridge cfg.eps={bridge.cfg.eps} differs from the LayerNorm eps {eps}")
    if compatibility_mode:
        bridge.enable_compatibility_mode(disable_warnings=True, center_unembed=center_unembed,
                                         fold_value_biases=value_biases)
    _attach_tokenizer(bridge, tokenizer)
    bridge.lnfree_norm_kind = arch.norm_kind
    bridge.lnfree_norm_weight_offset = arch.norm_weight_offset
    return bridge


# ----------------------------------------------------------------------------------------------
# Analysis helpers
# ----------------------------------------------------------------------------------------------


def as_batch(input_ids: Any, bridge: Any) -> torch.Tensor:
    """Token ids as a ``[batch, pos]`` long tensor on the bridge's device."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.ndim == 1:
        ids = ids.unsqueeze(0)
    if ids.ndim != 2:
        raise UsageError(f"input_ids must be [batch, pos] or [pos], got shape {tuple(ids.shape)}")
    return ids.to(bridge.cfg.device)


def _keep_last_position(x: torch.Tensor, hook: Any) -> torch.Tensor:
    return x[:, -1:]


#: A forward hook (name, function) after which the unembedding sees only each sequence's last position:
#: logits ``[batch, 1, d_vocab]`` instead of ``[batch, pos, d_vocab]``, for passes that read no other
#: position's logits (a Gemma-sized vocabulary makes them the largest tensor of a pass).
LAST_POSITION_LOGITS = ("unembed.hook_in", _keep_last_position)


def bridge_logits(bridge: Any, input_ids: Any) -> torch.Tensor:
    """Logits ``[batch, pos, d_vocab]`` of ``bridge`` on token ids (no gradient tracking)."""
    with torch.no_grad():
        return bridge(as_batch(input_ids, bridge), return_type="logits")


def norm_centres(bridge: Any) -> bool:
    """True when the model's norms (real or folded away) centre their input: LayerNorm, not RMSNorm."""
    return getattr(bridge, "lnfree_norm_kind", "layer") == "layer"


def norm_weight(bridge: Any, norm: nn.Module) -> Optional[torch.Tensor]:
    """The weight ``norm`` multiplies by (detached): its parameter, plus the family's offset for a plain
    norm that stores weight − offset (Gemma's 1 + weight); lnfree's installed norms hold it as it is."""
    weight = getattr(norm, "weight", None)
    if weight is None:
        return None
    if isinstance(norm, FixedScaleNorm):
        return weight.detach()
    return weight.detach() + getattr(bridge, "lnfree_norm_weight_offset", 0.0)
