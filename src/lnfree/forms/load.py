"""`lnfree.load`: any supported checkpoint → a model that knows which norms are real and which fixed.

Sources: an lnfree run folder or training checkpoint (any stage of the schedule), an lnfree
export, a checkpoint in the published eps-trick format (local or Hub; including GPT-2 ones whose
config still says eps 1e-5 while the norms carry the 10⁶-scaled weights), and an ordinary model of
any family `lnfree.arch` supports.

Every source is brought to one exact form, the installed model of `lnfree.fixedscale.surgery` (every norm a
scale state, real or fixed-scale), loaded in fp32 and only then cast. An eps-trick norm becomes a
fixed-scale norm with weight w·√E/σ·σ/√E: the √E factor is removed before any cast, so bf16 and
fp16 never see it. From there: `folded()` gives the weights with 1/σ, centring and the affine part
folded into the surrounding layers (in memory only), and `bridge()` a TransformerLens bridge.
"""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from lnfree.errors import LnfreeError
from lnfree.forms import bridge

from lnfree.fixedscale import surgery
from lnfree.arch import Architecture, architecture
from lnfree.arch.base import norm_eps, set_norm_eps, v_mask
from lnfree.fixedscale.norms import FixedScaleNorm
from lnfree.fixedscale.state import ScaleState
from lnfree.forms.export import EPS_TRICK_EPS, RECORD, ExportError, load_checkpoint, scale_v_columns, to_eps_trick
from lnfree.forms.fold import FoldError, fold
from lnfree.removal.layout import RUN_CONFIG, TRAINER_STATE, latest_checkpoint
from lnfree.models.base import EPS_TRICK_THRESHOLD, EPS_TRICK_WEIGHT, load_config, resolve_model_source


class LoadError(LnfreeError, ValueError):
    """A source that cannot be loaded as asked."""


class LoadedModel:
    """A model with each norm known as real or fixed-scale (σ), and its exact representations."""

    def __init__(self, model: nn.Module, tokenizer, source: str, stored_as: str, sigma_known: bool):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.source = source
        #: How the model was stored: "lnfree checkpoint", "lnfree export", "eps-trick checkpoint" or "plain model".
        self.stored_as = stored_as
        self.sigma_known = sigma_known

    @property
    def arch(self) -> Architecture:
        """The model's architecture adapter."""
        return architecture(self.model)

    @property
    def norms(self) -> dict[str, dict]:
        """Per norm slot: {'fixed': bool, 'sigma': float | None} (σ None when folded into the weight)."""
        out = {}
        for name, state in surgery.scale_states(self.model).items():
            sigma = float(state.sigma) if state.is_fixed and self.sigma_known else None
            out[name] = {"fixed": state.is_fixed, "sigma": sigma}
        return out

    @property
    def fully_ln_free(self) -> bool:
        return surgery.is_fully_removed(self.model)

    def __repr__(self) -> str:
        norms = self.norms
        fixed = sum(n["fixed"] for n in norms.values())
        state = "LN-free" if fixed == len(norms) else ("original norms" if fixed == 0 else "partially LN-free")
        return (f"LoadedModel({self.source!r}, {self.arch.family} {self.stored_as}, {state}: {fixed}/{len(norms)} norms "
                f"fixed-scale, {len(norms) - fixed} real, dtype={next(self.model.parameters()).dtype})")

    def hf(self) -> nn.Module:
        """(a) The transformers model with fixed-scale norms (this object's own model)."""
        return self.model

    def folded(self) -> nn.Module:
        """(b) Fixed-scale norms folded into the surrounding layers, norms replaced by identities."""
        try:
            return fold(self.model)
        except FoldError as err:
            raise LoadError(str(err)) from None

    def bridge(self):
        """(c) A TransformerLens 4 `TransformerBridge`: exact for LN-free and partially removed models."""
        # folded() and with_norm_modules() build new models: the bridge takes them over (no second copy)
        if self.fully_ln_free:
            return bridge.bridge_from_folded(_sharing_embedding(self.folded(), self.model), self.tokenizer,
                                             private=True)
        network = _sharing_embedding(with_norm_modules(self.model), self.model)
        if any(n["fixed"] for n in self.norms.values()):
            return bridge.bridge_with_own_norms(network, self.tokenizer, private=True)
        return bridge.bridge_from_layernorm(network, self.tokenizer, private=True)


@torch.no_grad()
def _sharing_embedding(network: nn.Module, model: nn.Module) -> nn.Module:
    """``network`` (a new model made from ``model``) with its token embedding sharing ``model``'s memory
    when the two hold the same values: nothing writes a bridge's weights in place (TransformerLens's
    weight processing copies before it changes any), and a large vocabulary's embedding is the
    largest weight (Gemma 3 270M: 0.67 GB of 1.07 GB) of the copy a bridge is built from."""
    mine, theirs = network.get_input_embeddings().weight, model.get_input_embeddings().weight
    if mine.shape != theirs.shape or mine.dtype != theirs.dtype or not torch.equal(mine, theirs):
        return network
    head = network.get_output_embeddings()
    shared = nn.Parameter(theirs.detach(), requires_grad=mine.requires_grad)
    network.get_input_embeddings().weight = shared
    if head is not None and head.weight is mine:  # tied: stays tied
        head.weight = shared
    return network


