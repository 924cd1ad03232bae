"""Install fixed-scale norms into a transformers model by module swaps, and drive their state.

After `install`, every norm of a supported model (see `lnfree.arch`) has named scale states
("slots"): `blocks.{i}.ln_1qk`, `blocks.{i}.ln_1v`, `blocks.{i}.ln_2`, Qwen3's
`blocks.{i}.q_norm`/`k_norm`, and `ln_f`. No forward method is replaced: norms become
`FixedScaleNorm`s, the attention-input norm a `SplitNorm` (the part of the norm its paths share)
and every projection reading it a `NormalisedProjection` that finishes it per path. Attention masks, the KV cache,
`generate()` and gradient checkpointing work as in the original model. State-dict keys are the
original ones plus the scale-state buffers.
"""

from __future__ import annotations

import contextlib

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from lnfree.arch import architecture
from lnfree.arch.base import column_selector, norm_eps
from lnfree.fixedscale.norms import FixedScaleNorm, NormalisedProjection, SplitNorm
from lnfree.fixedscale.state import ScaleState, TokenContext
from lnfree.errors import UsageError

class Event(Protocol):
    """What `apply_event` reads of a schedule event (`lnfree.removal.schedule.Event`)."""

    @property
    def kind(self) -> str: ...

    @property
    def slot(self) -> str: ...


SPECIALS = {"pos0_special": "pos0", "eot_special": "eot"}
SAVE_REFUSAL = (
    "a model with lnfree's fixed-scale norms cannot be saved with save_pretrained: transformers would reload it "
    "with real norms and without its σ. Save the LN-free export instead: "
    "lnfree.forms.export.write_export(model, tokenizer, folder) (or `lnfree export RUN`), or keep training "
    "checkpoints with `lnfree remove`."
)


class InstalledModel:
    """Mixin of every model with lnfree norms installed: refuses `save_pretrained` (see SAVE_REFUSAL)."""

    def save_pretrained(self, *args, **kwargs):
        raise TypeError(SAVE_REFUSAL)


_INSTALLED_CLASSES: dict[type, type] = {}


def installed_class(cls: type) -> type:
    """The subclass of a transformers model class used once lnfree norms are installed."""
    if cls not in _INSTALLED_CLASSES:
        name = f"LnfreeInstalled{cls.__name__}"
        sub = type(name, (InstalledModel, cls), {"__module__": __name__})
        globals()[name] = sub  # importable by name, so the model still pickles
        _INSTALLED_CLASSES[cls] = sub
    return _INSTALLED_CLASSES[cls]


def original_class(model: nn.Module) -> type:
    """The transformers class a (possibly installed) model was built from."""
    cls = type(model)
    return cls.__mro__[2] if issubclass(cls, InstalledModel) else cls


def is_installed(model: nn.Module) -> bool:
    """True if `model` already carries lnfree's fixed-scale norms."""
    return any(isinstance(m, (FixedScaleNorm, SplitNorm)) for m in model.modules())


def install(
    model: nn.Module,
    *,
    special_pos0: bool = False,
    per_head_pos0: bool = False,
    pos0_span: int = 1,
    special_eot: bool = False,
    eot_token_id: int | None = None,
) -> nn.Module:
    """Swap every norm of `model` for a fixed-scale norm that starts out real (in place).

    `special_pos0` gives every residual-stream norm a separate σ for sequence position 0 (for the first
    `pos0_span` positions), and with `per_head_pos0` the per-head q/k norms too (Gemma 3, Qwen3);
    `special_eot` gives the ln_1 V paths a separate σ for EOT tokens. Both are applied per token, and both
    need the model to be called with `input_ids`.
    """
    arch = architecture(model)
    if is_installed(model):
        raise UsageError("this model already has lnfree's fixed-scale norms installed")
    for site in arch.sites():
        norm = model.get_submodule(site.module)
        eps = norm_eps(norm)
        weight, bias = norm.weight.detach() + arch.norm_weight_offset, getattr(norm, "bias", None)
        device = weight.device
        pos0 = special_pos0 and (per_head_pos0 or not site.per_head)
        if site.split:
            states = (ScaleState(eps, arch.norm_kind, special_pos0=pos0),
                      ScaleState(eps, arch.norm_kind, special_pos0=pos0, special_eot=special_eot))
            split = SplitNorm(weight, bias, *(s.to(device) for s in states))
            model.set_submodule(site.module, split)
            for consumer in site.consumers:
                proj = model.get_submodule(consumer.path)
                selector = column_selector(consumer.v_columns)
                model.set_submodule(consumer.path, NormalisedProjection(proj, split, selector, arch.conv1d).to(device))
        else:
            state = ScaleState(eps, arch.norm_kind, special_pos0=pos0, heads_axis=site.heads_axis).to(device)
            model.set_submodule(site.module, FixedScaleNorm(weight, bias, state))
    states = _find_states(model)
    if special_pos0 or special_eot:
        if eot_token_id is None:
            eot_token_id = model.config.eos_token_id
        context = TokenContext(eot_token_id, pos0_span)
        model.register_forward_pre_hook(context, with_kwargs=True)
        for state in states.values():
            state.context = context
    model.__class__ = installed_class(type(model))
    model._lnfree_states = states  # found once: the training loop reads them every step
    return model


