"""Fixed-scale LayerNorm: the modules that replace GPT-2's LayerNorms during removal.

A LayerNorm computes (x - mean(x)) / std(x) * w + b per token. Everything but the division by
the per-token std is linear. A `ScaleState` decides what that division uses: the real per-token
std (while the norm is "real") or a frozen scalar σ (once it is "fake"). σ is an exponential
moving average of the batch-mean per-token std, fed by training-mode forward passes while the
norm is real and frozen when it is switched.

Flags and σ live in buffers, so they travel with the state dict. Each flag also has a Python
mirror so the forward pass can branch without reading a device tensor (no host sync).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows of ScaleState.stats: which tokens a statistic is collected over.
GENERAL, POS0, EOT = 0, 1, 2


class TokenContext:
    """Publishes the current forward's token ids and positions to the norm modules.

    Registered as a forward pre-hook on the top-level model; only needed when a special σ
    (position 0 or EOT) is configured, because norm modules never see token ids or positions.
    """

    def __init__(self, eot_token_id: int):
        self.eot_token_id = eot_token_id
        self.input_ids: torch.Tensor | None = None
        self.position_ids: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        self.input_ids = input_ids
        position_ids = kwargs.get("position_ids")
        if position_ids is None and input_ids is not None:
            cache = kwargs.get("past_key_values")
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device) + past
        self.position_ids = position_ids

    def masks(self, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """Boolean (batch, seq) masks of position-0 tokens and EOT tokens."""
        if self.input_ids is None:
            raise RuntimeError(
                "A special σ (position 0 / EOT) needs input_ids; call the model with input_ids "
                "rather than inputs_embeds while special σ are active."
            )
        pos0 = (self.position_ids == 0).expand(shape)
        eot = (self.input_ids == self.eot_token_id).expand(shape)
        return pos0, eot


class ScaleState(nn.Module):
    """The per-token scale of one normalisation: the real std, or a frozen σ.

    Buffers: `sigma` (EMA, frozen when fake), `fake`, optional `sigma_pos0`/`pos0_active` and
    `sigma_eot`/`eot_active`, and a non-persistent `stats` accumulator (row 0 sums, row 1
    counts; columns general / position 0 / EOT) that `commit_ema` folds into σ.
    """

    def __init__(self, eps: float, special_pos0: bool = False, special_eot: bool = False):
        super().__init__()
        self.eps = eps
        self.has_pos0 = special_pos0
        self.has_eot = special_eot
        self.register_buffer("sigma", torch.ones(()))
        self.register_buffer("fake", torch.zeros((), dtype=torch.bool))
        if special_pos0:
            self.register_buffer("sigma_pos0", torch.ones(()))
            self.register_buffer("pos0_active", torch.ones((), dtype=torch.bool))
        if special_eot:
            self.register_buffer("sigma_eot", torch.ones(()))
            self.register_buffer("eot_active", torch.ones((), dtype=torch.bool))
        self.register_buffer("stats", torch.zeros(2, 3), persistent=False)
        self.context: TokenContext | None = None
        self.collecting = False  # set by `measuring` to gather statistics in eval mode
        self._refresh_mirrors()

    # ----- Python mirrors of the flag buffers (read without a device sync) -----
    def _refresh_mirrors(self) -> None:
        self.is_fake = bool(self.fake)
        self.pos0_on = self.has_pos0 and bool(self.pos0_active)
        self.eot_on = self.has_eot and bool(self.eot_active)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._refresh_mirrors()

    def extra_repr(self) -> str:
        specials = [n for n, on in (("pos0", self.pos0_on), ("eot", self.eot_on)) if on]
        state = "fake" if self.is_fake else "real"
        return f"{state}, eps={self.eps}" + (f", special σ: {'+'.join(specials)}" if specials else "")

    # ----- switches -----
    def switch_to_fake(self) -> None:
        """Freeze σ at its current value and divide by it from now on."""
        self.fake.fill_(True)
        self.is_fake = True

    def disable_special(self, kind: str) -> None:
        """Stop using the special σ `kind` ('pos0' or 'eot'); those tokens use σ from now on."""
        if kind == "pos0" and self.has_pos0:
            self.pos0_active.fill_(False)
        elif kind == "eot" and self.has_eot:
            self.eot_active.fill_(False)
        self._refresh_mirrors()

    @property
    def wants_context(self) -> bool:
        return self.pos0_on or self.eot_on

    # ----- statistics -----
    def token_std(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token std of `x` as LayerNorm computes it, detached, shape (batch, seq)."""
        with torch.no_grad():
            std = torch.sqrt(x.detach().float().var(dim=-1, unbiased=False) + self.eps)
        return std.reshape(-1, std.shape[-1]) if std.dim() > 1 else std[None]

    def observe(self, flat: torch.Tensor) -> None:
        """Accumulate per-token stds `flat` (batch, seq) into the statistics (no host sync)."""
        with torch.no_grad():
            if not self.wants_context:
                self.stats[0, GENERAL] += flat.sum()
                self.stats[1, GENERAL] += flat.numel()
                return
            pos0, eot = self.context.masks(flat.shape)
            pos0 = pos0 & self.pos0_on
            eot = eot & self.eot_on & ~pos0
            general = ~(pos0 | eot)
            for column, mask in ((GENERAL, general), (POS0, pos0), (EOT, eot)):
                self.stats[0, column] += (flat * mask).sum()
                self.stats[1, column] += mask.sum()

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

        `stats` is this module's accumulator, possibly summed over ranks. A fake norm's σ is frozen.
        """
        if not self.is_fake:
            old = self.sigmas()
            mean = stats[0] / stats[1].clamp_min(1)
            new = momentum * old + (1 - momentum) * mean
            self._write_sigmas(torch.where(stats[1] > 0, new, old))
        self.stats.zero_()

    @torch.no_grad()
    def set_from_stats(self, stats: torch.Tensor) -> None:
        """σ ← mean of the accumulated statistics (the initial measurement); clear the accumulator."""
        mean = stats[0] / stats[1].clamp_min(1)
        # A group never observed (e.g. no EOT in the data) falls back to the general σ.
        self._write_sigmas(torch.where(stats[1] > 0, mean, mean[GENERAL]))
        self.stats.zero_()

    # ----- the normalisation -----
    def token_sigma(self, shape: torch.Size) -> torch.Tensor:
        """σ per token, shape (..., 1), honouring active special σ."""
        if not self.wants_context:
            return self.sigma
        pos0, eot = self.context.masks(shape)
        sigma = self.sigma.expand(shape)
        if self.eot_on:
            sigma = torch.where(eot, self.sigma_eot, sigma)
        if self.pos0_on:
            sigma = torch.where(pos0, self.sigma_pos0, sigma)
        return sigma.unsqueeze(-1)

    def normalise(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """LayerNorm of `x` with this state's scale."""
        if not self.is_fake:
            if self.training or self.collecting:
                self.observe(self.token_std(x))
            return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)
        centred = x - x.mean(dim=-1, keepdim=True)
        sigma = self.token_sigma(x.shape[:-1])
        if sigma.dim() == 0:  # one σ for every token: fold it into the weight vector
            return torch.addcmul(bias, centred, weight / sigma)
        return torch.addcmul(bias, centred / sigma.to(x.dtype), weight)


