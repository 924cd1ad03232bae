"""`lnfree.load`: any GPT-2 checkpoint → a model that knows which norms are real and which fixed.

Sources: an lnfree run folder or training checkpoint (any stage of the schedule), an lnfree
export, a checkpoint in the published eps-trick format (local or Hub; including ones whose config
still says eps 1e-5 while the norms carry the 10⁶-scaled weights), and an ordinary GPT-2.

Every source is brought to one exact form, the installed model of `lnfree.surgery` (every norm a
scale state, real or fixed-scale), loaded in fp32 and only then cast. An eps-trick norm becomes a
fixed-scale norm with weight w·10⁶/σ·σ/10⁶: the 10⁶ factor is removed before any cast, so bf16 and
fp16 never see it. From there: `folded()` gives the weights with 1/σ, centring and the affine part
folded into the following layers (in memory only), and `bridge()` a TransformerLens bridge.
"""

from __future__ import annotations

import copy
import json
import sys
import types
from pathlib import Path

import torch
from torch import nn
from transformers import AutoTokenizer, GPT2LMHeadModel

from lnfree import surgery
from lnfree.export import EPS_TRICK_SCALE, RECORD, load_checkpoint
from lnfree.fakeln import ScaleState
from lnfree.models import EPS_TRICK_THRESHOLD, load_config, resolve_model_source

# A LayerNorm weight this large only occurs in the eps-trick format (weights are w·10⁶/σ).
EPS_TRICK_WEIGHT = 1e3


class LoadError(ValueError):
    """A source that cannot be loaded as asked."""


class FoldedGPT2LMHeadModel(GPT2LMHeadModel):
    """An exactly LN-free GPT-2 with identity norms and an unembedding bias (in memory only).

    Saving it as a GPT2LMHeadModel would reload with default LayerNorms and without the head
    bias, silently wrong; `save_pretrained` therefore refuses. Save the eps-trick export instead.
    """

    def save_pretrained(self, *args, **kwargs):
        raise TypeError(
            "a folded LN-free model cannot be saved as a GPT2LMHeadModel (it would reload with LayerNorms "
            "and without its unembedding bias); save the eps-trick export (lnfree.export.write_export) instead"
        )


class LoadedModel:
    """A GPT-2 with each norm known as real or fixed-scale (σ), and its exact representations."""

    def __init__(self, model: GPT2LMHeadModel, tokenizer, source: str, kind: str, sigma_known: bool):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.source = source
        self.kind = kind
        self.sigma_known = sigma_known

    @property
    def norms(self) -> dict[str, dict]:
        """Per norm slot: {'fixed': bool, 'sigma': float | None} (σ None when folded into the weight)."""
        out = {}
        for name, state in surgery.scale_states(self.model).items():
            sigma = float(state.sigma) if state.is_fake and self.sigma_known else None
            out[name] = {"fixed": state.is_fake, "sigma": sigma}
        return out

    @property
    def fully_ln_free(self) -> bool:
        return surgery.is_fully_removed(self.model)

    def __repr__(self) -> str:
        norms = self.norms
        fixed = sum(n["fixed"] for n in norms.values())
        state = "LN-free" if fixed == len(norms) else ("original LayerNorm" if fixed == 0 else "partially LN-free")
        return (f"LoadedModel({self.source!r}, {self.kind}, {state}: {fixed}/{len(norms)} norms fixed-scale, "
                f"{len(norms) - fixed} real, dtype={next(self.model.parameters()).dtype})")

    def hf(self) -> GPT2LMHeadModel:
        """(a) The transformers model with fixed-scale norms (this object's own model)."""
        return self.model

    def folded(self) -> FoldedGPT2LMHeadModel:
        """(b) Fixed-scale norms folded into the following layers, norms replaced by identities."""
        return fold(self.model)

    def bridge(self):
        """(c) A TransformerLens 4 `TransformerBridge`: exact for LN-free and partially removed models."""
        from lnfree import bridge

        if self.fully_ln_free:
            return bridge.bridge_from_folded(self.folded(), self.tokenizer)
        if any(n["fixed"] for n in self.norms.values()):
            return bridge.bridge_with_own_norms(with_norm_modules(self.model), self.tokenizer)
        return bridge.bridge_from_layernorm(with_norm_modules(self.model), self.tokenizer)


