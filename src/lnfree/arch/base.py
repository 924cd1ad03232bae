"""The shared interface of the architecture adapters: where a family's norms sit and what reads them.

An adapter describes one model family declaratively. Its `sites()` list every norm of a model
(`NormSite`): the module's path, the schedule stage it belongs to, and the projections that read
its output (`Consumer`), which is all that installing, exporting, loading and folding need.
Everything outside `lnfree.arch` works from these descriptions and never names a submodule.

Slot names (the scale states a schedule switches) are shared by every family:
`blocks.{i}.ln_1qk` / `blocks.{i}.ln_1v` (the attention-input norm's Q/K and V paths),
`blocks.{i}.ln_2` (the MLP-input norm), `blocks.{i}.q_norm` / `blocks.{i}.k_norm` (per-head
query/key norms), `blocks.{i}.post_attn` / `blocks.{i}.post_mlp` (norms on a sublayer's output,
before it joins the residual stream) and `ln_f` (the final norm).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from lnfree.errors import LnfreeError

#: The two norms a family can use: LayerNorm (centres, then divides by the std) or RMSNorm.
NormKind = Literal["layer", "rms"]



@dataclass(frozen=True)
class Consumer:
    """A projection that reads a norm's output (or, for a per-head norm, produces its input).

    `v_columns` (attention-input norms only) selects the output features on the V path: None
    (all Q/K), "all", a slice, or a tuple of column indices.
    """

    path: str
    v_columns: Any = None


@dataclass(frozen=True)
class NormSite:
    """One norm of the model: its module path, schedule stage, layer and consumers."""

    module: str
    stage: str  # "ln_1" (split into ln_1qk / ln_1v), "ln_2", "q_norm", "k_norm", "post_attn", "post_mlp" or "ln_f"
    layer: int | None
    consumers: tuple[Consumer, ...]
    per_head: bool = False  # normalises a projection's per-head output (folds into that projection's rows)
    heads_axis: int | None = None  # per-head norms: the heads' axis in the norm input's token shape (batch first)
    on_output: bool = False  # normalises a sublayer's output (Gemma 3's post-norms): folds into its producer's rows

    @property
    def folds_into_producer(self) -> bool:
        """True when the consumers are the projections that produce the norm's input (their rows scale)."""
        return self.per_head or self.on_output

    @property
    def split(self) -> bool:
        return self.stage == "ln_1"

    @property
    def slots(self) -> tuple[str, ...]:
        """The slot names of this site's scale states."""
        stages = ("ln_1qk", "ln_1v") if self.split else (self.stage,)
        return tuple(s if self.layer is None else f"blocks.{self.layer}.{s}" for s in stages)


@dataclass(frozen=True)
class BridgeSpec:
    """How TransformerLens 4 names this family: its adapter key and the norm components to pass through."""

    architecture: str
    norms: dict[str, str]  # TL component key in the block ("ln1", "ln2") → the block-relative HF module name
    final_norm: str  # TL's "ln_final" → the HF module path
    attn_norms: dict[str, str] = field(default_factory=dict)  # TL keys inside "attn" (Qwen3 q_norm/k_norm)


