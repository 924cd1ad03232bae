"""`ScaleState`: the per-token scale of one normalisation, real or a frozen σ, with its statistics,
blending, special σ (position 0, EOT) and their fades; and `TokenContext`, which tells the states
which tokens a forward holds.

Flags and σ live in buffers, so they travel with the state dict. Each flag also has a Python
mirror so the forward pass can branch without reading a device tensor (no host sync).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lnfree.fixedscale.functional import (
    NormKind, centre, centred_times, real_norm, rms_times, scale_from_rstd, second_moment,
    token_scale,
)

# Columns of ScaleState.stats: which tokens a statistic is collected over.
GENERAL, POS0, EOT = 0, 1, 2
#: A real norm's reciprocal scales are reduced this many calls at a time, or as soon as this many
#: are pending, whichever comes first (`ScaleState.gather`).
FOLD_EVERY, FOLD_ELEMENTS = 32, 2**16


class TokenContext:
    """Publishes the current forward's token ids and positions to the norm modules.

    Registered as a forward pre-hook on the top-level model; only needed when a special σ
    (position 0 or EOT) is configured, because norm modules never see token ids or positions.
    """

    def __init__(self, eot_token_id: int, pos0_span: int = 1):
        self.eot_token_id = eot_token_id
        self.pos0_span = pos0_span  # the leading positions that count as position 0
        self.input_ids: torch.Tensor | None = None
        self.position_ids: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        self.input_ids = input_ids
        position_ids = kwargs.get("position_ids")
        mask = kwargs.get("attention_mask")
        if position_ids is None and input_ids is not None and isinstance(mask, torch.Tensor) and mask.dim() == 2:
            # Left padding: the first real token is position 0 (padding before it gets −1), not column 0.
            position_ids = (mask.long().cumsum(-1) - 1)[:, -input_ids.shape[-1]:]
        elif position_ids is None and input_ids is not None:
            cache = kwargs.get("past_key_values")
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device) + past
        self.position_ids = position_ids

    def masks(self, shape: torch.Size, heads_axis: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Boolean masks of position-0 tokens (the first `pos0_span` positions) and EOT tokens, of `shape`:
        (batch, seq), or a per-head norm's token shape with the heads at `heads_axis`."""
        if self.input_ids is None:
            raise RuntimeError(
                "A special σ (position 0 / EOT) needs input_ids; call the model with input_ids "
                "rather than inputs_embeds while special σ are active."
            )
        pos0 = ((self.position_ids >= 0) & (self.position_ids < self.pos0_span)).expand(self.input_ids.shape)
        eot = self.input_ids == self.eot_token_id
        if heads_axis is not None:
            pos0, eot = pos0.unsqueeze(heads_axis), eot.unsqueeze(heads_axis)
        return pos0.expand(shape), eot.expand(shape)



