"""The removal (or vanilla-control) fine-tuning run, readable top to bottom.

One optimiser step: apply this step's removal actions (`lnfree.removal.timeline`: scheduled or adaptive events,
instant or gradual), run the micro-batches on the run's loss (`lnfree.removal.losses.objective`: cross-entropy,
distillation to the frozen original, the auxiliary, scale and tail terms; bf16 autocast over fp32 weights on GPU),
clip, step AdamW at the warm-up/cosine learning rate (then bound the MLP neurons' gains where `train.neuron_gain`
projects), then fold the gathered per-token statistics into every real norm's σ (pooled over ranks). Data and
learning rate are pure functions of the step and the timeline's state is checkpointed, so a run resumed from any
checkpoint continues exactly. Checkpoints are written to a temporary folder and renamed when complete, so a kill
loses at most the steps since the last one. Multi-GPU runs go through accelerate (``torchrun`` or ``accelerate
launch``: DDP, or FSDP through an accelerate config).

The pieces live beside it: `lnfree.removal.resolve` (the config resolved against the model),
`lnfree.removal.launch` (the accelerator and its processes), `lnfree.removal.runfolder` (opening the run folder),
`lnfree.removal.preparation` (model, teacher, autocast, optimiser), `lnfree.removal.records` (held-out measurements
and the log), `lnfree.removal.checkpointing` (save and resume), `lnfree.removal.capped` (the generated rows' and
the stability margin's passes after the text's). Their public names are importable from here too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from torch import nn
from tqdm.auto import tqdm

from lnfree.fixedscale import surgery
from lnfree.arch import architecture
from lnfree.arch.base import Architecture
from lnfree.fixedscale.ceiling import ScaleCeiling, set_ceiling
from lnfree.removal.checkpointing import load_checkpoint_state, save_checkpoint
from lnfree.removal.frozen_head import use_frozen_head
from lnfree.removal.config import RunConfig
from lnfree.removal.capped import coverage_backward, margin_backward
from lnfree.removal.losses.coverage import Coverage
from lnfree.data.documents import DeviceBatches, StepBatches, TokenData, bos_token, prepare_data
from lnfree.removal.launch import make_accelerator, quiet_libraries
from lnfree.removal.layout import LOG, START, TOKENIZER
from lnfree.removal.losses.massive import Damping, find_massive_neurons, tail_at
from lnfree.models.base import load_base
from lnfree.removal.losses.neuron_range import neuron_ranges
from lnfree.removal.generated import coverage_rows, mine_if_due
from lnfree.removal.mining import MinedIds
from lnfree.removal.losses.objective import STEP_ROW, TAILS, TERMS, Objective
from lnfree.removal.plan import describe_run
from lnfree.removal.precision import casts_kept, cpu_description
from lnfree.removal.preparation import (  # noqa: F401 (re-exported)
    autocast_factory, compile_blocks, freeze_token_embedding, lr_scales, make_optimizer, prepare_model, run_teacher)
from lnfree.removal.records import (  # noqa: F401 (re-exported)
    HeldOut, RunClock, RunLog, TrainingDiverged, eval_record, event_record, held_out_ce, started_precision,
    stop_if_diverged,
)
from lnfree.removal.resolve import (  # noqa: F401 (re-exported)
    RunError, context_length, learning_rate, micro_batches, resolve_run, sigma_momentum_per_step,
)
from lnfree.removal.runfolder import prepare_output_dir
from lnfree.removal.runtime import steady_allocator
from lnfree.removal.schedule import Event
from lnfree.removal.timeline import Timeline

SCALE_SEQUENCES = 8  # held-out sequences on which the massive-activation scales are logged

logger = logging.getLogger("lnfree")


@dataclass
class RunResult:
    """What a finished run produced."""

    output_dir: Path
    config: RunConfig
    held_out_ce_start: float
    held_out_ce_end: float
    events: list[dict] = field(default_factory=list)
    checkpoint: Path | None = None
    model: nn.Module | None = None
    held_out_tokens: int = 0  # next-token predictions behind each held-out CE
    seconds: float = 0.0  # training wall time over every process of the run (resumes included)
    already_finished: bool = False  # `resume` found the run finished and changed nothing
    probe: torch.Tensor | None = None  # held-out input ids, for measurements at export


def run(config: RunConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True) -> RunResult:
    """Fine-tune `config.model` with LayerNorm removal (or the vanilla control) and return the result.

    Everything that can be checked (model, tokenizer, data, schedule) is checked before the
    output folder is touched. `resume` continues from the newest complete checkpoint; resuming a
    finished run changes nothing and returns it with `already_finished`.
    """
    with quiet_libraries():
        return _run(config, resume=resume, overwrite=overwrite, progress=progress)


# ----------------------------------------------------------------------------- the loop


def _run(config: RunConfig, *, resume: bool, overwrite: bool, progress: bool) -> RunResult:
    """Set up, start (or resume from a checkpoint), train `max_steps` optimiser steps, finish."""
    s = _set_up(config, resume, overwrite)
    config, train, accelerator, out = s.config, s.config.train, s.accelerator, s.out
    ce_start = None if resume else _start(s)
    damping = _damping(config, s.model, s.batches, out, resume, accelerator.is_main_process)
    if train.freeze_embeddings:
        freeze_token_embedding(s.model)
    if not s.sharded:  # FSDP gathers weights inside each forward
        use_frozen_head(s.model, s.arch.unembedding)
    model, optimizer = accelerator.prepare(s.model, make_optimizer(s.model, config))
    bare = accelerator.unwrap_model(model)
    held_out = replace(s.held_out, model=model, bare=bare)  # evaluations now run the prepared model
    timeline = Timeline(s.events, config.removal.blend_steps, config.removal.adaptive)
    start_step, seconds_before, cpu_before = 0, 0.0, 0.0
    if resume:
        checkpoint, state = load_checkpoint_state(accelerator, out, timeline)
        start_step, seconds_before, cpu_before = state["step"], state.get("seconds", 0.0), state.get("cpu_seconds", 0.0)
        ce_start = json.loads((out / START).read_text())["held_out_ce"]
        if start_step >= train.max_steps:
            return _already_finished(s, held_out, timeline, checkpoint, state, ce_start)
        _log_resume(s, start_step, checkpoint)
    removal = _Removal(config, timeline, damping, s.momentum, world=accelerator.num_processes)
    objective = Objective(bare, train, s.arch, s.teacher, s.data.eot_token_id, s.autocast)
    if train.neuron_range is not None:  # the teacher's: the same on every resume
        objective.neuron_ranges = neuron_ranges(s.teacher, _probe(config, s.batches, accelerator.device), s.autocast)
    pending: list[torch.Tensor] = []  # per-step STEP_ROW, read once per log interval: no host sync
    bar = tqdm(range(start_step, train.max_steps), initial=start_step, total=train.max_steps,
               disable=not (progress and accelerator.is_main_process), desc=config.removal.mode)
    model.train()
    clock = RunClock(seconds_before, cpu_before)
    scales = lr_scales(optimizer, config)
    for step in bar:
        removal.before_step(bare, step, s.log)
        mine_if_due(s.config, s.accelerator, s.data, s.mined, s.log, bare, step, removal.ceiling_now,
                    bf16=s.precision == "bf16")
        if train.teacher_start and step == max(train.teacher_start, start_step):  # train.teacher from here on
            s.teacher = s.teach(train.teacher)
            objective.set_teacher(s.teacher, s.arch)
        lr = learning_rate(step, config)
        for group, scale in zip(optimizer.param_groups, scales):
            group["lr"] = lr * scale
        with casts_kept(not s.sharded):
            totals = _forward_backward(s, model, objective, step, lambda n: timeline.upcoming(step, n))
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), train.grad_clip)
        if not _spike(grad_norm, train.skip_grad_norm, step, s.log):
            optimizer.step()
            objective.after_step(step)
        optimizer.zero_grad(set_to_none=True)
        removal.after_step(bare, totals, accelerator)
        pending.append(torch.cat([totals, grad_norm.detach().reshape(1).to(totals)]))

        done = step + 1
        saving = train.saves_after(done)
        logging_now = done % train.log_every == 0 or done == train.max_steps
        if logging_now or saving:  # before a non-finite model is saved
            stop_if_diverged(torch.stack(pending), done, timeline, out, STEP_ROW)
        if logging_now:
            record = _log_losses(s, objective, pending, done, lr, clock)
            bar.set_postfix(ce=f"{record['ce']:.3f}", aux=f"{record['aux']:.3g}")
        if train.eval_every and done % train.eval_every == 0 and done != train.max_steps:
            s.log(eval_record(held_out, done, removal.ceiling_now))
        if saving:
            save_checkpoint(accelerator, bare, out, done, bare.config,
                            {**clock.state(), "timeline": timeline.state_dict()},
                            train.keep_checkpoints, train.keep_steps)
    objective.remove()
    removal.finish(bare)
    return _finish(s, held_out, timeline, clock, ce_start)


# ----------------------------------------------------------------------------- before the loop


@dataclass
class _Setup:
    """A run's parts before training: the resolved config and what was built from it."""

    config: RunConfig
    accelerator: Accelerator
    model: nn.Module  # plain: not yet prepared by accelerate
    arch: Architecture
    events: list[Event]
    data: TokenData
    batches: StepBatches
    loader: DeviceBatches
    held_out: HeldOut  # of the plain model
    log: RunLog
    teacher: nn.Module | None
    autocast: Callable  # a new autocast context (`autocast_factory`)
    precision: str
    momentum: float  # σ momentum per optimiser step
    steady: bool  # whether glibc keeps freed memory (`lnfree.removal.runtime.steady_allocator`)
    amended: list[str]  # the config fields a resumed run changed
    coverage_rows: Callable[[int, int, Coverage], torch.Tensor] | None  # (step, micro-step, settings) → generated rows
    mined: MinedIds  # the ids `train.coverage.mine` found (the run folder's MINED)
    teach: Callable[[str], nn.Module] | None = None  # loads a distillation teacher by name (`train.teacher_start`)

    @property
    def out(self) -> Path:
        """The run folder."""
        return Path(self.config.output_dir)

    @property
    def sharded(self) -> bool:
        """Whether the run shards its weights (FSDP)."""
        return self.accelerator.distributed_type == DistributedType.FSDP