@torch.no_grad()
def with_norm_modules(model: GPT2LMHeadModel) -> GPT2LMHeadModel:
    """The installed model in GPT-2's own layout: ln_1 back in its slot and `c_attn` a Conv1D.

    Real norms become `nn.LayerNorm`s, fixed-scale ones `FakeLayerNorm`s. A block whose ln_1
    Q/K path is fixed while its V path is real has no such layout and is refused.
    """
    from lnfree.export import EPS_TRICK_EPS, ExportError, to_eps_trick
    from lnfree.fakeln import FakeLayerNorm

    try:
        plain = to_eps_trick(model, allow_partial=True)
    except ExportError as err:
        raise LoadError(f"this model has no GPT-2 layout: {err}") from err
    eps = model.config.layer_norm_epsilon

    def convert(ln: nn.LayerNorm) -> nn.Module:
        if ln.eps < EPS_TRICK_EPS:
            return ln
        fixed = FakeLayerNorm(ln.weight / EPS_TRICK_SCALE, ln.bias, ScaleState(eps).to(ln.weight.device))
        fixed.state.switch_to_fake()
        return fixed

    for block in plain.transformer.h:
        block.ln_1, block.ln_2 = convert(block.ln_1), convert(block.ln_2)
    plain.transformer.ln_f = convert(plain.transformer.ln_f)
    plain.config.layer_norm_epsilon = eps
    return plain.to(next(model.parameters()).dtype)


def _centred(weight_in_out: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """C·diag(scale)·W for a (d_in, d_out) weight: centring and the norm's scale folded in."""
    scaled = weight_in_out * scale[:, None]
    return scaled - scaled.mean(dim=0, keepdim=True)


@torch.no_grad()
def fold(model: GPT2LMHeadModel) -> FoldedGPT2LMHeadModel:
    """Fold every fixed-scale norm of an installed model into the next layer (exact, fp64 maths).

    Refuses models with real norms: a real LayerNorm's per-token division cannot be folded.
    """
    states = surgery.scale_states(model)
    real = [name for name, s in states.items() if not s.is_fake]
    if real:
        raise LoadError(f"only fixed-scale norms can be folded; {len(real)} are real (e.g. {real[0]})")
    if any(s.wants_context for s in states.values()):
        raise LoadError("a special σ (position 0 / EOT) is active; it cannot be folded into weights")
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    dtype = next(model.parameters()).dtype
    folded = FoldedGPT2LMHeadModel(config).to(dtype).eval()
    wanted = folded.state_dict()
    folded.load_state_dict({k: v for k, v in model.state_dict().items() if k in wanted}, strict=False)
    for block, target in zip(model.transformer.h, folded.transformer.h):
        qkv = block.attn.c_attn
        split = 2 * qkv.nx
        w = qkv.weight.double()
        scale_qk = qkv.norm_weight.double() / qkv.qk.sigma.double()
        scale_v = qkv.norm_weight.double() / qkv.v.sigma.double()
        weight = torch.cat([_centred(w[:, :split], scale_qk), _centred(w[:, split:], scale_v)], dim=1)
        target.attn.c_attn.weight.copy_(weight)
        target.attn.c_attn.bias.copy_(qkv.norm_bias.double() @ w + qkv.bias.double())
        ln_2, c_fc = block.ln_2, block.mlp.c_fc
        w = c_fc.weight.double()
        target.mlp.c_fc.weight.copy_(_centred(w, ln_2.weight.double() / ln_2.state.sigma.double()))
        target.mlp.c_fc.bias.copy_(ln_2.bias.double() @ w + c_fc.bias.double())
        target.ln_1, target.ln_2 = nn.Identity(), nn.Identity()
    ln_f = model.transformer.ln_f
    unembed = model.lm_head.weight.double().T  # (d_model, vocab)
    head = nn.Linear(config.n_embd, config.vocab_size, bias=True, dtype=dtype)
    head.weight.copy_(_centred(unembed, ln_f.weight.double() / ln_f.state.sigma.double()).T)
    head.bias.copy_(ln_f.bias.double() @ unembed)
    folded.lm_head = head
    folded.transformer.ln_f = nn.Identity()
    return folded


def _is_lnfree_checkpoint(path: Path) -> Path | None:
    from lnfree.train import RUN_CONFIG, latest_checkpoint

    if (path / RUN_CONFIG).is_file():
        return latest_checkpoint(path)
    if (path / "trainer_state.json").is_file() and (path / "model.safetensors").is_file():
        return path
    return None


def _record(source: str, local: bool) -> dict | None:
    if local:
        path = Path(source) / RECORD
        return json.loads(path.read_text()) if path.is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(source, RECORD)).read_text())
    except Exception:  # the record is optional: published checkpoints have none
        return None


