"""Qwen3 (`Qwen3ForCausalLM`): as Llama, plus per-head RMSNorms `q_norm` / `k_norm` over `head_dim`
(one weight shared by all heads), applied to the `q_proj` / `k_proj` outputs before RoPE.

Fixed-scale, they are linear in the projection's output, so they fold into its rows. Their stage
comes after the ln_1 V paths in the default schedule: once ln_1qk is fixed, a query's per-token
scale is the residual stream's, and freezing it second removes the last per-token division on the
attention logits while the MLP and value paths are already linear.
"""

from __future__ import annotations

from lnfree.arch.base import BridgeSpec, Consumer, NormSite
from lnfree.arch.llama import _BRIDGE_NORMS, Llama


class Qwen3(Llama):
    family = "qwen3"
    model_types = ("qwen3",)
    stages = ("ln_2", "ln_1qk", "ln_1v", "q_norm", "k_norm")
    bridge = BridgeSpec("Qwen3ForCausalLM", _BRIDGE_NORMS, "model.norm", {"q_norm": "q_norm", "k_norm": "k_norm"})

    @property
    def bridge_architecture(self) -> str:
        return "Qwen3ForCausalLM"

    def attention_sites(self, i: int) -> list[NormSite]:
        sites = super().attention_sites(i)
        for name, proj in (("q_norm", "q_proj"), ("k_norm", "k_proj")):
            producer = (Consumer(self.block(i, f"self_attn.{proj}")),)
            # (batch, positions, heads, head_dim): Qwen3 normalises q and k before the transpose
            sites.append(NormSite(self.block(i, f"self_attn.{name}"), name, i, producer, per_head=True, heads_axis=2))
        return sites
