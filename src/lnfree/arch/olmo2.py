"""OLMo 2 (`Olmo2ForCausalLM`): norms on the sublayer outputs only, none on their inputs.

`q_proj` → `q_norm` and `k_proj` → `k_norm` (RMSNorms over the whole projection, not per head), the
attention → `post_attention_layernorm`, the gated MLP → `post_feedforward_layernorm`, each before its
residual add, and the final `model.norm`. Every norm of a block is on a projection's output, so each
folds into its producer's rows once fixed (`NormSite.folds_into_producer`); only the final norm reads
the residual stream.
"""

from __future__ import annotations

from lnfree.arch.base import Architecture, BridgeSpec, Consumer, NormSite

_BRIDGE_NORMS = {"ln1_post": "post_attention_layernorm", "ln2_post": "post_feedforward_layernorm"}


class Olmo2(Architecture):
    family = "olmo2"
    model_types = ("olmo2",)
    norm_kind = "rms"
    eps_field = "rms_norm_eps"
    default_eps = 1e-6
    stages = ("q_norm", "k_norm", "post_attn", "post_mlp")
    final_norm = "model.norm"
    unembedding = "lm_head"
    token_embedding = "model.embed_tokens"
    layers = "model.layers"
    attention = "self_attn"
    attn_out = "self_attn.o_proj"
    mlp = "mlp"
    mlp_in = ("mlp.gate_proj", "mlp.up_proj")
    mlp_out = "mlp.down_proj"
    bridge = BridgeSpec("Olmo2ForCausalLM", _BRIDGE_NORMS, "model.norm", {"q_norm": "q_norm", "k_norm": "k_norm"})

    def sites(self) -> list[NormSite]:
        sites = []
        for i in range(self.n_layers):
            attn = lambda name: self.block(i, f"self_attn.{name}")  # noqa: E731
            for name, proj in (("q_norm", "q_proj"), ("k_norm", "k_proj")):
                sites.append(NormSite(attn(name), name, i, (Consumer(attn(proj)),), on_output=True))
            sites.append(NormSite(self.block(i, "post_attention_layernorm"), "post_attn", i,
                                  (Consumer(self.block(i, self.attn_out)),), on_output=True))
            sites.append(NormSite(self.block(i, "post_feedforward_layernorm"), "post_mlp", i,
                                  (Consumer(self.block(i, self.mlp_out)),), on_output=True))
        sites.append(NormSite(self.final_norm, "ln_f", None, (Consumer(self.unembedding),)))
        return sites