@torch.no_grad()
def with_norm_modules(model: nn.Module) -> nn.Module:
    """The installed model in its family's own layout: every norm back in its place.

    Real norms become the family's norm modules, fixed-scale ones `FixedScaleNorm`s. A block whose
    attention-input Q/K path is fixed while its V path is real has no such layout and is refused.
    """
    try:
        plain = to_eps_trick(model, allow_partial=True)
    except ExportError as err:
        raise LoadError(f"this model has no plain layout: {err}") from err
    arch = architecture(model)
    for site in arch.sites():
        norm = plain.get_submodule(site.module)
        eps = norm_eps(norm)
        if eps >= EPS_TRICK_THRESHOLD:
            state = ScaleState(arch.eps, arch.norm_kind).to(norm.weight.device)
            state.switch_to_fixed()
            plain.set_submodule(site.module, FixedScaleNorm((norm.weight + arch.norm_weight_offset) / math.sqrt(eps),
                                                          getattr(norm, "bias", None), state))
    return plain.to(next(model.parameters()).dtype)


def _is_lnfree_checkpoint(path: Path) -> Path | None:
    if (path / RUN_CONFIG).is_file():
        return latest_checkpoint(path)
    if (path / TRAINER_STATE).is_file() and (path / "model.safetensors").is_file():
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


def _fixed_scale_modules(plain: nn.Module, arch: Architecture) -> set[str]:
    """Norms stored in the eps-trick format: by config eps, the partial-export list, or weight size.

    Detection by weight size (published checkpoints whose config still has the small eps) must
    agree for every norm: a mixed checkpoint is refused rather than guessed.
    """
    sites = [site.module for site in arch.sites()]
    if arch.eps >= EPS_TRICK_THRESHOLD:
        return set(sites)
    listed = getattr(plain.config, "lnfree_fixed_scale_norms", None)
    if listed is not None:
        return set(listed)
    large = {name for name in sites if plain.get_submodule(name).weight.abs().mean() > EPS_TRICK_WEIGHT}
    if large and len(large) != len(sites):
        raise LoadError(
            f"{len(large)} of {len(sites)} norms carry eps-trick weights (e.g. {sorted(large)[0]}) and the others do not, "
            "and the config does not say which are fixed-scale; refusing to guess"
        )
    return large


@torch.no_grad()
def _from_plain(plain: nn.Module, record: dict | None) -> tuple[nn.Module, bool]:
    """Install fixed-scale norms into an ordinary or eps-trick model (fp32, exact)."""
    arch = architecture(plain)
    fixed = _fixed_scale_modules(plain, arch)
    config = plain.config
    if arch.eps >= EPS_TRICK_THRESHOLD:
        trick_eps, original = arch.eps, getattr(config, "lnfree_original_eps", arch.default_eps)
    else:
        trick_eps, original = getattr(config, "lnfree_fixed_scale_eps", EPS_TRICK_EPS), arch.eps
    arch.set_eps(config, original)
    for site in arch.sites():
        set_norm_eps(plain.get_submodule(site.module), original)
    sigmas = {name: entry["sigma"] for name, entry in (record or {}).get("norms", {}).items()}
    model = surgery.install(plain)
    scale = math.sqrt(trick_eps)
    for site in arch.sites():
        if site.module not in fixed:
            continue
        norm = model.get_submodule(site.module)
        first = norm.qk if site.split else norm.state
        sigma = sigmas.get(site.slots[0], 1.0)
        norm.weight.mul_(sigma / scale)
        first.sigma.fill_(sigma)
        first.switch_to_fixed()
        if site.split:
            sigma_v = sigmas.get(site.slots[1], sigma)
            if sigma != sigma_v:  # the export folded σ_qk/σ_v into the V columns: undo it
                for consumer in site.consumers:
                    proj = model.get_submodule(consumer.path)
                    scale_v_columns(proj, proj.matrix(), consumer.v_columns, sigma_v / sigma, norm.bias)
            norm.v.sigma.fill_(sigma_v)
            norm.v.switch_to_fixed()
    return model, bool(sigmas) and bool(fixed)


def _installed_state(location: Path) -> bool:
    """True if a folder holds the state dict of a model with lnfree norms (its σ buffers)."""
    for file in location.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            if any(key.endswith((".sigma", "norm_weight")) for key in f.keys()):
                return True
    return False


def load(source: str | Path, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load any supported checkpoint (see the module docstring) as a `LoadedModel`.

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
        stored_as, sigma_known = "lnfree checkpoint", True
    else:
        load_config(source)  # one clear error for unsupported sources
        location = str(path) if local else source
        if local and _installed_state(path):
            raise LoadError(
                f"{source} holds a model with lnfree's norms saved by save_pretrained: plain transformers would "
                "reload it with real norms. Load the run folder or checkpoint it came from with lnfree.load, "
                "and export it with `lnfree export`"
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=local)
            plain = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, local_files_only=local)
        except OSError as err:
            raise LoadError(f"could not load {source!r}: {err}") from err
        record = _record(location, local)
        model, sigma_known = _from_plain(plain, record)
        fixed = sum(s.is_fixed for s in surgery.scale_states(model).values())
        stored_as = "lnfree export" if record else ("eps-trick checkpoint" if fixed else "plain model")
    return LoadedModel(model.to(dtype), tokenizer, source, stored_as, sigma_known)


class _CallableModule(types.ModuleType):
    """Lets `lnfree.load(source)` be called directly while `lnfree.load` stays importable as a module."""

    def __call__(self, source: str | Path, **kwargs) -> LoadedModel:
        return load(source, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
