"""Gemma 3 (`Gemma3ForCausalLM`, text model type `gemma3_text`): a sandwich of four RMSNorms per block.

`input_layernorm` → `q_proj`/`k_proj`/`v_proj` (grouped-query attention), per-head `q_norm`/`k_norm`,
`post_attention_layernorm` on the attention output (after `o_proj`, before the residual add),
`pre_feedforward_layernorm` → the gated MLP's `gate_proj`/`up_proj`, `post_feedforward_layernorm` on
the MLP output (after `down_proj`), and the final `model.norm`. Every RMSNorm multiplies by
(1 + weight), in fp32; the token embedding is scaled by √hidden inside the embedding module.

A fixed-scale output norm is linear in its sublayer's output (w ⊙ y / σ), so it folds into the rows of
`o_proj` / `down_proj`, like the per-head norms into `q_proj` / `k_proj`. A real output norm bounds
the sublayer's contribution whatever the scale of its input, so the default schedule fixes the
input-side norms first, with every output norm still real, and the output norms last; within each
side, cheapest first, as measured on Gemma 3 270M without fine-tuning
(`experiments/results/gemma3-270m/fix_by_kind/`: every block's ln_1qk +0.000 nats, since q_norm and
k_norm rescale the queries and keys anyway; ln_2 +0.14; q_norm +0.19; ln_1v +2.4; k_norm +5.4;
post_attn +0.84; post_mlp +3.9).
"""

from __future__ import annotations

from lnfree.arch.base import Architecture, BridgeSpec, Consumer, NormSite, UnsupportedModel

_BRIDGE_NORMS = {"ln1": "input_layernorm", "ln1_post": "post_attention_layernorm",
                 "ln2": "pre_feedforward_layernorm", "ln2_post": "post_feedforward_layernorm"}


class Gemma3(Architecture):
    family = "gemma3"
    model_types = ("gemma3_text",)
    norm_kind = "rms"
    norm_weight_offset = 1.0
    prepends_bos = True
    eps_field = "rms_norm_eps"
    default_eps = 1e-6
    stages = ("ln_1qk", "ln_2", "q_norm", "ln_1v", "k_norm", "post_attn", "post_mlp")
    final_norm = "model.norm"
    unembedding = "lm_head"
    token_embedding = "model.embed_tokens"
    layers = "model.layers"
    attention = "self_attn"
    attn_out = "self_attn.o_proj"
    mlp = "mlp"
    mlp_in = ("mlp.gate_proj", "mlp.up_proj")
    mlp_out = "mlp.down_proj"
    bridge = BridgeSpec("Gemma3ForCausalLM", _BRIDGE_NORMS, "model.norm", {"q_norm": "q_norm", "k_norm": "k_norm"})

    def check(self) -> None:
        if getattr(self.config, "final_logit_softcapping", None):
            raise UnsupportedModel(
                "final_logit_softcapping is set: a non-linearity after the final norm, so no norm-free model can "
                "have exact direct logit attribution; lnfree does not remove norms from such models"
            )

    def sites(self) -> list[NormSite]:
        sites = []
        for i in range(self.n_layers):
            attn = lambda name: self.block(i, f"self_attn.{name}")  # noqa: E731
            qkv = (Consumer(attn("q_proj")), Consumer(attn("k_proj")), Consumer(attn("v_proj"), v_columns="all"))
            sites.append(NormSite(self.block(i, "input_layernorm"), "ln_1", i, qkv))
            for name, proj in (("q_norm", "q_proj"), ("k_norm", "k_proj")):
                # (batch, heads, positions, head_dim): Gemma 3 normalises q and k after the transpose
                sites.append(NormSite(attn(name), name, i, (Consumer(attn(proj)),), per_head=True, heads_axis=1))
            sites.append(NormSite(self.block(i, "post_attention_layernorm"), "post_attn", i,
                                  (Consumer(self.block(i, self.attn_out)),), on_output=True))
            mlp = (Consumer(self.block(i, "mlp.gate_proj")), Consumer(self.block(i, "mlp.up_proj")))
            sites.append(NormSite(self.block(i, "pre_feedforward_layernorm"), "ln_2", i, mlp))
            sites.append(NormSite(self.block(i, "post_feedforward_layernorm"), "post_mlp", i,
                                  (Consumer(self.block(i, self.mlp_out)),), on_output=True))
        sites.append(NormSite(self.final_norm, "ln_f", None, (Consumer(self.unembedding),)))
        return sites