def _set_up(config: RunConfig, resume: bool, overwrite: bool) -> _Setup:
    """Check and resolve everything, then open the run folder and prepare the model, data and log."""
    accelerator = make_accelerator(config)
    set_seed(config.train.seed)
    on_cpu = accelerator.device.type == "cpu"
    steady = config.train.steady_allocator and on_cpu and steady_allocator()  # large vocabularies: lnfree.removal.runtime
    model, tokenizer = load_base(config.model)
    arch = architecture(model)
    slots = [slot for site in arch.sites() for slot in site.slots]
    config, events = resolve_run(config, arch.n_layers, arch.stages, slots)
    train, world = config.train, accelerator.num_processes
    context = context_length(config, arch.n_positions)
    micro_batch, accumulation = micro_batches(train, context, world)
    data, scored = _load_data(config, accelerator, tokenizer, model, context)
    amended = []
    if accelerator.is_main_process:
        amended = prepare_output_dir(config, resume, overwrite, arch.n_layers)
        if not resume:
            tokenizer.save_pretrained(Path(config.output_dir) / TOKENIZER)
    accelerator.wait_for_everyone()
    out = Path(config.output_dir)

    auto = {"bf16": True, "no": False}.get(started_precision(out / LOG)) if resume else None  # the start's choice
    autocast, precision = autocast_factory(config, accelerator.device, auto)
    teacher = prepare_model(model, config, data.eot_token_id, accelerator.device, precision, context, auto)
    if accelerator.is_main_process:
        logger.info(describe_run(config, model.config, context, micro_batch, world, accelerator.device, precision != "no"))
    batches = StepBatches(data.train, micro_batch, accumulation, world, train.seed)
    loader = DeviceBatches(batches, accelerator.process_index, accelerator.device)
    momentum = sigma_momentum_per_step(train, batches.sequences_per_step)
    log = RunLog(out / LOG, accelerator, train.report_to)
    if train.report_to:
        accelerator.init_trackers("lnfree", config=json.loads(config.model_dump_json()))
    scale_probe = data.eval_batch(min(config.data.eval_sequences, SCALE_SEQUENCES))
    held_out = HeldOut(model, model, data, config.data.eval_sequences, micro_batch, autocast, scale_probe,
                       accelerator.device, scored, spread=config.data.eval_spread)
    return _Setup(config, accelerator, model, arch, events, data, batches, loader, held_out, log, teacher, autocast,
                  precision, momentum, steady, amended, *coverage_rows(config, accelerator.process_index, context,
                                                                       model, tokenizer),
                  teach=partial(run_teacher, config, model=model, device=accelerator.device, precision=precision,
                                context=context, auto=auto))


