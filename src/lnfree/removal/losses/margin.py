"""A stability margin: scale one token's residual at a block and penalise how much it grows downstream
(`train.stability_margin`).

With its norms fixed, a model no longer divides a large residual back down: a token that reaches a
block r× its usual size leaves the fixed norm r× too large, and a gated MLP answers with up to r²×, so
the blocks above can compound an excess until the token overflows (Gemma 3 270M: '/' after
"LIBRARY_PATH = '/home" entered block 8 at 2.4× the median token and left block 9's MLP input 21×,
experiments/results/gemma3-270m/robust/). The training-time scale ceiling keeps such steps finite and
so hides them from the loss; text that provokes them is rare. This loss provokes them on purpose: in
one extra forward over `rows` of each micro-batch's sequences, the residual entering block k is
multiplied by `factor` at one position p (k and p drawn per micro-step, a pure function of the seed
and step, as the coverage rows), and every token from p on is hinged at every norm that reads the
residual stream (not a sublayer-output norm such as Gemma's post-norms, whose input a gated MLP behind
a fixed norm squares by construction) where its scale exceeds `ratio` × `factor` × its scale in the
unperturbed forward. A model with real norms passes the excess on at most about linearly (each block
adds what a normalised input makes); the hinge trains the fixed stack to stay within that margin. Both
extra forwards leave the norms' σ statistics alone and compute no logits (the head skipped, but under FSDP).

With real norms the margin reads about 0, so it can act on a block only once its norm is fixed, and in
SmolLM2-135M a token runs away the moment one is (ln_2 of block 1 fixed, no training: 87×;
experiments/results/smollm2-135m/). `preview` = n trains for the switches ahead instead: the perturbed
forward is the same rows with the schedule's next n norms fixed at once (`previewed`), each token hinged
where its scale exceeds `ratio` × its scale in the forward as the norms are.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from lnfree.fixedscale.functional import second_moment
from lnfree.fixedscale import surgery

#: Mixes the step into the perturbation's seed (another stream than the coverage rows').
_STREAM = 104729


class StabilityMargin(BaseModel):
    """The perturbation and its hinge (`train.stability_margin`; a list of them by `start`, as `train.scale_tail`)."""

    model_config = ConfigDict(extra="forbid")
    factor: float = Field(4.0, gt=1, description="the perturbed token's residual is multiplied by this at a "
                          "block's input")
    ratio: float = Field(2.0, gt=1, description="tokens whose scale at a later norm input exceeds ratio × factor × "
                         "their unperturbed scale are pulled back")
    rows: int = Field(1, ge=1, description="sequences of each micro-batch perturbed (one position each): the extra "
                      "forward's size")
    weight: float = Field(1.0, ge=0, description="its weight in the loss")
    start: int = Field(0, ge=0, description="the first step it is on")
    max_grad_share: float | None = Field(
        0.25, gt=0, description="cap its gradient at this share of the text's (by norm, per step), as the coverage "
        "rows' (lnfree.removal.losses.coverage.HeldGradients): a provoked runaway's gradient is 10^4-10^6, which gradient "
        "clipping would let dominate the step and train.skip_grad_norm would drop; None: no cap")
    preview: int = Field(0, ge=0, description="0: the perturbation scales one token's residual by `factor`. n > 0: "
                         "it is instead the next n norm switches of the schedule (those blending included) made at "
                         "once, every token from position 1 hinged beyond `ratio` × its scale without them (`factor` "
                         "unused): trains the stack for the switches to come, where the margin alone reads ~0 until "
                         "a norm is fixed")


def margin_site(seed: int, step: int, micro_step: int, rank: int, *, layers: int, context: int) -> tuple[int, int]:
    """(block, position ≥ 1) perturbed at one micro-step: a pure function of its arguments."""
    rng = np.random.default_rng([seed, _STREAM, step, micro_step, rank])
    return int(rng.integers(0, layers)), int(rng.integers(1, context))


@contextlib.contextmanager
def perturbed(block: nn.Module, position: int, factor: float):
    """Within: the residual entering `block` is `factor`× larger at `position` (a forward pre-hook)."""

    def scale(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        mask = torch.ones(hidden.shape[1], 1, device=hidden.device, dtype=hidden.dtype)
        mask[position] = factor
        hidden = hidden * mask
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

    handle = block.register_forward_pre_hook(scale, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def previewed(model: nn.Module, events: list):
    """Within: the norms of `model` that `events` (`lnfree.removal.schedule.Event`) switch divide by their σ
    as fully fixed norms do; their blends are restored on exit (σ itself is frozen while a norm blends or is
    fixed, so nothing else moves)."""
    states = [surgery.scale_states(model)[event.slot] for event in events]
    saved = [(state.mix.clone(), state.fixed.clone(), state.is_fixed, state.is_blending) for state in states]
    for state in states:
        state.set_fixed_fraction(1.0)
    try:
        yield
    finally:
        for state, (mix, fixed, is_fixed, is_blending) in zip(states, saved):
            state.mix.copy_(mix)
            state.fixed.copy_(fixed)
            state.is_fixed, state.is_blending = is_fixed, is_blending


def margin_loss(clean: list[torch.Tensor], perturbed_inputs: list[torch.Tensor], position: int, kind: str,
                factor: float, ratio: float) -> torch.Tensor:
    """Sum over norm inputs and the tokens from `position` on of max(0, log(scale′ / scale) − log(ratio ×
    factor))², per sequence: scale′ in the perturbed forward (with its gradient), scale in the clean one
    (the same rows, detached). Norm inputs upstream of the perturbation add nothing (scale′ = scale)."""
    if len(clean) != len(perturbed_inputs):
        raise RuntimeError(f"{len(perturbed_inputs)} norm inputs in the perturbed forward, {len(clean)} in the "
                           "clean one")
    rows = perturbed_inputs[0].shape[0]
    limit = math.log(ratio * factor)
    total = torch.zeros((), device=perturbed_inputs[0].device)
    for x, x_clean in zip(perturbed_inputs, clean):
        log_scale = 0.5 * (second_moment(x[:, position:].float(), kind) + 1e-12).log()
        log_clean = 0.5 * (second_moment(x_clean[:rows, position:].detach().float(), kind) + 1e-12).log()
        total = total + (log_scale - log_clean - limit).clamp_min(0).pow(2).sum()
    return total / rows
