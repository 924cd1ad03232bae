"""Llama, Mistral and Qwen2 (`LlamaForCausalLM` and kin): RMSNorm `input_layernorm` → separate
`q_proj`, `k_proj`, `v_proj` (grouped-query attention), `post_attention_layernorm` → the gated MLP's
`gate_proj` and `up_proj`, final `model.norm` → `lm_head` (tied or not)."""

from __future__ import annotations

from lnfree.arch.base import Architecture, BridgeSpec, Consumer, NormSite

_BRIDGE_NORMS = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}


class Llama(Architecture):
    family = "llama"
    model_types = ("llama", "mistral", "qwen2")
    norm_kind = "rms"
    eps_field = "rms_norm_eps"
    default_eps = 1e-6
    final_norm = "model.norm"
    unembedding = "lm_head"
    token_embedding = "model.embed_tokens"
    layers = "model.layers"
    attention = "self_attn"
    attn_out = "self_attn.o_proj"
    mlp = "mlp"
    mlp_in = ("mlp.gate_proj", "mlp.up_proj")
    mlp_out = "mlp.down_proj"
    bridge = BridgeSpec("LlamaForCausalLM", _BRIDGE_NORMS, "model.norm")

    @property
    def bridge_architecture(self) -> str:
        return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[
            self.config.model_type
        ]

    def attention_sites(self, i: int) -> list[NormSite]:
        """The attention-input norm, read by the three projections (V only by `v_proj`)."""
        consumers = (
            Consumer(self.block(i, "self_attn.q_proj")),
            Consumer(self.block(i, "self_attn.k_proj")),
            Consumer(self.block(i, "self_attn.v_proj"), v_columns="all"),
        )
        return [NormSite(self.block(i, "input_layernorm"), "ln_1", i, consumers)]

    def sites(self) -> list[NormSite]:
        sites = []
        for i in range(self.n_layers):
            sites += self.attention_sites(i)
            mlp = (Consumer(self.block(i, "mlp.gate_proj")), Consumer(self.block(i, "mlp.up_proj")))
            sites.append(NormSite(self.block(i, "post_attention_layernorm"), "ln_2", i, mlp))
        sites.append(NormSite(self.final_norm, "ln_f", None, (Consumer(self.unembedding),)))
        return sites