def _fixed_scale_names(model: GPT2LMHeadModel) -> set[str]:
    """LayerNorms stored in the eps-trick format, by config eps, the partial-export list or weight size."""
    listed = set(getattr(model.config, "lnfree_fixed_scale_norms", None) or [])
    everything = model.config.layer_norm_epsilon >= EPS_TRICK_THRESHOLD
    return {
        name for name, m in model.named_modules()
        if isinstance(m, nn.LayerNorm)
        and (everything or name in listed or m.weight.abs().mean() > EPS_TRICK_WEIGHT)
    }


@torch.no_grad()
def _from_plain(plain: GPT2LMHeadModel, record: dict | None) -> tuple[GPT2LMHeadModel, bool]:
    """Install fixed-scale norms into an ordinary or eps-trick GPT2LMHeadModel (fp32, exact)."""
    fixed = _fixed_scale_names(plain)
    sigmas = {name: entry["sigma"] for name, entry in (record or {}).get("norms", {}).items()}
    eps = plain.config.layer_norm_epsilon if plain.config.layer_norm_epsilon < EPS_TRICK_THRESHOLD else 1e-5
    for module in plain.modules():
        if isinstance(module, nn.LayerNorm):
            module.eps = eps
    if plain.config.layer_norm_epsilon >= EPS_TRICK_THRESHOLD:
        plain.config.layer_norm_epsilon = eps
    model = surgery.install(plain)
    states = surgery.scale_states(model)
    sigma_known = bool(sigmas) and bool(fixed)

    def make_fixed(state: ScaleState, weight: nn.Parameter, slot: str) -> None:
        sigma = sigmas.get(slot, 1.0)
        weight.mul_(sigma / EPS_TRICK_SCALE)
        state.sigma.fill_(sigma)
        state.switch_to_fake()

    for i, block in enumerate(model.transformer.h):
        qkv = block.attn.c_attn
        if f"transformer.h.{i}.ln_1" in fixed:
            make_fixed(qkv.qk, qkv.norm_weight, f"blocks.{i}.ln_1qk")
            states[f"blocks.{i}.ln_1v"].switch_to_fake()
            sigma_v = sigmas.get(f"blocks.{i}.ln_1v", float(qkv.qk.sigma))
            ratio = float(qkv.qk.sigma) / sigma_v  # the export folded σ_qk/σ_v into the V columns: undo it
            split = 2 * qkv.nx
            w_v = qkv.weight[:, split:].double() / ratio
            qkv.bias[split:] = (qkv.bias[split:].double() - (1 - ratio) * (qkv.norm_bias.double() @ w_v)).float()
            qkv.weight[:, split:] = w_v.float()
            qkv.v.sigma.fill_(sigma_v)
        if f"transformer.h.{i}.ln_2" in fixed:
            make_fixed(block.ln_2.state, block.ln_2.weight, f"blocks.{i}.ln_2")
    if "transformer.ln_f" in fixed:
        make_fixed(model.transformer.ln_f.state, model.transformer.ln_f.weight, "ln_f")
    return model, sigma_known


def load(source: str | Path, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load any GPT-2 checkpoint (see the module docstring) as a `LoadedModel`.

    Local sources never contact the Hub (the tokenizer included). Everything is loaded in fp32
    and converted to the fixed-scale form before the cast to `dtype`.
    """
    source = str(source)
    path = Path(resolve_model_source(source))
    local = path.exists()
    checkpoint = _is_lnfree_checkpoint(path) if local else None
    if checkpoint is not None:
        model, tokenizer, _ = load_checkpoint(checkpoint)
        if not surgery.is_installed(model):  # a vanilla-control run: every norm real
            surgery.install(model)
        kind, sigma_known = "lnfree checkpoint", True
    else:
        load_config(source)  # one clear error for non-GPT-2 sources
        location = str(path) if local else source
        try:
            tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=local)
            plain = GPT2LMHeadModel.from_pretrained(location, dtype=torch.float32, local_files_only=local)
        except OSError as err:
            raise LoadError(f"could not load {source!r}: {err}") from err
        record = _record(location, local)
        model, sigma_known = _from_plain(plain, record)
        fixed = sum(s.is_fake for s in surgery.scale_states(model).values())
        kind = "lnfree export" if record else ("eps-trick checkpoint" if fixed else "GPT-2")
    return LoadedModel(model.to(dtype), tokenizer, source, kind, sigma_known)


class _CallableModule(types.ModuleType):
    """Lets `lnfree.load(source)` be called directly while `lnfree.load` stays importable as a module."""

    def __call__(self, source: str | Path, **kwargs) -> LoadedModel:
        return load(source, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