def _load_data(config: RunConfig, accelerator: Accelerator, tokenizer, model: nn.Module,
                   context: int) -> tuple[TokenData, int]:
    """The run's tokenised data (prepared by the main process first) and the tokens behind a held-out CE,
    with a warning when they are too few."""
    with accelerator.main_process_first():
        data = prepare_data(config.data, tokenizer, context, model.config.vocab_size,
                            bos_token(model, tokenizer, config.data.bos))
    scored = data.scored_tokens(config.data.eval_sequences)
    if scored < config.data.min_held_out_tokens and accelerator.is_main_process:
        logger.warning("the held-out CE averages only %s tokens (data.min_held_out_tokens = %s): it is noisy; "
                       "raise data.val_fraction or data.eval_sequences", f"{scored:,}",
                       f"{config.data.min_held_out_tokens:,}")
    return data, scored


def _start(s: _Setup) -> float:
    """A new run's start, measured on the plain module before any DDP/FSDP wrapping: the held-out CE
    (returned, and written to `start.json`), a removal run's σ initialised, the log's start record."""
    config, accelerator, batches = s.config, s.accelerator, s.batches
    ce_start = s.held_out.ce().item()
    if config.removal.mode == "remove":
        init = (batches.get(0, i % batches.accumulation, accelerator.process_index).to(accelerator.device)
                for i in range(config.train.sigma_init_batches))
        surgery.initialise_sigmas(s.model, init)
    if accelerator.is_main_process:
        (s.out / START).write_text(json.dumps({"held_out_ce": ce_start}))
    s.log({"event": "start", "step": 0, "held_out_ce": ce_start, "held_out_tokens": s.held_out.tokens,
           "mode": config.removal.mode, "precision": s.precision, "processes": accelerator.num_processes,
           "micro_batch_size": batches.micro_batch_size, "accumulation": batches.accumulation,
           "data": s.data.description, "data_stats": s.data.stats, "sigma_momentum_per_step": s.momentum,
           "steady_allocator": s.steady, "cpu": cpu_description(), **s.held_out.scales()})
    return ce_start


