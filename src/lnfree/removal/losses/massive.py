"""Massive-activation neurons: find the MLP neurons that write a model's massive activations, and
damp them out before the norms are fixed.

Modern LLMs put a *massive activation* (Sun et al. 2024, arXiv 2402.17762) on the first token:
SmolLM2-135M's residual stream at position 0 is ~1,000 RMS against 6–30 elsewhere. A real norm
divides it away; a fixed σ cannot, and the token explodes through the gated MLPs
(`experiments/results/smollm2-135m/`). The activation is written by very few MLP neurons that fire
almost only there (SmolLM2: two neurons of block 11 at ~3,000 and ~1,000 at position 0, below 1 on
99 % of the other tokens) and partly erased by a few later ones (SmolLM2: one of block 28).

`find_massive_neurons` picks the neurons whose mean |activation| at position 0 is at least `ratio`×
their 99th percentile over the other positions (the largest over the measured batches) and whose output there is at least `min_output`× the
median norm of their MLP's output elsewhere. `Damping` then scales those neurons' output columns
geometrically from 1 to `floor` over `steps` training steps and finally zeroes the neuron (its input
rows and bias too: a zero neuron has a zero gradient, so the optimiser cannot grow it back), while
every norm is still real and fine-tuning lets the model find another way to make its attention sink.
The result is a plain model with a few dead neurons; nothing else changes, so exports stay plain.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from lnfree.arch import architecture
from lnfree.arch.base import in_out
from lnfree.fixedscale.functional import second_moment
from lnfree.fixedscale.norms import SplitNorm
from lnfree.errors import UsageError
from lnfree.removal.losses.sharded import gathered

#: The run-folder file that records the neurons a run damps (read back on resume).
NEURONS_FILE = "massive_neurons.json"


class MassiveNeurons(BaseModel):
    """Find the neurons that write massive activations and damp them out (`removal.massive_neurons`)."""

    model_config = ConfigDict(extra="forbid")
    ratio: float = Field(20.0, gt=1, description="a neuron qualifies when its mean |activation| at position 0 is at "
                         "least this many times its 99th percentile at the other positions")
    min_output: float = Field(10.0, ge=0, description="... and its output at position 0 is at least this many times "
                              "the median norm of its MLP's output at the other positions")
    start: int = Field(0, ge=0, description="first damping step")
    steps: int = Field(100, ge=1, description="damping length: output scaled geometrically from 1 to `floor`, then zero")
    floor: float = Field(1e-4, gt=0, lt=1, description="the last scale before the neurons are zeroed")
    neurons: list[tuple[int, int]] | None = Field(
        None, description="damp exactly these (block, neuron) instead of the ones found (e.g. writers of massive "
        "activations on ordinary tokens, which the position-0 criterion does not see); `ratio` and `min_output` unused")


@dataclass(frozen=True)
class Neuron:
    """One massive-activation neuron and what singled it out (measured on the original model)."""

    layer: int
    index: int
    position0: float  # mean |activation| at position 0
    elsewhere: float  # 99th percentile of |activation| at the other positions
    output_ratio: float  # its output norm at position 0 over the median MLP output norm elsewhere


@torch.no_grad()
def find_massive_neurons(model: nn.Module, batches, ratio: float = 20.0, min_output: float = 10.0,
                         listed: list[tuple[int, int]] | None = None) -> list[Neuron]:
    """The MLP neurons of `model` that write massive activations at position 0, measured on `batches` of ids
    (`listed`: these (block, neuron) instead, with the same measurements).

    Per neuron: the mean |activation| at position 0, and the largest over batches of the 99th
    percentile at the other positions (statistics per batch: memory does not grow with the batches).
    """
    arch = architecture(model)
    for layer, index in listed or []:
        out = model.get_submodule(arch.neurons(layer)[1]) if 0 <= layer < arch.n_layers else None
        if out is None or not 0 <= index < _neuron_weights(out, arch.conv1d, output=True).shape[1]:
            raise UsageError(f"removal.massive_neurons.neurons: the model has no neuron {index} in block {layer} "
                             f"({arch.n_layers} blocks)")
    first: dict[int, torch.Tensor] = {}
    elsewhere: dict[int, torch.Tensor] = {}
    outputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(arch.n_layers)}

    def keep(layer):
        def hook(module, args, output):
            a = args[0].detach().float().abs()
            rest = a[:, 1:].flatten(0, 1)
            q99 = rest.kthvalue(max(1, math.ceil(0.99 * rest.shape[0])), dim=0).values
            first[layer] = first.get(layer, 0) + a[:, 0].sum(0)
            elsewhere[layer] = torch.maximum(elsewhere.get(layer, q99), q99)
            outputs[layer].append(output.detach().float()[:, 1:].norm(dim=-1).flatten())
        return hook

    hooks = [model.get_submodule(arch.neurons(i)[1]).register_forward_hook(keep(i)) for i in range(arch.n_layers)]
    was_training = model.training
    model.eval()
    sequences = 0
    try:
        for input_ids in batches:
            model(input_ids=input_ids, use_cache=False)
            sequences += input_ids.shape[0]
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    found = []
    for layer in range(arch.n_layers):
        mean_first = first[layer] / sequences
        typical = torch.cat(outputs[layer]).median().clamp_min(1e-12)
        weight = _neuron_weights(model.get_submodule(arch.neurons(layer)[1]), arch.conv1d, output=True)
        out_ratio = mean_first * weight.detach().float().norm(dim=0) / typical
        chosen = (mean_first >= ratio * elsewhere[layer].clamp_min(1e-12)) & (out_ratio >= min_output)
        if listed is not None:
            chosen = torch.zeros_like(chosen)
            chosen[[j for i, j in listed if i == layer]] = True
        for j in chosen.nonzero().flatten().tolist():
            found.append(Neuron(layer, j, float(mean_first[j]), float(elsewhere[layer][j]), float(out_ratio[j])))
    return found


def _neuron_weights(module: nn.Module, conv1d: bool, output: bool) -> torch.Tensor:
    """A projection's weight laid out with one column per neuron: (features, neurons).

    An output projection reads the neurons (Linear: weight (out, in)); an input projection writes
    them (Linear: weight (neurons, in), transposed here). GPT-2's Conv1D stores (in, out).
    """
    w = in_out(module.weight, conv1d)  # (in, out)
    return w.t() if output else w


@torch.no_grad()
def scale_neurons(model: nn.Module, neurons: list[Neuron], factor: float) -> None:
    """Multiply the output columns of `neurons` by `factor`; at 0, zero their input rows and biases too."""
    arch = architecture(model)
    for n in neurons:
        inputs, output = arch.neurons(n.layer)
        _neuron_weights(model.get_submodule(output), arch.conv1d, output=True)[:, n.index] *= factor
        if factor == 0:
            for path in inputs:
                proj = model.get_submodule(path)
                _neuron_weights(proj, arch.conv1d, output=False)[:, n.index] = 0
                if getattr(proj, "bias", None) is not None:
                    proj.bias[n.index] = 0


class Damping:
    """The neurons' output scale per step: 1 before `start`, floor^(k/steps) at the k-th damping step
    (k = 1 … steps − 1), then 0. `apply(model, step)` moves the weights from the previous step's scale
    to this step's, so a run resumed from any checkpoint (whose weights carry the scale) continues
    exactly."""

    def __init__(self, config: MassiveNeurons, neurons: list[Neuron]):
        self.config = config
        self.neurons = neurons

    def factor(self, step: int) -> float:
        """The neurons' output scale during `step`."""
        k = step - self.config.start + 1
        if k <= 0:
            return 1.0
        return 0.0 if k >= self.config.steps else self.config.floor ** (k / self.config.steps)

    def apply(self, model: nn.Module, step: int) -> float | None:
        """Before the forward passes of `step`: rescale the neurons; returns the new scale if it changed.

        Once zeroed, the neurons are zeroed again at every call: Adam's momentum from the steps
        before would otherwise move them off zero, and a neuron off zero has gradients again.
        """
        now, before = self.factor(step), self.factor(step - 1)
        if not self.neurons or (now == before and now != 0):
            return None
        scale_neurons(model, self.neurons, 0.0 if now == 0 else now / before)
        return now if now != before else None

    def save(self, folder: Path) -> None:
        """Record the neurons in `folder` (the run folder)."""
        (Path(folder) / NEURONS_FILE).write_text(json.dumps([asdict(n) for n in self.neurons], indent=1) + "\n")

    @classmethod
    def load(cls, config: MassiveNeurons, folder: Path) -> Damping:
        """The damping of a run whose neurons were recorded in `folder`."""
        path = Path(folder) / NEURONS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the run's massive neurons cannot be resumed")
        return cls(config, [Neuron(**entry) for entry in json.loads(path.read_text())])


