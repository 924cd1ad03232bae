"""The loss a run trains on, one micro-batch at a time.

    loss = (1 − α)·CE + α·KL(teacher ‖ model) + w_aux·aux + w_scale·scale + w_heads·head_scale + w_key0·key0
           + w_tail(step)·tail + w_pos0(step)·pos0
           + w_mlp0(step)·mlp0 + w_range(step)·range + w_gain(step)·gain + w_growth(step)·growth
           + w_attn(step)·attn
           [+ w_margin(step)·margin, its own forward]

CE is the next-token cross-entropy; KL distils the frozen original (`train.distill_alpha` = α);
aux pulls the per-token scale at the final norm's input towards its typical value (Baroni et al. 2025's auxiliary loss);
scale and tail do the same at every norm input (`lnfree.removal.losses.massive`: the spread of all tokens, and
the hinge on the tokens above the `train.scale_tail` ratio × typical); head_scale is scale at the per-head norms'
inputs, per token and head (`train.head_scale_loss_weight`); key0 is position 0's alone at the key norms'
inputs, per head (`train.position0_key_scale_weight`); pos0 is that hinge on position 0
alone (`train.position0_tail`); mlp0 pulls what position 0's own MLPs write towards zero
(`train.position0_mlp`, `lnfree.removal.losses.position0_mlp`); range pulls every MLP neuron back within a multiple of
its range in the original (`train.neuron_range`, `lnfree.removal.losses.neuron_range`); gain bounds every MLP
neuron's gain in weight space, the same on every micro-batch (`train.neuron_gain`,
`lnfree.removal.losses.gain`); growth hinges each MLP sublayer's growth factor for a token scaled up, every
block, on a few of the micro-batch's tokens (`train.local_growth`, `lnfree.removal.losses.growth`); margin, in forwards of
its own over a few of the micro-batch's sequences (`Objective.margin`), hinges the growth downstream of one
token's residual scaled up at one block (`train.stability_margin`, `lnfree.removal.losses.margin`); attn is the KL
from the teacher's attention rows to the model's (`train.attention_kl`, `lnfree.removal.losses.attention`). With
`train.coverage` (`lnfree.removal.losses.coverage`) each
micro-step also runs generated rows of random and repeated ids on their own (`Objective.coverage`):
cov_kl (KL to the teacher there) and cov_tail (the hinge against the text's typical scales). Every weight comes from `TrainConfig` (the
step-dependent ones from the setting on at that step, `lnfree.removal.losses.massive.tail_at`); a term whose
weight is 0 is not computed, and one that is not configured is not logged. With
`train.chunked_vocab_loss` CE and KL come from `lnfree.removal.losses.vocab_loss` (chunked, fused, the same value):
neither model then computes its logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lnfree.arch import architecture
from lnfree.fixedscale import surgery
from lnfree.removal.config import TrainConfig
from lnfree.removal.losses.attention import AttentionPatterns, attention_kl_loss
from lnfree.removal.losses.coverage import Coverage, coverage_hinge, typical_log_scales
from lnfree.removal.losses.margin import StabilityMargin, margin_loss, perturbed, previewed
from lnfree.fixedscale.functional import second_moment
from lnfree.removal.losses.massive import (
    Captured,
    NormInputs,
    pieces,
    position0_log_gain,
    scale_loss,
    scale_tail_loss,
    tail_at,
    typical_scale,
    weighted_inputs,
)
from lnfree.removal.losses.gain import GainWeights, neuron_gain_loss, project_gains
from lnfree.removal.losses.growth import MlpSublayers, local_growth_loss
from lnfree.removal.losses.neuron_range import NeuronActivations, neuron_range_loss
from lnfree.removal.losses.position0_mlp import MlpOutputs, position0_mlp_loss
from lnfree.removal.losses.vocab_loss import IGNORE, HeadInput, compiles_vocab_terms, logits_loss, vocab_loss

#: The loss and its terms, in the order `Objective.__call__` returns them.
TERMS = ("loss", "ce", "aux", "kl", "scale", "head_scale", "key0", "tail", "pos0", "mlp0", "range", "gain", "growth",
         "attn", "margin", "margin_share", "cov_kl", "cov_tail", "cov_share", "first_tail", "first_share",
         "first_replay_tail", "first_replay_share")
#: One training step's row, as train.py stacks and logs it: the `TERMS`, then the gradient norm.
STEP_ROW = (*TERMS, "grad_norm")
#: The step-dependent terms and the `TrainConfig` field that sets each (`lnfree.removal.config.STEP_LOSSES`).
TAILS = {"tail": "scale_tail", "pos0": "position0_tail", "mlp0": "position0_mlp", "range": "neuron_range",
         "gain": "neuron_gain", "margin": "stability_margin", "growth": "local_growth", "attn": "attention_kl"}


class LnfInput:
    """Keeps the input of the final norm from the latest forward pass (a registered forward pre-hook)."""

    def __init__(self, ln_f: nn.Module):
        self.value: torch.Tensor | None = None
        self.handle = ln_f.register_forward_pre_hook(self._keep)

    def _keep(self, module: nn.Module, args: tuple) -> None:
        self.value = args[0]


class HeadNormInputs(Captured):
    """Keeps every per-head norm's input (q_norm, k_norm) of the latest forward pass, as (batch, positions,
    heads, head dim) whatever the family's layout: `scale_loss` then sees one scale per token and head. `stages`:
    only those norms (such as ("k_norm",)), or every per-head norm."""

    def __init__(self, model: nn.Module, stages: tuple[str, ...] | None = None):
        sites = [site for site in architecture(model).sites()
                 if site.per_head and (stages is None or site.stage in stages)]
        super().__init__([model.get_submodule(site.module) for site in sites])
        self.heads_axes = {module: site.heads_axis for module, site in zip(self.modules, sites, strict=True)}
        self.handles = [module.register_forward_pre_hook(self.keep_input) for module in self.modules]

    def take(self) -> list[torch.Tensor]:
        inputs = super().take()
        return [x.movedim(self.heads_axes[module], 2) for x, module in zip(inputs, self.sources, strict=True)]


def auxiliary_loss(
    resid: torch.Tensor, input_ids: torch.Tensor, eot_token_id: int, eps: float, kind: str = "layer",
) -> torch.Tensor:
    """Mean squared deviation of the per-token scale at the final-norm input from its typical value.

    The scale is the norm's own: std for LayerNorm (`kind="layer"`), RMS for RMSNorm.

    The target is the detached mean std over tokens that are neither at position 0 nor EOT
    (Baroni et al. 2025, arXiv 2507.02559); the loss covers every token, pulling the outliers towards the target.
    """
    std = torch.sqrt(second_moment(resid.float(), kind) + eps)
    return ((std - typical_scale(std, input_ids, eot_token_id)) ** 2).mean()


def _output_tie(output) -> torch.Tensor:
    """An exact zero that depends on the forward's logits, for a loss read off inner activations alone (norm
    inputs, by hooks). FSDP hangs its backward hooks (unshard, then reduce the gradients) on a sharded module's
    outputs, so without it such a loss's gradients would never be reduced across processes (and its
    modules' weights would not be gathered for the backward). An empty slice: no arithmetic on logits that may
    have run away. Where the head was skipped (DDP, one process) it is a plain zero."""
    return output.logits[..., :0].sum()


class Objective:
    """A run's loss on `model` (the unwrapped module: its hooks see every forward of a DDP/FSDP
    wrapper too). `remove()` takes the hooks away when training ends."""

    def __init__(self, model: nn.Module, train: TrainConfig, arch, teacher: nn.Module | None, eot_token_id: int,
                 autocast: Callable):
        self.train, self.eot_token_id, self.autocast = train, eot_token_id, autocast
        self.eps, self.norm_kind = arch.eps, arch.norm_kind
        self.lnf_input = LnfInput(model.get_submodule(arch.final_norm))
        chunked = train.chunked_vocab_loss is not None
        self.head = HeadInput(model, arch) if chunked else None  # the student's final hidden states
        self.headless = HeadInput(model, arch, for_loss=False)  # for forwards whose logits nothing reads
        embedding = model.get_input_embeddings()  # its size whole under FSDP too
        self.compiled = compiles_vocab_terms(train.compile_vocab_loss, embedding.weight.device, embedding.num_embeddings)
        wanted = (train.scale_loss_weight > 0 or train.scale_tail is not None or train.position0_tail is not None
                  or train.coverage is not None or train.stability_margin is not None)
        self.typical: list[torch.Tensor] | None = None  # the text's typical log scales, for `coverage`
        self.norm_inputs = NormInputs(model) if wanted else None
        self.head_inputs = HeadNormInputs(model) if train.head_scale_loss_weight > 0 else None
        self.key_inputs = HeadNormInputs(model, ("k_norm",)) if train.position0_key_scale_weight > 0 else None
        self.blocks = model.get_submodule(arch.layers)  # where `margin` perturbs the residual
        self.residual_reads = {model.get_submodule(site.module) for site in arch.sites()  # what `margin` hinges
                               if not site.per_head and not site.on_output}
        blocks = [p.from_block for p in pieces(train.position0_mlp)]
        self.mlp_outputs = MlpOutputs(model, blocks) if blocks else None
        self.neuron_activations = NeuronActivations(model) if train.neuron_range is not None else None
        self.neuron_ranges: list[torch.Tensor] | None = None  # set by the run from the teacher (`neuron_ranges`)
        self.gain_weights = GainWeights(model) if train.neuron_gain is not None else None
        # a vanilla control has no σ to measure a sublayer as fixed with: the hinge is not computed there (0)
        growing = train.local_growth is not None and surgery.is_installed(model)
        self.sublayers = MlpSublayers(model) if growing else None
        self.attention = AttentionPatterns(model) if train.attention_kl is not None else None
        self.teacher_head: HeadInput | None = None
        self.teacher_attention: AttentionPatterns | None = None
        self.set_teacher(teacher, arch)
        self.captured = [hooks for hooks in (self.norm_inputs, self.head_inputs, self.key_inputs, self.mlp_outputs,
                                             self.neuron_activations, self.sublayers, self.attention) if hooks is not None]
        for hooks in self.captured:  # only the loss's own forwards: not the evaluations, not a recompute,
            hooks.active = False  # not the coverage rows

    def set_teacher(self, teacher: nn.Module | None, arch) -> None:
        """Distil from `teacher` from now on (`train.teacher_start`): its hooks replace the last teacher's."""
        if self.teacher_attention is not None:
            self.teacher_attention.remove()
            self.teacher_attention.clear()
        self.teacher = teacher
        chunked = self.train.chunked_vocab_loss is not None
        self.teacher_head = HeadInput(teacher, arch) if chunked and teacher is not None else None
        attending = self.train.attention_kl is not None and teacher is not None
        self.teacher_attention = AttentionPatterns(teacher) if attending else None
        if self.teacher_attention is not None:
            self.teacher_attention.active = False

    def tails_at(self, step: int) -> tuple:
        """The settings on at `step` of the step-dependent terms (`TAILS`; None where one is off)."""
        return tuple(tail_at(getattr(self.train, field), step) for field in TAILS.values())

    def __call__(self, model: nn.Module, input_ids: torch.Tensor, tails: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss to backpropagate, the detached `TERMS` stacked): `model` is what to call (a
        distributed wrapper of the module the hooks sit on)."""
        train, ids, eot, kind = self.train, input_ids, self.eot_token_id, self.norm_kind
        tail, tail0, mlp0, bounds, gain_bound, _, growth_on, attend = tails  # the margin: `margin`, its own forward
        alpha = train.distill_alpha
        with contextlib.ExitStack() as stack:
            for hooks in self.captured:
                stack.enter_context(hooks.capturing())
            output = self._forward(model, ids, labels=not self.teaching(alpha))
        watching = self.teacher_attention is not None and attend is not None  # the teacher's rows, while it is on
        with self.teacher_attention.capturing() if watching else contextlib.nullcontext():
            vocab, ce, kl = self._vocab_terms(output, ids, 1 - alpha, alpha, labels=True)
        aux = auxiliary_loss(self.lnf_input.value, ids, eot, self.eps, kind)
        spread, excess, excess0 = torch.zeros_like(ce), torch.zeros_like(ce), torch.zeros_like(ce)
        if self.norm_inputs is not None:
            inputs = self.norm_inputs.take()
            if train.coverage is not None:
                self.typical = typical_log_scales(inputs, ids, eot, kind)
            if train.scale_loss_weight > 0:
                spread = scale_loss(inputs, ids, eot, kind, train.scale_loss_form)
            if tail is not None and tail.measure == "output":
                weighted = weighted_inputs(inputs, self.norm_inputs.sources, kind)
                excess = scale_tail_loss(weighted, ids, eot, "rms", tail.ratio)
            elif tail is not None:
                excess = scale_tail_loss(inputs, ids, eot, kind, tail.ratio)
            if tail0 is not None:
                gains = ([position0_log_gain(m) for m in self.norm_inputs.sources] if tail0.measure == "output"
                         else None)
                excess0 = scale_tail_loss(inputs, ids, eot, kind, tail0.ratio, position0=True, gains=gains)
        heads = torch.zeros_like(ce)
        if self.head_inputs is not None:
            heads = scale_loss(self.head_inputs.take(), ids, eot, kind, train.scale_loss_form)
        key0 = torch.zeros_like(ce)
        if self.key_inputs is not None:
            key0 = scale_loss(self.key_inputs.take(), ids, eot, kind, position0=True)
        silence = torch.zeros_like(ce)
        if self.mlp_outputs is not None:
            outputs = self.mlp_outputs.take()
            if mlp0 is not None:
                first = self.mlp_outputs.first_block
                silence = position0_mlp_loss(outputs[mlp0.from_block - first:], ids, eot)
        beyond = torch.zeros_like(ce)
        if self.neuron_activations is not None:
            activations = self.neuron_activations.take()
            if bounds is not None:
                beyond = neuron_range_loss(activations, self.neuron_ranges, bounds.ratio)
        gain = torch.zeros_like(ce)
        if gain_bound is not None:
            gain = neuron_gain_loss(self.gain_weights.gains(), gain_bound.ratio)
        attn = torch.zeros_like(ce)
        if self.attention is not None:
            student = self.attention.take()
            if watching:
                attn = attention_kl_loss(student, self.teacher_attention.take())
        growth = torch.zeros_like(ce)
        if self.sublayers is not None:
            inputs = self.sublayers.take()
            if growth_on is not None and growth_on.weight > 0:
                with self.autocast():
                    growth = local_growth_loss(self.sublayers, inputs, growth_on)
        weights = [0.0 if t is None else t.weight for t in (*tails[:5], growth_on, attend)]
        loss = (vocab + train.aux_loss_weight * aux + train.scale_loss_weight * spread
                + train.head_scale_loss_weight * heads + train.position0_key_scale_weight * key0
                + weights[0] * excess + weights[1] * excess0 + weights[2] * silence + weights[3] * beyond
                + weights[4] * gain + weights[5] * growth + weights[6] * attn)
        zero = torch.zeros_like(ce)
        terms = (loss, ce, aux, kl, spread, heads, key0, excess, excess0, silence, beyond, gain, growth, attn)
        terms += (zero,) * (len(TERMS) - len(terms))  # the passes after the text's (margin, coverage) fill the rest
        return loss, torch.stack([t.detach() for t in terms])

    def after_step(self, step: int) -> None:
        """After `step`'s optimiser step: the gains bounded in place where `train.neuron_gain` projects."""
        bound = tail_at(self.train.neuron_gain, step)
        if bound is not None and bound.project:
            project_gains(self.gain_weights, bound.ratio)

    def coverage(self, model: nn.Module, input_ids: torch.Tensor, cov: Coverage, bos: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss, the `TERMS`) of the generated rows `input_ids` (`lnfree.removal.losses.coverage`, settings
        `cov`; `bos` the family's BOS id, if it reads one), after a text micro-batch: KL to the teacher and the
        hinge against that text's typical scales, no CE; the norms' σ statistics paused."""
        bare = self.norm_inputs.model
        with surgery.statistics_paused(bare), self.norm_inputs.capturing():
            output = self._forward(model, input_ids, labels=False, logits=self.teaching(cov.kl_weight))
        position0 = input_ids[:, 0] != bos if cov.no_bos_position0 and bos is not None else None
        hinge = coverage_hinge(self.norm_inputs.take(), self.typical, self.norm_kind, cov.ratio, position0)
        vocab, _, kl = self._vocab_terms(output, input_ids, 0.0, cov.kl_weight, labels=False)
        loss = vocab + cov.weight * hinge + _output_tie(output)
        terms = [torch.zeros_like(hinge)] * len(TERMS)
        terms[0], terms[TERMS.index("cov_kl")], terms[TERMS.index("cov_tail")] = loss, kl, hinge
        return loss, torch.stack([t.detach() for t in terms])

    def first_tokens(self, model: nn.Module, input_ids: torch.Tensor, cov: Coverage,
                     term: str = "first") -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss, the `TERMS`) of one-token rows `input_ids` (`Coverage.first_token_rows`), after a text
        micro-batch: the coverage hinge at their only token, position 0, against that text's typical scales;
        no KL, the norms' σ statistics paused. `term`: the logged hinge's prefix (`first`, or `first_replay` for
        the replayed rows capped apart)."""
        with surgery.statistics_paused(self.norm_inputs.model), self.norm_inputs.capturing():
            output = self._forward(model, input_ids, labels=False, logits=False)
        every = torch.ones(len(input_ids), dtype=torch.bool, device=input_ids.device)
        hinge = coverage_hinge(self.norm_inputs.take(), self.typical, self.norm_kind, cov.ratio, every)
        terms = [torch.zeros_like(hinge)] * len(TERMS)
        terms[0], terms[TERMS.index(f"{term}_tail")] = cov.weight * hinge, hinge
        return cov.weight * hinge + _output_tie(output), torch.stack([t.detach() for t in terms])

    @contextlib.contextmanager
    def margin(self, model: nn.Module, input_ids: torch.Tensor, site: tuple[int, int], setting: StabilityMargin,
               preview: list | None = None):
        """Within: (the loss, the `TERMS`) of the stability margin on the text rows `input_ids`: their norm
        inputs without gradient, then again with the residual entering block `site[0]` scaled by
        `setting.factor` at position `site[1]`, or, with `setting.preview`, with the norm switches `preview`
        made at once (every token from position 1 then), hinged (`lnfree.removal.losses.margin`). The
        perturbation and the pause of the norms' σ statistics last until the context exits, so that a backward
        inside it (and a gradient-checkpointing recompute there) sees the forward the loss came from."""
        if setting.preview:
            position, factor, change = 1, 1.0, previewed(self.norm_inputs.model, preview or [])
        else:
            position, factor = site[1], setting.factor
            change = perturbed(self.blocks[site[0]], position, factor)
        with surgery.statistics_paused(self.norm_inputs.model):
            with torch.no_grad(), self.norm_inputs.capturing():
                self._forward(model, input_ids, labels=False, logits=False)
            clean = self._residual_inputs()
            with change:
                with self.norm_inputs.capturing():
                    output = self._forward(model, input_ids, labels=False, logits=False)
                hinge = margin_loss(clean, self._residual_inputs(), position, self.norm_kind, factor, setting.ratio)
                loss = setting.weight * hinge + _output_tie(output)
                terms = [torch.zeros_like(hinge)] * len(TERMS)
                terms[0], terms[TERMS.index("margin")] = loss, hinge
                yield loss, torch.stack([t.detach() for t in terms])

    def _residual_inputs(self) -> list[torch.Tensor]:
        """The inputs of the norms that read the residual stream, from the latest capturing forward (a
        sublayer-output norm's input is what a gated MLP makes of its own, squared by construction)."""
        inputs = self.norm_inputs.take()
        return [x for x, module in zip(inputs, self.norm_inputs.sources, strict=True) if module in self.residual_reads]

    def teaching(self, kl_weight: float) -> bool:
        """Whether the vocabulary terms hold a KL to the teacher (then CE comes with it, `logits_loss`); the
        coverage rows' loss reads the logits only then."""
        return self.teacher is not None and kl_weight > 0

    def _forward(self, model: nn.Module, ids: torch.Tensor, labels: bool, logits: bool = True):
        """The student's forward on `ids` under autocast (no KV cache to build): transformers' CE when
        `labels`; no logits where the vocabulary loss is chunked (`self.head` keeps the hidden states) or
        `logits` is False (nothing reads them: the head's product is skipped, except under FSDP)."""
        skip = self.head
        if skip is None and not logits and self.headless.skips(model):
            skip = self.headless
        with self.autocast(), skip.skipping(model) if skip is not None else contextlib.nullcontext():
            if labels and self.head is None:
                return model(input_ids=ids, labels=ids, use_cache=False)
            return model(input_ids=ids, use_cache=False)

    def _vocab_terms(self, output, ids: torch.Tensor, ce_weight: float, kl_weight: float,
                     labels: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ce_weight·CE + kl_weight·KL, CE, KL) of the student's `output` on `ids`: CE when `labels`, KL
        to the teacher when there is one and `kl_weight` > 0; a term that is off is zero."""
        zero = torch.zeros((), device=ids.device)
        teaching = self.teaching(kl_weight)
        if self.head is not None:
            return self._chunked_terms(ids, ce_weight, kl_weight if teaching else 0.0, labels, teaching)
        if not teaching:
            ce = output.loss if labels else zero
            return ce_weight * ce, ce, zero
        with torch.no_grad(), self.autocast():
            target = self.teacher(input_ids=ids, use_cache=False).logits
        targets = F.pad(ids[:, 1:], (0, 1), value=IGNORE) if labels else None
        return logits_loss(output.logits, targets, target, ce_weight=ce_weight, kl_weight=kl_weight,
                           temperature=self.train.distill_temperature, compiled=self.compiled)

    def _chunked_terms(self, ids: torch.Tensor, ce_weight: float, kl_weight: float, labels: bool,
                       teaching: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_vocab_terms` by `lnfree.removal.losses.vocab_loss` from the hidden states `self.head` kept (and the teacher's)."""
        teacher = None
        if teaching:
            with torch.no_grad(), self.autocast(), self.teacher_head.skipping():
                self.teacher(input_ids=ids, use_cache=False)
            teacher = (self.teacher_head.value, self.teacher_head.weight)
        targets = F.pad(ids[:, 1:], (0, 1), value=IGNORE) if labels else None
        with self.autocast():
            return vocab_loss(self.head.value, self.head.weight, targets, teacher, ce_weight=ce_weight,
                              kl_weight=kl_weight, temperature=self.train.distill_temperature,
                              chunk=self.train.chunked_vocab_loss, compiled=self.compiled)

    def record(self, means: list[float]) -> dict:
        """A log record of `means` (the `TERMS` and the gradient norm), without the terms never computed."""
        record = dict(zip(STEP_ROW, means))
        if self.teacher is None:
            del record["kl"]
        if self.train.scale_loss_weight == 0:
            del record["scale"]
        if self.train.head_scale_loss_weight == 0:
            del record["head_scale"]
        if self.train.position0_key_scale_weight == 0:
            del record["key0"]
        if self.train.coverage is None:
            del record["cov_kl"], record["cov_tail"], record["cov_share"]
        if not any(piece.first_token_rows for piece in pieces(self.train.coverage)):
            del record["first_tail"], record["first_share"]
        if not any(piece.first_replay_apart for piece in pieces(self.train.coverage)):
            del record["first_replay_tail"], record["first_replay_share"]
        for term, field in TAILS.items():
            if getattr(self.train, field) is None:
                del record[term]
        if self.train.stability_margin is None:
            del record["margin_share"]
        return record

    def remove(self) -> None:
        """Take the hooks off the model and drop what they kept."""
        self.lnf_input.handle.remove()
        for hooks in (*self.captured, self.teacher_attention):
            if hooks is not None:
                hooks.remove()
                hooks.clear()
