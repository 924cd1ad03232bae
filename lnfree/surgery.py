"""Install fixed-scale norms into a transformers GPT-2 by module swaps, and drive their state.

After `install`, every LayerNorm of a `GPT2LMHeadModel` has a named scale state ("slot"):
`blocks.{i}.ln_2`, `blocks.{i}.ln_1qk`, `blocks.{i}.ln_1v` and `ln_f`. No forward method is
replaced: `ln_2`/`ln_f` become `FakeLayerNorm`s, `ln_1` becomes an identity and `attn.c_attn`
a `NormalisedQKV` that applies ln_1 per path. Attention masks, the KV cache, `generate()` and
gradient checkpointing work as in the original model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from transformers import GPT2LMHeadModel

from lnfree.fakeln import FakeLayerNorm, NormalisedQKV, ScaleState, TokenContext
from lnfree.schedule import Event

SPECIALS = {"pos0_special": "pos0", "eot_special": "eot"}


def is_installed(model: nn.Module) -> bool:
    """True if `model` already carries lnfree's fixed-scale norms."""
    return isinstance(model.transformer.ln_f, FakeLayerNorm)


def install(
    model: GPT2LMHeadModel,
    *,
    special_pos0: bool = False,
    special_eot: bool = False,
    eot_token_id: int | None = None,
) -> GPT2LMHeadModel:
    """Swap every LayerNorm of `model` for a fixed-scale norm that starts out real (in place).

    `special_pos0` gives every norm a separate σ for sequence position 0; `special_eot` gives
    the ln_1 V paths a separate σ for EOT tokens. Both are applied per token, and both need the
    model to be called with `input_ids`.
    """
    if not isinstance(model, GPT2LMHeadModel):
        raise TypeError(f"lnfree removes LayerNorm from GPT2LMHeadModel, got {type(model).__name__}")
    if is_installed(model):
        raise ValueError("this model already has lnfree's fixed-scale norms installed")
    device = model.transformer.ln_f.weight.device
    pos0 = {"special_pos0": special_pos0}
    for block in model.transformer.h:
        block.attn.c_attn = NormalisedQKV(block.attn.c_attn, block.ln_1, **pos0, special_eot=special_eot)
        block.ln_1 = nn.Identity()
        block.ln_2 = FakeLayerNorm.from_layernorm(block.ln_2, **pos0)
    model.transformer.ln_f = FakeLayerNorm.from_layernorm(model.transformer.ln_f, **pos0)
    for state in scale_states(model).values():
        state.to(device)
    if special_pos0 or special_eot:
        if eot_token_id is None:
            eot_token_id = model.config.eos_token_id
        context = TokenContext(eot_token_id)
        model.register_forward_pre_hook(context, with_kwargs=True)
        for state in scale_states(model).values():
            state.context = context
    return model


def scale_states(model: nn.Module) -> dict[str, ScaleState]:
    """All scale states of an installed model, by slot name, in block order."""
    if not is_installed(model):
        raise ValueError("no lnfree norms in this model; call lnfree.surgery.install first")
    states: dict[str, ScaleState] = {}
    for i, block in enumerate(model.transformer.h):
        states[f"blocks.{i}.ln_1qk"] = block.attn.c_attn.qk
        states[f"blocks.{i}.ln_1v"] = block.attn.c_attn.v
        states[f"blocks.{i}.ln_2"] = block.ln_2.state
    states["ln_f"] = model.transformer.ln_f.state
    return states


def _summed_stats(states: Iterable[ScaleState]) -> torch.Tensor:
    """Every state's accumulator stacked, summed over ranks when running distributed."""
    stats = torch.stack([state.stats for state in states])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return stats


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
        state.collecting = True
    try:
        for input_ids in batches:
            model(input_ids=input_ids)
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


def apply_event(model: nn.Module, event: Event) -> list[str]:
    """Carry out one schedule event; returns the slots it changed."""
    states = scale_states(model)
    if event.kind in SPECIALS:
        for state in states.values():
            state.disable_special(SPECIALS[event.kind])
        return [event.kind]
    states[event.slot].switch_to_fake()
    return [event.slot]


def removal_state(model: nn.Module) -> dict[str, dict]:
    """A JSON-ready description of every slot: real or fake, and its σ (reads device values)."""
    out = {}
    for name, state in scale_states(model).items():
        entry = {"fake": state.is_fake, "sigma": float(state.sigma)}
        if state.has_pos0:
            entry.update(sigma_pos0=float(state.sigma_pos0), pos0_active=state.pos0_on)
        if state.has_eot:
            entry.update(sigma_eot=float(state.sigma_eot), eot_active=state.eot_on)
        out[name] = entry
    return out


def is_fully_removed(model: nn.Module) -> bool:
    """True once every norm is fake and no special σ is still in use."""
    return all(s.is_fake and not s.wants_context for s in scale_states(model).values())