class Architecture:
    """Base class of a family adapter. Subclasses fill the class variables and `sites()`."""

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    norm_kind: ClassVar[NormKind]
    # The norm multiplies by (offset + weight): Gemma's RMSNorm stores weight − 1. Installed norms hold
    # the effective weight (offset + weight); the plain formats (export, load) add and remove the offset.
    norm_weight_offset: ClassVar[float] = 0.0
    # Every sequence must start with the tokenizer's BOS token (Gemma 3 270M: held-out CE 6.8 on windows
    # cut from a token stream, 3.4 with BOS first); lnfree.data.documents then cuts context − 1 tokens and prepends it.
    prepends_bos: ClassVar[bool] = False
    eps_field: ClassVar[str]  # config attribute holding the norms' eps
    default_eps: ClassVar[float]
    conv1d: ClassVar[bool] = False  # projections store (in, out) weights (GPT-2's Conv1D)
    stages: ClassVar[tuple[str, ...]] = ("ln_2", "ln_1qk", "ln_1v")  # per-layer stages in default order
    final_norm: ClassVar[str]
    unembedding: ClassVar[str]
    token_embedding: ClassVar[str]
    position_embedding: ClassVar[str | None] = None
    layers: ClassVar[str]  # path of the ModuleList of blocks
    attention: ClassVar[str]  # block-relative path of the attention module
    attn_out: ClassVar[str]  # block-relative path of the attention's output projection
    mlp: ClassVar[str]  # block-relative path of the MLP
    mlp_in: ClassVar[tuple[str, ...]]  # block-relative paths of the MLP's input projections (one output feature per neuron)
    mlp_out: ClassVar[str]  # block-relative path of the MLP's output projection (its input: the neurons' activations)
    bridge: ClassVar[BridgeSpec]

    def __init__(self, config):
        self.config = config
        self.check()

    def check(self) -> None:
        """Refuse configurations this adapter does not handle (raise `UnsupportedModel`)."""

    def check_bridge(self) -> None:
        """Refuse configurations TransformerLens' bridge of this family computes differently (ValueError)."""

    # ----- shape -----
    @property
    def n_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def n_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    @property
    def hidden(self) -> int:
        return int(self.config.hidden_size)

    @property
    def intermediate(self) -> int:
        return int(self.config.intermediate_size)

    @property
    def heads(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def kv_heads(self) -> int:
        return int(getattr(self.config, "num_key_value_heads", None) or self.heads)

    @property
    def head_dim(self) -> int:
        return int(getattr(self.config, "head_dim", None) or self.hidden // self.heads)

    def block_activations(self) -> tuple[int, int]:
        """Elements per token one block keeps for its backward: (fp32, in the autocast dtype).

        Counted for PyTorch SDPA attention (no T² scores). This base count is a Llama block: each
        RMSNorm keeps its input and normalised value in fp32 (per-head norms: their width); the
        normalised input, RoPE'd Q and K, V, the attention output and o_proj's input, and the gated
        MLP's gate, up, SiLU and product in the autocast dtype (`lnfree.removal.plan` turns them into bytes).
        """
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        widths = {"q_norm": q, "k_norm": kv}
        per_block = [site for site in self.sites() if site.layer == 0]
        fp32 = sum(2 * widths.get(site.stage, d) for site in per_block)
        return fp32, 3 * d + 2 * q + 2 * kv + 4 * self.intermediate

    @property
    def eps(self) -> float:
        return float(getattr(self.config, self.eps_field))

    def set_eps(self, config, value: float) -> None:
        """Write the norms' eps into a config."""
        setattr(config, self.eps_field, value)

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @property
    def bridge_architecture(self) -> str:
        """TransformerLens' adapter key for this model."""
        return self.bridge.architecture

    def sites(self) -> list[NormSite]:
        """Every norm of the model in block order, the final norm last."""
        raise NotImplementedError

    def block(self, layer: int, name: str) -> str:
        """The module path of `name` inside block `layer`."""
        return f"{self.layers}.{layer}.{name}"

    def neurons(self, layer: int) -> tuple[tuple[str, ...], str]:
        """The module paths of block `layer`'s MLP: (input projections, output projection)."""
        return tuple(self.block(layer, p) for p in self.mlp_in), self.block(layer, self.mlp_out)

    def output_modules(self) -> list[str]:
        """Per block, the attention and MLP modules whose outputs are added to the residual stream."""
        return [self.block(i, m) for i in range(self.n_layers) for m in (self.attention, self.mlp)]


class UnsupportedModel(LnfreeError, ValueError):
    """A model whose architecture lnfree does not support."""


def norm_eps(module: nn.Module) -> float:
    """The eps a LayerNorm / RMSNorm module uses."""
    for name in ("eps", "variance_epsilon"):
        if hasattr(module, name):
            return float(getattr(module, name))
    raise TypeError(f"{type(module).__name__} is not a LayerNorm or RMSNorm")


def set_norm_eps(module: nn.Module, value: float) -> None:
    """Set the eps of a LayerNorm / RMSNorm module."""
    for name in ("eps", "variance_epsilon"):
        if hasattr(module, name):
            setattr(module, name, value)
            return
    raise TypeError(f"{type(module).__name__} is not a LayerNorm or RMSNorm")


def in_out(weight: torch.Tensor, conv1d: bool) -> torch.Tensor:
    """A projection's weight as an (in, out) view: GPT-2's Conv1D stores it so, `nn.Linear` as (out, in)."""
    return weight if conv1d else weight.t()


def column_selector(v_columns: Any) -> Any:
    """A `Consumer.v_columns` as what `NormalisedProjection` takes (tuples become index tensors)."""
    if isinstance(v_columns, tuple):
        return torch.tensor(v_columns, dtype=torch.long)
    return v_columns


def v_mask(v_columns: Any, width: int) -> torch.Tensor:
    """Boolean mask over `width` output features: True on the V path."""
    mask = torch.zeros(width, dtype=torch.bool)
    if v_columns == "all":
        mask[:] = True
    elif isinstance(v_columns, slice):
        mask[v_columns] = True
    elif isinstance(v_columns, tuple):
        mask[list(v_columns)] = True
    return mask
