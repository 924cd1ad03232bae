"""GPT-2 (`GPT2LMHeadModel`): LayerNorm `ln_1` → fused `c_attn` (Q | K | V, contiguous thirds),
`ln_2` → `mlp.c_fc`, final `transformer.ln_f` → `lm_head` (tied to `wte`). Projections are Conv1D."""

from __future__ import annotations

from transformers import GPT2Config

from lnfree.arch.base import Architecture, BridgeSpec, Consumer, NormSite, UnsupportedModel
from lnfree.errors import UsageError

#: The published GPT-2 sizes (the presets' models) as (blocks, width, heads), so plans and schedules of
#: the presets need neither the weights nor the Hub.
PUBLISHED_SIZES = {
    "openai-community/gpt2": (12, 768, 12), "openai-community/gpt2-medium": (24, 1024, 16),
    "openai-community/gpt2-large": (36, 1280, 20), "openai-community/gpt2-xl": (48, 1600, 25),
}


def published_config(model: str) -> GPT2Config | None:
    """The config of a published GPT-2 size named by its Hub id, else None."""
    if model not in PUBLISHED_SIZES:
        return None
    layers, hidden, heads = PUBLISHED_SIZES[model]
    return GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads)


class GPT2(Architecture):
    family = "gpt2"
    model_types = ("gpt2",)
    norm_kind = "layer"
    eps_field = "layer_norm_epsilon"
    default_eps = 1e-5
    conv1d = True
    final_norm = "transformer.ln_f"
    unembedding = "lm_head"
    token_embedding = "transformer.wte"
    position_embedding = "transformer.wpe"
    layers = "transformer.h"
    attention = "attn"
    attn_out = "attn.c_proj"
    mlp = "mlp"
    mlp_in = ("mlp.c_fc",)
    mlp_out = "mlp.c_proj"
    bridge = BridgeSpec("GPT2LMHeadModel", {"ln1": "ln_1", "ln2": "ln_2"}, "transformer.ln_f")

    def check(self) -> None:
        if getattr(self.config, "add_cross_attention", False):
            raise UnsupportedModel("GPT-2 with cross-attention is not supported")

    def check_bridge(self) -> None:
        if not getattr(self.config, "scale_attn_weights", True):
            raise UsageError(
                "config.scale_attn_weights=False is not supported: TransformerLens' GPT-2 bridge always "
                "scales attention scores by 1/sqrt(d_head)"
            )

    @property
    def n_layers(self) -> int:
        return int(self.config.n_layer)

    @property
    def n_positions(self) -> int:
        return int(self.config.n_positions)

    @property
    def hidden(self) -> int:
        return int(self.config.n_embd)

    @property
    def intermediate(self) -> int:
        return int(self.config.n_inner or 4 * self.config.n_embd)

    @property
    def heads(self) -> int:
        return int(self.config.n_head)

    def block_activations(self) -> tuple[int, int]:
        """Both LayerNorm inputs (fp32); ln_1's output, Q/K/V, the attention output and its contiguous
        copy, ln_2's output; `gelu_new` keeps c_fc's output, tanh, x/2, 1 + tanh and its output. CUDA
        autocast runs `gelu_new`'s x³ in fp32, so c_fc's output (as pow's fp32 input), tanh and 1 + tanh
        are kept in fp32 (measured on an H200: without this GPT-2 small to XL in bf16 peaked 7–10 GB above
        the plan, `benchmarks/results/gpu/`)."""
        d = self.hidden
        return 2 * d + 3 * self.intermediate, 7 * d + 2 * self.intermediate

    def sites(self) -> list[NormSite]:
        d = self.config.n_embd
        sites = []
        for i in range(self.n_layers):
            attn = Consumer(self.block(i, "attn.c_attn"), v_columns=slice(2 * d, 3 * d))
            sites.append(NormSite(self.block(i, "ln_1"), "ln_1", i, (attn,)))
            sites.append(NormSite(self.block(i, "ln_2"), "ln_2", i, (Consumer(self.block(i, "mlp.c_fc")),)))
        sites.append(NormSite(self.final_norm, "ln_f", None, (Consumer(self.unembedding),)))
        return sites