def scale_states(model: nn.Module) -> dict[str, ScaleState]:
    """All scale states of an installed model, by slot name, in block order."""
    if not is_installed(model):
        raise UsageError("no lnfree norms in this model; call lnfree.fixedscale.surgery.install first")
    states = getattr(model, "_lnfree_states", None)
    return dict(states) if states is not None else _find_states(model)


def _find_states(model: nn.Module) -> dict[str, ScaleState]:
    states: dict[str, ScaleState] = {}
    for site in architecture(model).sites():
        module = model.get_submodule(site.module)
        found = (module.qk, module.v) if site.split else (module.state,)
        states.update(zip(site.slots, found))
    return states


def norm_input_modules(model: nn.Module) -> list[tuple[tuple[str, ...], nn.Module]]:
    """(slot names, module) of every installed norm module; each one's forward receives the norm's input."""
    return [(site.slots, model.get_submodule(site.module)) for site in architecture(model).sites()]


def _summed_stats(states: Iterable[ScaleState]) -> torch.Tensor:
    """Every state's accumulator stacked, summed over ranks when running distributed."""
    stats = torch.stack([state.stats for state in states])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return stats


@contextlib.contextmanager
def statistics_paused(model: nn.Module):
    """No norm of `model` feeds its σ statistics inside (a training forward on generated rows, not text);
    nothing to pause in a model without lnfree norms (a vanilla control)."""
    states = list(scale_states(model).values()) if is_installed(model) else []
    for state in states:
        state.paused = True
    try:
        yield
    finally:
        for state in states:
            state.paused = False


@torch.no_grad()
def initialise_sigmas(model: nn.Module, batches: Iterable[torch.Tensor]) -> None:
    """Set every σ to the mean per-token std measured over `batches` of input ids.

    Runs in eval mode (no dropout). Under torch.distributed every rank must call this with its
    own batches; the statistics are pooled so every rank ends with the same σ.
    """
    states = list(scale_states(model).values())
    was_training = model.training
    model.eval()
    for state in states:
        state.clear_stats()  # statistics gathered before this call must not leak into σ
        state.collecting = True
    try:
        for input_ids in batches:
            model(input_ids=input_ids, use_cache=False)
    finally:
        for state in states:
            state.collecting = False
        model.train(was_training)
    for state, stats in zip(states, _summed_stats(states)):
        state.set_from_stats(stats)


def update_sigmas(model: nn.Module, momentum: float) -> None:
    """Fold the statistics gathered since the last call into every real norm's σ (EMA).

    Call once per optimiser step, on every rank. Tensor ops only: no host sync.
    """
    states = list(scale_states(model).values())
    for state, stats in zip(states, _summed_stats(states)):
        state.commit_ema(stats, momentum)


def apply_event(model: nn.Module, event: Event, fraction: float = 1.0) -> list[str]:
    """Carry out one schedule event; returns the slots it changed.

    `fraction` < 1 is a step of a gradual removal: the slot divides by a blend of its real
    per-token scale and its (now frozen) σ (`ScaleState.set_fixed_fraction`); for a special-σ
    event, its tokens' σ moves geometrically towards the general σ (`ScaleState.fade_special`).
    `pos0_real` switches position 0 to its real scale at every input-side norm, at once
    (`ScaleState.use_real_pos0`).
    """
    states = scale_states(model)
    if event.kind == "pos0_real":
        for slot in input_side_slots(model):
            states[slot].use_real_pos0()
        return [event.kind]
    if event.kind in SPECIALS:
        for state in states.values():
            state.fade_special(SPECIALS[event.kind], fraction)
        return [event.kind]
    states[event.slot].set_fixed_fraction(fraction)
    return [event.slot]


def input_side_slots(model: nn.Module) -> list[str]:
    """The slots whose norm feeds a sublayer or the unembedding (every one but a sublayer-output norm)."""
    return [slot for site in architecture(model).sites() if not site.on_output for slot in site.slots]


def removal_state(model: nn.Module) -> dict[str, dict]:
    """A JSON-ready description of every slot: real or fixed, and its σ (reads device values)."""
    out = {}
    for name, state in scale_states(model).items():
        entry = {"fixed": state.is_fixed, "sigma": float(state.sigma)}
        if state.is_blending:
            entry["fixed_fraction"] = state.fixed_fraction
        if state.has_pos0:
            entry.update(sigma_pos0=float(state.sigma_pos0), pos0_active=state.pos0_on)
            if state.pos0_real_on:
                entry["pos0_real"] = True
            if state.pos0_on and float(state.pos0_fade) > 0:
                entry["pos0_fade"] = float(state.pos0_fade)
        if state.has_eot:
            entry.update(sigma_eot=float(state.sigma_eot), eot_active=state.eot_on)
            if state.eot_on and float(state.eot_fade) > 0:
                entry["eot_fade"] = float(state.eot_fade)
        out[name] = entry
    return out


def is_fully_removed(model: nn.Module) -> bool:
    """True once every norm is fixed and no special σ is still in use."""
    return all(s.is_fixed and not s.wants_context for s in scale_states(model).values())