def _damping(config: RunConfig, model: nn.Module, batches: StepBatches, out: Path, resume: bool, main: bool) -> Damping | None:
    """The massive-neuron damping of a run (None without one): neurons found on process 0's first
    `sigma_init_batches` micro-batches (the same on every process) and recorded in the run folder, or
    read back from it on resume. A vanilla control damps them too: it differs from its removal in the
    norms alone."""
    massive = config.removal.massive_neurons
    if massive is None:
        return None
    if resume:
        return Damping.load(massive, out)
    probe = _probe(config, batches, next(model.parameters()).device)
    damping = Damping(massive, find_massive_neurons(model, probe, massive.ratio, massive.min_output, massive.neurons))
    if main:
        damping.save(out)
    logger.info("massive-activation neurons to damp: %s",
                ", ".join(f"{n.layer}.{n.index}" for n in damping.neurons) or "none found")
    return damping


def _probe(config: RunConfig, batches: StepBatches, device: torch.device):
    """Process 0's first `sigma_init_batches` micro-batches of step 0 on `device` (the same on every
    process and every resume): what per-neuron statistics of a run are measured on."""
    return (batches.get(i // batches.accumulation, i % batches.accumulation, 0).to(device)
            for i in range(config.train.sigma_init_batches))


def _log_resume(s: _Setup, step: int, checkpoint: Path) -> None:
    """Drop the log records the resumed run repeats, then record the resume (and any amendment)."""
    s.log.resume(step, checkpoint, s.precision)
    if s.amended:
        s.log({"event": "amend", "step": step, "changed": s.amended})


def _already_finished(s: _Setup, held_out: HeldOut, timeline: Timeline, checkpoint: Path, state: dict,
                      ce_start: float) -> RunResult:
    """The result of a resumed run that had finished: nothing trained, nothing written."""
    logger.info("%s finished at step %d already: nothing to resume", s.out, state["step"])
    ce_end = state["held_out_ce"] if "held_out_ce" in state else held_out.ce().item()  # older runs: measure
    records = [event_record(e, held_out.bare) for e in timeline.applied]
    return RunResult(s.out, s.config, ce_start, ce_end, records, checkpoint, held_out.bare, held_out.tokens,
                     state.get("seconds", 0.0), already_finished=True)


# ----------------------------------------------------------------------------- in the loop


class _Removal:
    """What a removal run does around each optimiser step: before it, the timeline's removal actions,
    the massive-neuron damping and the scale ceiling; after it, the σ update (and the loss an
    adaptive timeline waits on). A vanilla run has none of them."""

    def __init__(self, config: RunConfig, timeline: Timeline, damping: Damping | None, momentum: float, world: int):
        self.removing = config.removal.mode == "remove"
        self.adaptive = bool(config.removal.adaptive)
        self.ceiling: ScaleCeiling | None = config.removal.scale_ceiling if self.removing else None
        self.ceiling_now: float | None = None  # the bound in force (None: never set)
        self.timeline, self.damping, self.momentum, self.world = timeline, damping, momentum, world
        self.max_steps = config.train.max_steps

    def before_step(self, bare: nn.Module, step: int, log: RunLog) -> None:
        """Apply `step`'s removal actions, damping and ceiling to `bare`; log what changed."""
        for event, fraction in self.timeline.actions(step):
            surgery.apply_event(bare, event, fraction)
            if event.step == step:
                log(event_record(event, bare))
        if self.damping is not None and (factor := self.damping.apply(bare, step)) is not None:
            log({"event": "damp_massive_neurons", "step": step, "factor": factor})
        if self.ceiling is not None and (bound := self.ceiling.at(step, self.max_steps)) != self.ceiling_now:
            set_ceiling(bare, bound, self.ceiling.position0)
            if self.ceiling_now is None or math.isinf(bound):
                log({"event": "scale_ceiling", "step": step, "ceiling": "none" if math.isinf(bound) else bound})
            self.ceiling_now = bound

    def after_step(self, bare: nn.Module, totals: torch.Tensor, accelerator: Accelerator) -> None:
        """Fold the step's statistics into every real norm's σ; give an adaptive timeline the step's CE
        (`totals[1]`, averaged over processes; on the device: no host sync)."""
        if self.removing:
            surgery.update_sigmas(bare, self.momentum)
            if self.adaptive:  # its decisions need the loss averaged over processes
                self.timeline.record(accelerator.reduce(totals[1], "mean") if self.world > 1 else totals[1])

    def finish(self, bare: nn.Module) -> None:
        """After the last step: the damped neurons zeroed again, the ceiling lifted."""
        if self.damping is not None:  # the last optimiser step's momentum moved the zeroed neurons
            self.damping.apply(bare, self.max_steps)
        if self.ceiling is not None:
            set_ceiling(bare, math.inf)


def _forward_backward(s: _Setup, model: nn.Module, objective: Objective, step: int,
                      upcoming: Callable[[int], list]) -> torch.Tensor:
    """Forward and backward over `step`'s micro-batches (gradients synchronised on the last only), then
    over its generated rows (`train.coverage`: their gradient capped at a share of the text's) and the
    stability margin (`upcoming(n)`: the next n norm switches, for its preview); return the loss terms
    averaged over them, on the device."""
    accelerator, accumulation = s.accelerator, s.batches.accumulation
    totals = torch.zeros(len(TERMS), device=accelerator.device)
    tails = objective.tails_at(step)
    margin = tails[list(TAILS).index("margin")]
    texts = []  # the micro-batches (the stability margin perturbs their first rows; one-token rows draw from them)
    for micro in range(accumulation):
        with contextlib.nullcontext() if micro == accumulation - 1 else accelerator.no_sync(model):
            ids = s.loader.get(step, micro)
            loss, terms = objective(model, ids, tails)
            accelerator.backward(loss / accumulation)
        totals += terms / accumulation
        texts.append(ids)
    coverage = tail_at(s.config.train.coverage, step)
    if coverage is not None:
        totals += coverage_backward(s, model, objective, step, coverage, texts)
    if margin is not None:
        totals += margin_backward(s, model, objective, step, [t[:margin.rows] for t in texts], margin,
                                   upcoming(margin.preview) if margin.preview else None)
    return totals


def _spike(grad_norm: torch.Tensor, limit: float | None, step: int, log: RunLog) -> bool:
    """Whether this step's gradient norm exceeds `train.skip_grad_norm` (then logged as a skipped step)."""
    if limit is None:
        return False
    norm = grad_norm.item()
    if norm <= limit:  # a non-finite norm is skipped too; `stop_if_diverged` then stops the run
        return False
    log({"event": "skip", "step": step + 1, "grad_norm": norm})
    return True


def _log_losses(s: _Setup, objective: Objective, pending: list[torch.Tensor], done: int, lr: float,
                clock: RunClock) -> dict:
    """Log the loss terms and gradient norm averaged over the `pending` steps (then cleared) after `done`."""
    record = objective.record(torch.stack(pending).mean(0).tolist())
    pending.clear()
    record.update(step=done, lr=lr, tokens=done * s.config.train.tokens_per_step, **clock.state())
    s.log(record)
    return record


# ----------------------------------------------------------------------------- after the loop


def _finish(s: _Setup, held_out: HeldOut, timeline: Timeline, clock: RunClock, ce_start: float) -> RunResult:
    """Measure the trained model, log the end, save the final checkpoint and return the result."""
    train, accelerator, bare = s.config.train, s.accelerator, held_out.bare
    ce_end = held_out.ce().item()
    times = clock.state()
    seconds = times["seconds"]
    s.log({"event": "end", "step": train.max_steps, "held_out_ce": ce_end, "held_out_tokens": held_out.tokens,
           **times, **held_out.scales()})
    checkpoint = save_checkpoint(accelerator, bare, s.out, train.max_steps, bare.config,
                                 {**times, "held_out_ce": ce_end, "timeline": timeline.state_dict()},
                                 train.keep_checkpoints, train.keep_steps)
    if train.report_to:
        accelerator.end_training()
    records = [event_record(e, bare) for e in timeline.applied]  # the same on every process
    probe = s.data.eval_batch(min(s.config.data.eval_sequences, 16))
    return RunResult(s.out, s.config, ce_start, ce_end, records, checkpoint, bare, held_out.tokens, seconds,
                     probe=probe)