class FakeLayerNorm(nn.Module):
    """Drop-in replacement for `nn.LayerNorm` whose division can be frozen to a fixed σ.

    Keeps the parameter names `weight` and `bias`, so state-dict keys of the replaced module
    are unchanged. Identical to the real LayerNorm until `state.switch_to_fake()`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, state: ScaleState):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone())
        self.state = state

    @classmethod
    def from_layernorm(cls, ln: nn.LayerNorm, **special) -> FakeLayerNorm:
        return cls(ln.weight, ln.bias, ScaleState(ln.eps, **special))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.state.normalise(x, self.weight, self.bias)


class NormalisedQKV(nn.Module):
    """ln_1 followed by GPT-2's `c_attn`, with separate scale states for the Q/K and V paths.

    Replaces `attn.c_attn` (while `ln_1` becomes an identity), so the attention module's own
    forward is untouched: it still splits this module's output into Q, K and V. The weight and
    bias keep `c_attn`'s names; ln_1's affine parameters become `norm_weight`/`norm_bias`.
    """

    def __init__(self, c_attn: nn.Module, ln_1: nn.LayerNorm, **special):
        super().__init__()
        self.nf, self.nx = c_attn.nf, c_attn.nx
        self.weight = nn.Parameter(c_attn.weight.detach().clone())
        self.bias = nn.Parameter(c_attn.bias.detach().clone())
        self.norm_weight = nn.Parameter(ln_1.weight.detach().clone())
        self.norm_bias = nn.Parameter(ln_1.bias.detach().clone())
        self.qk = ScaleState(ln_1.eps, special_pos0=special.get("special_pos0", False))
        self.v = ScaleState(ln_1.eps, **special)

    def _paths_share_norm(self) -> bool:
        # Both real: the per-token std is the same for both paths, so normalise once.
        return not (self.qk.is_fake or self.v.is_fake)

    def _paths_fixed_scalar(self) -> bool:
        # Both fixed, one σ per path for every token: the scales fold into the weight columns.
        return self.qk.is_fake and self.v.is_fake and not (self.qk.wants_context or self.v.wants_context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1] + (self.nf,)
        flat = x.reshape(-1, self.nx)
        split = 2 * self.nx
        if self._paths_share_norm():
            if self.training or self.qk.collecting:
                std = self.qk.token_std(x)
                self.qk.observe(std)
                self.v.observe(std)
            h = F.layer_norm(flat, (self.nx,), self.norm_weight, self.norm_bias, self.qk.eps)
            return torch.addmm(self.bias, h, self.weight).view(shape)
        if self._paths_fixed_scalar():
            # ((x − μ)/σ_path · w + b) @ W + c = (((x − μ)·w) @ W) / σ_path + (b @ W + c): one matmul,
            # the per-path scales applied to its output columns.
            column_scale = torch.cat([self.qk.sigma.expand(split), self.v.sigma.expand(self.nf - split)]).reciprocal()
            centred = flat - flat.mean(dim=-1, keepdim=True)
            bias = torch.addmv(self.bias, self.weight.t(), self.norm_bias)
            projected = torch.mm(centred * self.norm_weight, self.weight)
            return torch.addcmul(bias, projected, column_scale.to(projected.dtype)).view(shape)
        h_qk = self.qk.normalise(x, self.norm_weight, self.norm_bias).reshape(-1, self.nx)
        h_v = self.v.normalise(x, self.norm_weight, self.norm_bias).reshape(-1, self.nx)
        qk = torch.addmm(self.bias[:split], h_qk, self.weight[:, :split])
        v = torch.addmm(self.bias[split:], h_v, self.weight[:, split:])
        return torch.cat([qk, v], dim=-1).view(shape)