@torch.no_grad()
def massive_scales(model: nn.Module, input_ids: torch.Tensor, forward: nn.Module | None = None) -> dict[str, float]:
    """How massive position 0 and the most extreme other token are at the norm inputs, on `input_ids`.

    `forward` is what to call when `model` is wrapped (DDP / FSDP): the hooks sit on `model`'s modules.

    Per norm, the per-token RMS over the median token's (position 0: the median over sequences;
    outlier: the largest at any other position); the largest over all norms of each. A fixed σ
    hands such a token that many times its real scale.
    """
    arch = architecture(model)
    rms: list[torch.Tensor] = []
    hooks = [model.get_submodule(site.module).register_forward_pre_hook(
        lambda module, args: rms.append(args[0].detach().float().pow(2).mean(-1).sqrt())) for site in arch.sites()
        if not site.per_head]
    was_training = model.training
    model.eval()
    try:
        (forward or model)(input_ids=input_ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    pos0 = max(float(r[:, 0].median() / r[:, 1:].median()) for r in rms)
    outlier = max(float(r[:, 1:].max() / r[:, 1:].median()) for r in rms)
    return {"position0_scale": pos0, "outlier_scale": outlier}


@torch.no_grad()
def plant_massive_neuron(model: nn.Module, input_ids: torch.Tensor, *, layer: int = 1, neuron: int = 0,
                         channel: int = 0, scale: float = 100.0, marker: float = 3.0, seed: int = 0) -> Neuron:
    """Give `model` a massive activation at position 0, written the way real LLMs write theirs: one MLP
    neuron of block `layer` fires only there and adds `scale`× the median residual norm to residual
    channel `channel`. A test bed for `find_massive_neurons` and `Damping` on tiny models.

    Position 0 gets a random marker direction: in its position embedding (GPT-2; `marker`× the median
    embedding norm), or else in the embedding of the token every sequence of `input_ids` starts with (a
    BOS token; `marker`× the larger of that and the median residual norm entering block `layer`, since
    Gemma's normalised sublayer outputs dwarf its embeddings). The neuron's input weights read that
    marker from the MLP input, with a bias (or, in a gated MLP, the product of two such reads) that
    keeps it off at the other positions.
    """
    arch = architecture(model)
    first = input_ids[:, 0]
    row_scale = 1.0
    if arch.position_embedding is not None:
        row = model.get_submodule(arch.position_embedding).weight[0]
    elif bool((first == first[0]).all()):
        embedding = model.get_submodule(arch.token_embedding)
        row = embedding.weight[int(first[0])]
        row_scale = embedding(first[:1]).norm() / row.norm()  # Gemma scales its embeddings by √hidden
    else:
        raise UsageError(f"{arch.family} has no position embeddings: every sequence must start with the same token")
    generator = torch.Generator().manual_seed(seed)
    direction = torch.randn(row.shape[0], generator=generator)
    inputs, output = arch.neurons(layer)
    states = model(input_ids=input_ids, output_hidden_states=True).hidden_states
    embedded, typical = (states[i].norm(dim=-1).median() for i in (0, layer))
    reference = embedded if arch.position_embedding is not None else max(embedded, typical)
    row += marker * reference * direction / direction.norm() / row_scale
    x = captured_input(model, inputs[0], input_ids)
    rest = x[:, 1:].flatten(0, 1)
    gap = x[:, 0].mean(0) - rest.mean(0)
    read = gap
    if arch.position_embedding is None:  # a BOS token's marker, which attention copies into the others:
        # Fisher's direction (the gap whitened by how the other positions vary) stays quiet on them.
        spread = torch.cov(rest.T) + 1e-3 * rest.var(0).mean() * torch.eye(len(gap))
        read = torch.linalg.solve(spread, gap)
    read = read / (read @ gap)  # reads 1 at position 0's mean, 0 at the others' mean
    others = (x @ read)[:, 1:].max()
    threshold = others + 0.25 * (1 - others)  # a quarter of the way from the others to position 0
    for path in inputs:  # a gated MLP's gate and up read the same: their product is ~0 unless both fire
        proj = model.get_submodule(path)
        _neuron_weights(proj, arch.conv1d, output=False)[:, neuron] = 40 * read
        if getattr(proj, "bias", None) is not None:
            proj.bias[neuron] = -40 * float(threshold)
    out = _neuron_weights(model.get_submodule(output), arch.conv1d, output=True)
    out[:, neuron] = 0
    act = captured_input(model, output, input_ids)[..., neuron]
    out[channel, neuron] = scale * typical / act[:, 0].mean()
    return Neuron(layer, neuron, float(act[:, 0].abs().mean()), float(act[:, 1:].abs().max()), float("nan"))


def captured_input(model: nn.Module, path: str, input_ids: torch.Tensor) -> torch.Tensor:
    """What the submodule at `path` receives (its first input, fp32) in `model`'s forward of `input_ids`."""
    seen = []
    hook = model.get_submodule(path).register_forward_pre_hook(lambda module, args: seen.append(args[0].float()))
    try:
        model(input_ids=input_ids)
    finally:
        hook.remove()
    return seen[0]


_CAPTURES = itertools.count()  # numbers each `Captured` its own attribute: two may hook one module


class Captured:
    """Tensors kept by forward hooks on `modules` (in forward order) during the latest forward pass:
    `clear()` before a forward, `take()` after it, `remove()` takes the hooks off. Hooks keep tensors
    while `active`; a user that owns only some forwards (a training loss, not the evaluations between
    steps) turns it off and wraps its own forwards in `capturing()`.

    Each hook leaves its tensor on its own module rather than appending to a shared list: a compiled
    block's graph would otherwise be guarded on the list's length, one graph (and recompile) per block.
    `sources` holds the module of each tensor of the latest `take()`, until the next `clear()`.
    """

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules
        self.attribute = f"_lnfree_kept_{next(_CAPTURES)}"  # where its hooks leave their tensors
        self.sources: list[nn.Module] = []
        self.handles: list = []
        self.active = True

    def clear(self) -> None:
        for module in self.modules:
            module.__dict__.pop(self.attribute, None)
        self.sources = []

    @contextlib.contextmanager
    def capturing(self):
        """Keep what the forwards inside it see, from a clear start (then `take()`), and nothing after."""
        self.clear()
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def take(self) -> list[torch.Tensor]:
        """The tensors seen since `clear()`, in forward order."""
        self.sources = [module for module in self.modules if self.attribute in module.__dict__]
        return [module.__dict__.pop(self.attribute) for module in self.sources]

    def held(self) -> int:
        """How many tensors the hooks keep now (taken by the next `take()`)."""
        return sum(self.attribute in module.__dict__ for module in self.modules)

    def keep_input(self, module: nn.Module, args: tuple) -> None:
        """A forward pre-hook: leave the module's input on it while active."""
        if self.active:
            setattr(module, self.attribute, args[0])

    def keep_output(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        """A forward hook: leave the module's output on it while active."""
        if self.active:
            setattr(module, self.attribute, out)

    def remove(self) -> None:
        """Take the hooks off (what they kept stays until `take()` or `clear()`)."""
        for handle in self.handles:
            handle.remove()


class NormInputs(Captured):
    """Keeps every norm's input of the latest forward pass (forward pre-hooks on the norm modules)."""

    def __init__(self, model: nn.Module):
        arch = architecture(model)
        super().__init__([model.get_submodule(site.module) for site in arch.sites() if not site.per_head])
        self.model = model
        self.handles = [module.register_forward_pre_hook(self.keep_input) for module in self.modules]


def scale_loss(inputs: list[torch.Tensor], input_ids: torch.Tensor, eot_token_id: int, kind: str,
               form: str = "relative", position0: bool = False) -> torch.Tensor:
    """Mean over norm inputs of the mean over tokens of (per-token scale / typical scale − 1)²
    (`form` "relative"), or of log(per-token scale / typical scale)² ("log", typical = the geometric mean).

    The scale is the norm's own (std for LayerNorm, RMS for RMSNorm); typical = its detached mean
    over the tokens neither at position 0 nor EOT (and over every head, for a per-head norm's input given as
    (batch, positions, heads, head dim): one σ per norm). Relative, so every norm counts alike whatever its
    scale: it pulls outlier tokens (and position 0) towards the typical scale at every norm input,
    where the published auxiliary loss acts at the final norm only. The log form grows only with the
    log of a runaway token's scale, so one such token cannot swamp a clipped gradient. `position0`: the log form
    of position 0 alone, per row (and head): what one σ per norm would leave it off by once the norm is fixed.
    """
    total = torch.zeros((), device=input_ids.device)
    for x in inputs:
        scale = _scale_with_grad(x, kind)
        if form == "log" or position0:  # against the geometric mean: one runaway token barely moves it
            log_scale = scale.log()
            excess = log_scale - typical_scale(log_scale, input_ids, eot_token_id)
            total = total + ((excess[:, 0] if position0 else excess) ** 2).mean()
        else:
            total = total + ((scale / typical_scale(scale, input_ids, eot_token_id) - 1) ** 2).mean()
    return total / max(1, len(inputs))


def position0_log_gain(module: nn.Module) -> torch.Tensor:
    """log(σ / position 0's divisor) at an installed norm module (a device scalar, no host sync): how much
    larger position 0 leaves the norm than a token of the same input scale dividing by σ. Nonzero only
    while the norm is fixed and position 0 divides by its own (possibly fading) frozen σ; a split
    attention norm gives the larger of its two paths."""
    states = (module.qk, module.v) if isinstance(module, SplitNorm) else (module.state,)
    gains = [s.position0_log_gain() for s in states if s.is_fixed and s.pos0_on and not s.pos0_real_on]
    return torch.stack(gains).max() if gains else torch.zeros((), device=states[0].sigma.device)


class ScaleTail(BaseModel):
    """A hinge on the tail of every norm input's per-token scale (`train.scale_tail`): from step `start`
    on, each token (position 0 aside) above `ratio`× its norm input's typical scale is pulled back.

    Once a norm is fixed, a token whose input scale is r× the typical one leaves it r× too large, and
    fixed blocks above amplify it (Gemma 3 270M: rare tokens through its fixed MLP-output norms,
    experiments/results/gemma3-270m/). The mean-over-tokens scale loss (`scale_loss_weight`) barely
    sees one such token among thousands; this loss sees nothing else.
    """

    model_config = ConfigDict(extra="forbid")
    ratio: float = Field(3.0, gt=1, description="tokens above this many times the typical scale are pulled back")
    weight: float = Field(1.0, ge=0, description="its weight in the loss")
    start: int = Field(0, ge=0, description="the first step it is on")
    measure: Literal["input", "output"] = Field(
        "input", description="the scale of each norm's input, or of its input times the norm's weight (centred for "
        "LayerNorm): what a fixed norm leaves its readers with, larger than the input's scale says where a token "
        "lies along the norm's large-weight channels (`weighted_inputs`)"
    )


def weighted_inputs(inputs: list[torch.Tensor], sources: list[nn.Module], kind: str) -> list[torch.Tensor]:
    """Each norm input times its norm's weight (centred first for LayerNorm): a fixed norm's output times
    its σ, so that its RMS over tokens compares what the norm leaves its readers with (the weight read after the
    forward: `gathered` where FSDP has sharded it again)."""
    weighted = []
    for x, module in zip(inputs, sources, strict=True):
        x, weight = x.float(), gathered(module.weight)
        if kind == "layer":
            x = x - x.mean(-1, keepdim=True)
        weighted.append(x * weight.float())
    return weighted


def pieces(tail) -> list:
    """A step-dependent loss's settings as a list: none, one, or the list it already is."""
    return [] if tail is None else tail if isinstance(tail, list) else [tail]


def tail_at(tail, step: int):
    """The piece of a step-dependent loss (`train.scale_tail`, `train.position0_tail`,
    `train.position0_mlp`: one setting, or a list of them by `start`) that is on at `step`: the
    latest-started one, or None while none is (or its weight is 0)."""
    on = [p for p in pieces(tail) if p.start <= step]
    latest = max(on, key=lambda p: p.start, default=None)
    return latest if latest is not None and latest.weight > 0 else None


def check_pieces(tail, name: str):
    """Validate a list of a step-dependent loss's settings: not empty, each with its own start."""
    if isinstance(tail, list):
        starts = [p.start for p in tail]
        if not starts or len(set(starts)) != len(starts):
            raise ValueError(f"train.{name}: a list of settings needs at least one, each with its own start, got "
                             f"starts {starts}")
    return tail


class Position0Tail(ScaleTail):
    """The hinge on position 0 alone (`train.position0_tail`): on its input scale at each norm, or on
    what it leaves the norm with (`measure = "output"`: its scale over its own divisor, against the
    typical token's over σ). Measured at the output, the hinge is idle while position 0 leaves its norms
    no larger than `ratio`× a typical token (as its own σ, measured on it, makes it do), and pulls its
    input in exactly as far as a fade of that σ (`pos0_special`) shrinks its divisor."""

    measure: Literal["input", "output"] = Field("input", description="hinge position 0's scale at the norm "
                                                "inputs, or what it leaves the norms with")


def scale_tail_loss(inputs: list[torch.Tensor], input_ids: torch.Tensor, eot_token_id: int, kind: str,
                    ratio: float, position0: bool = False, gains: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Sum over norm inputs and tokens (position 0 aside) of max(0, log(scale / typical) − log `ratio`)²,
    per sequence; typical = the geometric mean over the tokens neither at position 0 nor EOT.
    `position0`: the same hinge on position 0 alone (`train.position0_tail`), its log scale raised at
    each input by `gains` if given (`position0_log_gain`: what it leaves the norm with).

    A sum, not a mean: a single token above the threshold at a few norm inputs weighs as much as the
    cross-entropy of a whole sequence; tokens below the threshold add nothing."""
    total = torch.zeros((), device=input_ids.device)
    for i, x in enumerate(inputs):
        log_scale = _scale_with_grad(x, kind).log()
        excess = log_scale - typical_scale(log_scale, input_ids, eot_token_id) - math.log(ratio)
        if position0:
            excess = excess[:, :1] + (gains[i] if gains is not None else 0)
        total = total + (excess if position0 else excess[:, 1:]).clamp_min(0).pow(2).sum()
    return total / input_ids.shape[0]


def _scale_with_grad(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Each token's scale as its norm computes it, in fp32, with its gradient (the losses' input;
    `lnfree.fixedscale.functional.token_scale` is the detached one)."""
    return torch.sqrt(second_moment(x.float(), kind) + 1e-12)


def typical_scale(scale: torch.Tensor, input_ids: torch.Tensor, eot_token_id: int) -> torch.Tensor:
    """The detached mean of per-token `scale` (batch, positions, any further axes such as heads) over the
    tokens neither at position 0 nor EOT: the target of the auxiliary losses (as in Baroni et al. 2025,
    arXiv 2507.02559)."""
    typical = input_ids != eot_token_id
    typical[:, 0] = False
    typical = typical.view(*typical.shape, *[1] * (scale.dim() - 2)).expand_as(scale)
    return ((scale * typical).sum() / typical.sum().clamp_min(1)).detach()
