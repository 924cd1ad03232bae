"""GPT-NeoX / Pythia (`GPTNeoXForCausalLM`): LayerNorms with bias.

`input_layernorm` → the fused `attention.query_key_value`, whose output is viewed as
(heads, 3·head_size), so the Q, K and V columns interleave per head; `post_attention_layernorm` →
`mlp.dense_h_to_4h`; final `gpt_neox.final_layer_norm` → `lm_head` (`embed_out` in older
checkpoints; untied in Pythia). With `use_parallel_residual` both block norms read the same
residual stream; they remain separate slots either way.
"""

from __future__ import annotations

from lnfree.arch.base import Architecture, BridgeSpec, Consumer, NormSite


class GPTNeoX(Architecture):
    family = "gpt_neox"
    model_types = ("gpt_neox",)
    norm_kind = "layer"
    eps_field = "layer_norm_eps"
    default_eps = 1e-5
    final_norm = "gpt_neox.final_layer_norm"
    unembedding = "lm_head"
    token_embedding = "gpt_neox.embed_in"
    layers = "gpt_neox.layers"
    attention = "attention"
    attn_out = "attention.dense"
    mlp = "mlp"
    mlp_in = ("mlp.dense_h_to_4h",)
    mlp_out = "mlp.dense_4h_to_h"
    bridge = BridgeSpec(
        "GPTNeoXForCausalLM", {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}, "gpt_neox.final_layer_norm"
    )

    def block_activations(self) -> tuple[int, int]:
        """As GPT-2's, with an exact GELU (its input and output)."""
        d = self.hidden
        return 2 * d, 7 * d + 2 * self.intermediate

    def v_columns(self) -> tuple[int, ...]:
        """Output features of `query_key_value` on the V path: the last third of each head's block."""
        heads = self.config.num_attention_heads
        size = self.config.hidden_size // heads
        return tuple(h * 3 * size + 2 * size + j for h in range(heads) for j in range(size))

    def sites(self) -> list[NormSite]:
        v = self.v_columns()
        sites = []
        for i in range(self.n_layers):
            qkv = Consumer(self.block(i, "attention.query_key_value"), v_columns=v)
            sites.append(NormSite(self.block(i, "input_layernorm"), "ln_1", i, (qkv,)))
            mlp = (Consumer(self.block(i, "mlp.dense_h_to_4h")),)
            sites.append(NormSite(self.block(i, "post_attention_layernorm"), "ln_2", i, mlp))
        sites.append(NormSite(self.final_norm, "ln_f", None, (Consumer(self.unembedding),)))
        return sites