class ScaleState(nn.Module):
    """The per-token scale of one normalisation: the real one, or a frozen σ.

    Buffers: `sigma` (EMA, frozen when fixed), `fixed`, optional `sigma_pos0`/`pos0_active` and
    `sigma_eot`/`eot_active`, and a non-persistent `totals` accumulator (row 0 sums, row 1
    counts; columns general / position 0 / EOT) that `commit_ema` folds into σ. Read it as
    `stats`, which first adds the reciprocal scales still pending (see `gather`).
    """

    def __init__(self, eps: float, kind: NormKind = "layer", special_pos0: bool = False, special_eot: bool = False,
                 heads_axis: int | None = None):
        super().__init__()
        self.eps = eps
        self.kind = kind
        self.heads_axis = heads_axis  # a per-head norm's token shape has its heads there (TokenContext.masks)
        self.has_pos0 = special_pos0
        self.has_eot = special_eot
        self.register_buffer("sigma", torch.ones(()))
        self.register_buffer("fixed", torch.zeros((), dtype=torch.bool))
        # Gradual removal: while 0 < mix < 1 the norm divides by mix·(real scale) + (1 − mix)·σ, σ frozen.
        self.register_buffer("mix", torch.zeros(()))
        # A special σ is turned off at once, or faded: its tokens divide by σ_special^(1 − fade) · σ^fade.
        if special_pos0:
            self.register_buffer("sigma_pos0", torch.ones(()))
            self.register_buffer("pos0_active", torch.ones((), dtype=torch.bool))
            self.register_buffer("pos0_fade", torch.zeros(()))
            # Position 0 divides by its own real per-token scale instead of the frozen σ_pos0
            # (`use_real_pos0`); a fade then goes from that scale to σ.
            self.register_buffer("pos0_real", torch.zeros((), dtype=torch.bool))
        if special_eot:
            self.register_buffer("sigma_eot", torch.ones(()))
            self.register_buffer("eot_active", torch.ones((), dtype=torch.bool))
            self.register_buffer("eot_fade", torch.zeros(()))
        self.register_buffer("totals", torch.zeros(2, 3), persistent=False)
        self._pending: list[torch.Tensor] = []  # reciprocal scales not yet in `totals`
        self._pending_numel = 0
        self.context: TokenContext | None = None
        self.collecting = False  # set by `surgery.initialise_sigmas` to gather statistics in eval mode
        self.paused = False  # set by `surgery.statistics_paused`: a training forward on inputs that are not text
        # A training-time guard (lnfree.fixedscale.ceiling), never saved: a fixed or blending norm divides by at
        # least (real per-token scale) / ceiling, so no token leaves a fixed norm above `ceiling`× σ.
        self.ceiling = math.inf
        self.ceiling_spares_pos0 = False  # position 0 (with its own σ) is never bounded
        self.ceiling_hits: torch.Tensor | None = None  # counted only while `lnfree.fixedscale.ceiling.watching`
        self._refresh_mirrors()

    # ----- Python mirrors of the flag buffers (read without a device sync) -----
    def _refresh_mirrors(self) -> None:
        self.is_fixed = bool(self.fixed)
        self.is_blending = not self.is_fixed and bool(self.mix > 0)
        self.pos0_on = self.has_pos0 and bool(self.pos0_active)
        self.pos0_real_on = self.pos0_on and bool(self.pos0_real)
        self.eot_on = self.has_eot and bool(self.eot_active)

    def _apply(self, fn, recurse=True):
        """Moves follow the model, casts to 16 bits do not: σ, the blend and the statistics stay fp32
        in a model cast to bf16 / fp16 (a bf16 σ is off by up to 0.4 %, and bf16 sums of scales
        stall). Pending scales are summed first, so they move with `totals`."""
        self._fold_pending()

        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            low = out.dtype in (torch.bfloat16, torch.float16)
            return t.to(out.device) if t.dtype == torch.float32 and low else out

        return super()._apply(keep_fp32, recurse)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "fake" in state_dict:  # checkpoints written before the flag was named `fixed`
            state_dict[prefix + "fixed"] = state_dict.pop(prefix + "fake")
        for name in ("mix", "pos0_fade", "eot_fade"):  # checkpoints from before gradual removal
            if hasattr(self, name):
                state_dict.setdefault(prefix + name, torch.zeros(()))
        if self.has_pos0:  # checkpoints from before position 0's real scale
            state_dict.setdefault(prefix + "pos0_real", torch.zeros((), dtype=torch.bool))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._refresh_mirrors()

    def extra_repr(self) -> str:
        specials = [n for n, on in (("pos0 (real)" if self.pos0_real_on else "pos0", self.pos0_on),
                                    ("eot", self.eot_on)) if on]
        state = "fixed" if self.is_fixed else "blending" if self.is_blending else "real"
        return f"{self.kind}, {state}, eps={self.eps}" + (f", special σ: {'+'.join(specials)}" if specials else "")

    # ----- switches -----
    def switch_to_fixed(self) -> None:
        """Freeze σ at its current value and divide by it from now on."""
        self.set_fixed_fraction(1.0)

    def set_fixed_fraction(self, fraction: float) -> None:
        """Gradual removal: divide by (1 − fraction)·(real per-token scale) + fraction·σ.

        Any fraction > 0 freezes σ (its EMA stops); 1 is the fixed-scale norm exactly. The blend
        is a buffer written in place, so changing it costs no host sync and no recompile.
        """
        if not 0 < fraction <= 1:
            raise ValueError(f"fixed fraction must be in (0, 1], got {fraction}")
        done = fraction >= 1
        self.mix.fill_(0.0 if done else 1.0 - fraction)
        self.fixed.fill_(done)
        self.is_fixed, self.is_blending = done, not done

    def switch_to_real(self) -> None:
        """Divide by the real per-token scale again (σ keeps its value; its statistics resume)."""
        self.mix.fill_(0.0)
        self.fixed.fill_(False)
        self.is_fixed = self.is_blending = False

    @property
    def fixed_fraction(self) -> float:
        """What `set_fixed_fraction` last set: 1 fixed, 0 real, between while blending (then a buffer read)."""
        return 1.0 if self.is_fixed else 1.0 - float(self.mix) if self.is_blending else 0.0

    def disable_special(self, kind: str) -> None:
        """Stop using the special σ `kind` ('pos0' or 'eot'); those tokens use σ from now on."""
        self.fade_special(kind, 1.0)

    def fade_special(self, kind: str, fraction: float) -> None:
        """Turn the special σ `kind` ('pos0' or 'eot') off gradually: its tokens divide by
        σ_special^(1 − fraction) · σ^fraction (a geometric blend; 1 turns it off, 0 restores it). A
        buffer written in place: no host sync, no recompile."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"fade fraction must be in [0, 1], got {fraction}")
        if kind == "pos0" and self.has_pos0:
            active, fade = self.pos0_active, self.pos0_fade
        elif kind == "eot" and self.has_eot:
            active, fade = self.eot_active, self.eot_fade
        else:
            return
        done = fraction >= 1
        active.fill_(not done)
        fade.fill_(0.0 if done else fraction)
        self._refresh_mirrors()

    def use_real_pos0(self, on: bool = True) -> None:
        """Position 0 divides by its own real per-token scale (gradient included) instead of the frozen
        σ_pos0, as a real norm would: its output no longer depends on how large its input is, so a loss
        can shrink position 0's scale without changing what it feeds. A later fade goes from that
        scale to σ. No effect without a position-0 σ."""
        if self.has_pos0:
            self.pos0_real.fill_(on)
            self._refresh_mirrors()

    @property
    def wants_context(self) -> bool:
        return self.pos0_on or self.eot_on

    @property
    def guarded(self) -> bool:
        """True when a finite ceiling bounds this fixed (or blending) norm's output per token."""
        return self.ceiling != math.inf and (self.is_fixed or self.is_blending)

    @property
    def gathering(self) -> bool:
        """True when a forward should feed the statistics: a real norm in a grad-enabled training
        pass, or an explicit measurement. A user's no-grad metric in train mode does not move σ."""
        if self.paused or self.is_fixed or self.is_blending:
            return False
        return (self.training and torch.is_grad_enabled()) or self.collecting

    # ----- statistics -----
    @property
    def stats(self) -> torch.Tensor:
        """The accumulator (row 0 sums, row 1 counts; columns general / position 0 / EOT), pending
        reciprocal scales included."""
        self._fold_pending()
        return self.totals

    def clear_stats(self) -> None:
        """Empty the accumulator."""
        self._pending.clear()
        self._pending_numel = 0
        self.totals.zero_()

    def observe(self, x: torch.Tensor) -> None:
        """Accumulate the per-token scales of the norm input `x` (no host sync)."""
        self.accumulate(token_scale(x, self.kind, self.eps))

    def gather(self, rstd: torch.Tensor) -> None:
        """Accumulate the per-token reciprocal scales `rstd` (..., 1) a real norm multiplied by (no host sync).

        Eagerly, each op costs a fixed dispatch time; reducing every call's scales at once (reciprocal,
        sum, two in-place adds) made a LayerNorm's forward and backward at 512 tokens 1.2× slower.
        So the tensors wait in a list (the norm's backward keeps the latest alive anyway) and are
        reduced together every `FOLD_EVERY` calls, or once `FOLD_ELEMENTS` scales wait: one
        concatenation, reciprocal and sum. Under torch.compile, or when token groups need their own
        σ, they are reduced at once.
        """
        if self.wants_context or torch.compiler.is_compiling():
            self.accumulate(scale_from_rstd(rstd))
            return
        self._pending.append(rstd.detach() if rstd.requires_grad else rstd)
        self._pending_numel += rstd.numel()
        if len(self._pending) >= FOLD_EVERY or self._pending_numel >= FOLD_ELEMENTS:
            self._fold_pending()

    def _fold_pending(self) -> None:
        if not self._pending:
            return
        flat = torch.cat([r.reshape(-1) for r in self._pending]).float()  # detached: no graph is recorded
        self.totals[0, GENERAL].add_(flat.reciprocal().sum())
        self.totals[1, GENERAL].add_(flat.numel())
        self._pending.clear()
        self._pending_numel = 0

    def accumulate(self, flat: torch.Tensor) -> None:
        """Add per-token scales `flat` (shape of the tokens) to the accumulator, per token group (no host sync)."""
        with torch.no_grad():
            if not self.wants_context:  # in-place on views: no read-modify-write through indexing
                self.totals[0, GENERAL].add_(flat.sum())
                self.totals[1, GENERAL].add_(flat.numel())
                return
            pos0, eot = self.context.masks(flat.shape, self.heads_axis)
            pos0 = pos0 & self.pos0_on
            eot = eot & self.eot_on & ~pos0
            general = ~(pos0 | eot)
            for column, mask in ((GENERAL, general), (POS0, pos0), (EOT, eot)):
                self.totals[0, column] += (flat * mask).sum()
                self.totals[1, column] += mask.sum()

    def sigmas(self) -> torch.Tensor:
        """σ for the three token groups (general, position 0, EOT) as one tensor."""
        pos0 = self.sigma_pos0 if self.has_pos0 else self.sigma
        eot = self.sigma_eot if self.has_eot else self.sigma
        return torch.stack([self.sigma, pos0, eot])

    def _write_sigmas(self, values: torch.Tensor) -> None:
        self.sigma.copy_(values[GENERAL])
        if self.has_pos0:
            self.sigma_pos0.copy_(values[POS0])
        if self.has_eot:
            self.sigma_eot.copy_(values[EOT])

    @torch.no_grad()
    def commit_ema(self, stats: torch.Tensor, momentum: float) -> None:
        """σ ← m·σ + (1−m)·mean, per token group with observations; then clear the accumulator.

        `stats` is this module's accumulator, possibly summed over ranks. A fixed (or blending)
        norm's σ is frozen.
        """
        if not (self.is_fixed or self.is_blending):
            old = self.sigmas()
            mean = stats[0] / stats[1].clamp_min(1)
            new = momentum * old + (1 - momentum) * mean
            self._write_sigmas(torch.where(stats[1] > 0, new, old))
        self.clear_stats()

    @torch.no_grad()
    def set_from_stats(self, stats: torch.Tensor) -> None:
        """σ ← mean of the accumulated statistics (the initial measurement); clear the accumulator."""
        mean = stats[0] / stats[1].clamp_min(1)
        # A group never observed (e.g. no EOT in the data) falls back to the general σ.
        self._write_sigmas(torch.where(stats[1] > 0, mean, mean[GENERAL]))
        self.clear_stats()

    # ----- the normalisation -----
    def token_sigma(self, x: torch.Tensor) -> torch.Tensor:
        """σ per token of the norm input `x`, shape (..., 1), honouring active special σ (a 0-d σ
        when none is active)."""
        if not self.wants_context:
            return self.sigma
        shape = x.shape[:-1]
        pos0, eot = self.context.masks(shape, self.heads_axis)
        sigma = self.sigma.expand(shape)
        if self.eot_on:
            sigma = torch.where(eot, self._faded(self.sigma_eot, self.eot_fade), sigma)
        if self.pos0_on:
            real = self._real_scale(x).squeeze(-1) if self.pos0_real_on else None
            sigma = torch.where(pos0, self.position0_divisor(real), sigma)
        return sigma.unsqueeze(-1)

    def position0_divisor(self, real_scale: torch.Tensor | None = None) -> torch.Tensor:
        """What position 0 divides by: σ when no position-0 σ is on; else its frozen σ_pos0, or
        `real_scale` (its tokens' own scale, needed under `use_real_pos0`), faded toward σ."""
        if not self.pos0_on:
            return self.sigma
        if not self.pos0_real_on:
            return self._faded(self.sigma_pos0, self.pos0_fade)
        if real_scale is None:
            raise ValueError("position 0 divides by its own scale here (use_real_pos0): pass real_scale")
        return self._faded(real_scale, self.pos0_fade)

    def _real_scale(self, x: torch.Tensor) -> torch.Tensor:
        """Each token's real scale (fp32, gradient included), shape (..., 1)."""
        return torch.sqrt(second_moment(x.float(), self.kind) + self.eps).unsqueeze(-1)

    def _faded(self, special: torch.Tensor, fade: torch.Tensor) -> torch.Tensor:
        return special * (self.sigma / special) ** fade  # exactly `special` at fade 0

    def position0_log_gain(self) -> torch.Tensor:
        """log(σ / position 0's frozen divisor), a device scalar: with the divisor `_faded(σ_pos0, f)`,
        (1 − f)(log σ − log σ_pos0). Meaningful while position 0 divides by its own frozen σ."""
        return (1 - self.pos0_fade) * (self.sigma.log() - self.sigma_pos0.log())

    def normalise(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The norm of `x` with this state's scale (statistics are gathered by the owning module)."""
        if self.is_blending:
            return self._blended(x, weight, bias)
        if not self.is_fixed:
            return real_norm(x, self.kind, weight, bias, self.eps)
        sigma = self.token_sigma(x)
        if self.guarded:
            sigma = self._under_ceiling(x, sigma)
        if self.kind == "rms":
            return rms_times(x, weight, sigma)
        if sigma.dim() == 0:  # one σ for every token: fold it into the weight vector
            return centred_times(x, weight, bias, sigma)
        return torch.addcmul(bias, centre(x, "layer") / sigma.to(x.dtype), weight)


    def _blended(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        h = x.float()
        real = self._real_scale(h)
        scale = self.mix * real + (1 - self.mix) * self.token_sigma(h)
        if self.guarded:
            scale = self._count_hits(scale, self._ceiling_floor(h, real))
        out = (centre(h, self.kind) / scale).to(x.dtype) * weight
        return out if bias is None else out + bias

    def _under_ceiling(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """Per-token divisor max(σ, real scale / ceiling), shape (..., 1): below the ceiling the fixed
        norm exactly; above it, the real norm times the ceiling (gradient included)."""
        return self._count_hits(sigma, self._ceiling_floor(x, self._real_scale(x)))

    def _ceiling_floor(self, x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """The ceiling's least divisor per token, (..., 1): real scale / ceiling, 0 at a spared position 0."""
        floor = real / self.ceiling
        if self.ceiling_spares_pos0 and self.pos0_on:
            floor = floor.masked_fill(self.context.masks(x.shape[:-1], self.heads_axis)[0].unsqueeze(-1), 0.0)
        return floor

    def _count_hits(self, scale: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
        """max(scale, floor), counting the tokens where the floor wins while watched."""
        if self.ceiling_hits is not None:
            self.ceiling_hits += (floor > scale).sum()
        return torch.maximum(scale, floor)
