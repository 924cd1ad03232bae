"""The removal (or vanilla-control) fine-tuning run, readable top to bottom.

One optimiser step: apply this step's removal actions (`lnfree.timeline`: scheduled or adaptive
events, instant or gradual), run the micro-batches on the run's loss (`lnfree.objective`:
cross-entropy, distillation to the frozen original, the auxiliary, scale and tail terms; bf16
autocast over fp32 weights on GPU), clip, step AdamW at the warm-up/cosine learning rate, then
fold the gathered per-token statistics into every real norm's σ (pooled over ranks). Data and
learning rate are pure functions of the step and the timeline's state is checkpointed, so a run
resumed from any checkpoint continues exactly. Checkpoints are written to a temporary folder and
renamed when complete, so a kill loses at most the steps since the last one. Multi-GPU runs go
through accelerate (``torchrun`` or ``accelerate launch``: DDP, or FSDP through an accelerate
config).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from torch import nn
from tqdm.auto import tqdm

from lnfree import surgery
from lnfree.amend import AmendError, amendment, without_fields
from lnfree.arch import architecture
from lnfree.ceiling import set_ceiling, watching
from lnfree.config import RunConfig, TrainConfig
from lnfree.data import DeviceBatches, StepBatches, TokenData, bos_token, prepare_data
from lnfree.derived import STALE_MARKER, mark_derived_outputs
from lnfree.distill import load_teacher
from lnfree.layout import (  # noqa: F401 (names other modules read from here)
    CHECKPOINTS, LOG, PARTIAL, RUN_CONFIG, RUN_OUTPUTS, START, TOKENIZER, TRAINER_STATE, checkpoints, latest_checkpoint,
)
from lnfree.massive import Damping, find_massive_neurons, massive_scales
from lnfree.models import load_base
from lnfree.objective import TERMS, Objective
from lnfree.plan import describe_run
from lnfree.runtime import steady_allocator
from lnfree.schedule import PER_LAYER_KINDS, SPECIAL_KINDS, Event, ScheduleError, derive_schedule
from lnfree.timeline import Timeline, blend_length

SCALE_SEQUENCES = 8  # held-out sequences on which the massive-activation scales are logged

logger = logging.getLogger("lnfree")


class RunError(ValueError):
    """A run that cannot start as configured."""


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


# ----------------------------------------------------------------------------- pieces


def resolve_run(
    config: RunConfig, n_layer: int, stages: tuple[str, ...] = PER_LAYER_KINDS[:3], slots: list[str] | None = None,
) -> tuple[RunConfig, list[Event]]:
    """Fill in derived defaults (schedule from the depth and the family's `stages`, max_steps) and
    validate the schedule (against the model's `slots` when given)."""
    removal, train = config.removal, config.train
    schedule = removal.schedule or derive_schedule(n_layer, stages=stages)
    events = schedule.events(n_layer)
    # The step at which the last norm is fixed at the latest (adaptive waits and blends included).
    blends = [blend_length(e, removal.blend_steps) for e in events]
    if removal.adaptive:
        latest = removal.adaptive.latest_step(events) + max(blends) - 1
    else:
        latest = max(e.step + b - 1 for e, b in zip(events, blends))
    max_steps = train.max_steps or max(3 * events[-1].step, latest + 1)
    config = config.model_copy(
        update={
            "removal": removal.model_copy(update={"schedule": schedule}),
            "train": train.model_copy(update={"max_steps": max_steps}),
        }
    )
    if removal.mode == "vanilla":
        return config, []
    massive = removal.massive_neurons
    if massive is not None and massive.start + massive.steps > max_steps:
        raise ScheduleError(f"the massive-neuron damping ends at step {massive.start + massive.steps - 1}, but the run "
                            f"ends after {max_steps} steps")
    ceiling = removal.scale_ceiling
    if ceiling is not None and not 0 <= ceiling.release_at(max_steps) <= max_steps - ceiling.release_steps:
        raise ScheduleError(f"the scale ceiling's release (steps {ceiling.release_at(max_steps)}–"
                            f"{ceiling.release_at(max_steps) + ceiling.release_steps - 1}) must lie within the "
                            f"run's {max_steps} steps")
    if ceiling is not None and not ceiling.position0 and not removal.special_pos0:
        raise ScheduleError("removal.scale_ceiling.position0 = false spares position 0's own σ; set removal.special_pos0")
    events = schedule.check(n_layer, max_steps, removal.special_pos0, removal.special_eot, slots)
    if latest >= max_steps:
        raise ScheduleError(f"the last removal can end at step {latest} (adaptive max_gap and blend_steps "
                            f"included), but the run ends after {max_steps} steps")
    return config, events


def micro_batches(train: TrainConfig, context: int, world: int) -> tuple[int, int]:
    """(micro-batch size, accumulation steps) that make exactly `tokens_per_step` per optimiser step.

    An unset `micro_batch_size` is the largest divisor of the step's sequences per process up to
    `max_micro_batch_size`; a set one that does not divide them is an error.
    """
    per_process, rest = divmod(train.tokens_per_step, context * world)
    if rest or per_process < 1:
        raise RunError(f"tokens_per_step {train.tokens_per_step} must be a multiple of processes × context "
                       f"= {world} × {context}")
    micro = train.micro_batch_size
    if micro is None:
        micro = max(m for m in range(1, min(per_process, train.max_micro_batch_size) + 1) if per_process % m == 0)
    elif per_process % micro:
        raise RunError(
            f"tokens_per_step {train.tokens_per_step} must be a multiple of micro_batch_size × processes × context "
            f"= {micro} × {world} × {context} (leave micro_batch_size unset to have one chosen)"
        )
    return micro, per_process // micro


def close_distributed() -> None:
    """Tear down the process group torchrun / accelerate started, after the last collective.

    Without it a gloo worker can abort at interpreter exit ("terminate called without an active
    exception", exit code -6) after a run that finished correctly: gloo's worker threads still hold
    work objects whose tensors are freed while the interpreter is torn down (the cause named in
    pytorch/pytorch#179291, which proposed the same remedy in torch). Local to each process; `run`
    registers it to run at exit in every distributed process, so scripts need not call it. It does
    not remove every abort: `benchmarks/gloo_exit.py` still saw one in ten runs under load.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def learning_rate(step: int, config: RunConfig) -> float:
    """Linear warm-up to the peak, then cosine decay to the minimum over `cosine_steps`."""
    train = config.train
    if step < train.warmup_steps:
        return train.learning_rate * (step + 1) / train.warmup_steps
    total = train.cosine_steps or train.max_steps
    progress = min(1.0, (step - train.warmup_steps) / max(1, total - train.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return train.min_learning_rate + cosine * (train.learning_rate - train.min_learning_rate)


def freeze_token_embedding(model: nn.Module) -> None:
    """`train.freeze_embeddings`: no gradient for the token embedding (nor a head tied to it)."""
    model.get_submodule(architecture(model).token_embedding).weight.requires_grad_(False)


def make_optimizer(model: nn.Module, config: RunConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norm weights or embeddings' biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.train.learning_rate, betas=config.train.betas)


@torch.no_grad()
def held_out_ce(model: nn.Module, data: TokenData, n_sequences: int, batch_size: int, autocast) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) on the first `n_sequences` held-out sequences."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokens = data.eval_batch(n_sequences)
    total = torch.zeros((), device=device, dtype=torch.float64)
    for chunk in tokens.split(batch_size):
        chunk = chunk.to(device)
        with autocast():
            logits = model(input_ids=chunk, use_cache=False).logits
        total += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum")
    model.train(was_training)
    return total / (tokens.shape[0] * (tokens.shape[1] - 1))


def compile_blocks(model: nn.Module, **options) -> None:
    """`torch.compile` every block of `model` in place (state-dict keys and hooks unchanged); `options`
    go to `torch.compile`.

    Blocks share graphs: there is one per state of a block's norms (real, fixed, train/eval), not
    one per block. Each graph is guarded on the norms' Python mirrors, so switching a slot
    compiles (or reuses) the graph of the new state and never runs a stale one.
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for block in model.get_submodule(architecture(model).layers):
        block.compile(**options)


def _autocast_factory(config: RunConfig, device: torch.device):
    choice = config.train.mixed_precision
    if choice == "auto":
        choice = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "no"
    if choice == "no":
        return contextlib.nullcontext, "no"
    dtype = torch.bfloat16 if choice == "bf16" else torch.float16
    return (lambda: torch.autocast(device.type, dtype=dtype)), choice


def _resume_checkpoint(out: Path) -> Path:
    complete, incomplete = checkpoints(out)
    if not complete:
        raise RunError(f"no complete checkpoint to resume in {out / CHECKPOINTS}; start again with --overwrite")
    for folder in incomplete:
        logger.warning("ignoring the incomplete checkpoint %s (interrupted while being written)", folder)
    logger.info("resuming from %s", complete[-1])
    return complete[-1]


def _truncate_log(path: Path, step: int) -> None:
    """Drop the log records of work after `step`, which the resumed run repeats (and a half-written line)."""
    kept = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        # A removal at step s happens before step s trains; loss/eval records carry the steps done.
        if record.get("step", 0) < step or (record.get("step") == step and record.get("event") != "remove"):
            kept.append(line + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class TrainingDiverged(ValueError):
    """The loss or the gradient norm became non-finite; the run stopped without saving that state.

    A ValueError because its cause is the run's configuration (the CLI reports it as one line)."""


def _stop_if_diverged(rows: torch.Tensor, done: int, timeline: Timeline, out: Path) -> None:
    """Raise `TrainingDiverged` if a step in `rows` (the steps up to `done`, one row each) was not finite."""
    finite = torch.isfinite(rows).all(dim=1).tolist()
    if all(finite):
        return
    bad = done - len(rows) + finite.index(False) + 1
    recent = [f"{e.slot} at step {e.step}" for e in timeline.applied if bad - 10 <= e.step < bad][-5:]
    saved, _ = checkpoints(out)
    raise TrainingDiverged(
        f"training diverged: the loss or gradient norm was not finite at step {bad}"
        + (f", just after removing {', '.join(recent)}" if recent else "")
        + f". Nothing after step {bad - 1} was saved; the latest checkpoint is "
        + (f"{saved[-1].name}." if saved else "none.")
        + " Common remedies: a lower learning rate, a slower schedule (larger gaps, stage blend_steps, "
        "a special σ for outlier positions) or distillation (train.distill_alpha)."
    )


def _damping(config: RunConfig, model: nn.Module, batches: StepBatches, out: Path, resume: bool, main: bool) -> Damping | None:
    """The massive-neuron damping of a removal run (None without one): neurons found on process 0's
    first `sigma_init_batches` micro-batches (the same on every process) and recorded in the run
    folder, or read back from it on resume."""
    massive = config.removal.massive_neurons
    if massive is None or config.removal.mode != "remove":
        return None
    if resume:
        return Damping.load(massive, out)
    device = next(model.parameters()).device
    probe = (batches.get(i // batches.accumulation, i % batches.accumulation, 0).to(device)
             for i in range(config.train.sigma_init_batches))
    damping = Damping(massive, find_massive_neurons(model, probe, massive.ratio, massive.min_output))
    if main:
        damping.save(out)
    logger.info("massive-activation neurons to damp: %s",
                ", ".join(f"{n.layer}.{n.index}" for n in damping.neurons) or "none found")
    return damping


def _event_record(event: Event, model: nn.Module) -> dict:
    record = {"event": "remove", "step": event.step, "slot": event.slot}
    if event.kind not in SPECIAL_KINDS:
        record["sigma"] = float(surgery.scale_states(model)[event.slot].sigma)  # frozen from this step on
    return record


@contextlib.contextmanager
def quiet_libraries():
    """Silence what transformers and accelerate print that is not lnfree's (loading bars, notices, warnings)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    accelerate_log = logging.getLogger("accelerate")
    level = accelerate_log.level
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    accelerate_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        accelerate_log.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


def _prepare_output_dir(config: RunConfig, resume: bool, overwrite: bool, n_layer: int) -> list[str]:
    out = Path(config.output_dir)
    previous, amended = out / RUN_CONFIG, []
    if previous.exists():
        # A run folder may have been moved: compare everything but where it lives. Read through the
        # config class, so that a field added since the run started compares at its default.
        stored = RunConfig.model_validate({**json.loads(previous.read_text()), "output_dir": config.output_dir})
        same = _trajectory(stored) == _trajectory(config)
        if resume and not same:
            step = json.loads((_resume_checkpoint(out) / TRAINER_STATE).read_text())["step"]
            try:
                amended = amendment(stored, config, step, n_layer, learning_rate, BOOKKEEPING_FIELDS)
            except AmendError as error:
                raise RunError(f"{out} holds a run with a different config; cannot resume it with this one: "
                               f"{error}") from None
            logger.warning("amending %s from step %d: %s", out, step, ", ".join(amended))
        if resume and _bookkeeping_changes(stored, config):  # how it is logged or checkpointed changed
            logger.warning("resuming %s with new %s", out, ", ".join(sorted(_bookkeeping_changes(stored, config))))
        if not resume and not overwrite:
            if same:
                raise RunError(f"{out} already holds this same run; continue it with resume=True (CLI: --resume) or "
                               "replace it with overwrite=True (--overwrite)")
            raise RunError(f"{out} already holds a different run; choose another output_dir (CLI: -o DIR) or replace "
                           "it with overwrite=True (--overwrite)")
        if overwrite:
            for folder in mark_derived_outputs(out, skip=RUN_OUTPUTS):
                logger.warning("%s read a model of the run being replaced: marked %s", folder, STALE_MARKER)
            for name in RUN_OUTPUTS:  # never what the user put beside them (e.g. an eval/ folder)
                path = out / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
            for partial in out.glob(".export-*"):
                shutil.rmtree(partial)
    elif resume:
        raise RunError(f"nothing to resume in {out}")
    elif out.exists() and any(out.iterdir()) and not overwrite:
        raise RunError(f"{out} is not empty and holds no lnfree run; choose another output_dir (CLI: --output-dir)")
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_CONFIG).write_text(config.model_dump_json(indent=2))
    return amended


#: Config fields that change how a run is logged, evaluated or checkpointed, not what it trains: a run
#: may resume with other values (the run config then records the new ones).
BOOKKEEPING_FIELDS = {"train": ("eval_every", "log_every", "save_every", "keep_checkpoints", "report_to",
                                "steady_allocator")}


def _trajectory(config: RunConfig) -> dict:
    """`config` as JSON without its bookkeeping fields: two configs equal here train the same model."""
    return without_fields(BOOKKEEPING_FIELDS, config)


def _bookkeeping_changes(old: RunConfig, new: RunConfig) -> list[str]:
    return [f"{section}.{name} ({getattr(getattr(old, section), name)} → {getattr(getattr(new, section), name)})"
            for section, names in BOOKKEEPING_FIELDS.items() for name in names
            if getattr(getattr(old, section), name) != getattr(getattr(new, section), name)]


def save_checkpoint(
    accelerator: Accelerator, model: nn.Module, out: Path, step: int, model_config, extra: dict | None = None,
    keep: int | None = None,
) -> Path:
    """Model (with removal buffers), optimiser and RNG states after `step` completed steps, plus `extra`.

    Written into a temporary folder that is renamed to `checkpoints/step_N` once complete; then only the
    newest `keep` complete checkpoints stay (None: all).
    """
    folder = out / CHECKPOINTS / f"step_{step:06d}"
    partial = folder.with_name(PARTIAL + folder.name)
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    if accelerator.is_main_process:
        model_config.save_pretrained(partial)
        state = {"step": step, **(extra or {})}
        if surgery.is_installed(model):
            state["removal_state"] = surgery.removal_state(model)
        (partial / TRAINER_STATE).write_text(json.dumps(state, indent=1))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if folder.exists():  # an incomplete folder of an older lnfree, or a re-saved step
            shutil.rmtree(folder)
        partial.rename(folder)
        if keep is not None:
            complete, _ = checkpoints(out)
            for old in complete[:-keep]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return folder


# ----------------------------------------------------------------------------- the run


def run(config: RunConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True) -> RunResult:
    """Fine-tune `config.model` with LayerNorm removal (or the vanilla control) and return the result.

    Everything that can be checked (model, tokenizer, data, schedule) is checked before the
    output folder is touched. `resume` continues from the newest complete checkpoint; resuming a
    finished run changes nothing and returns it with `already_finished`.
    """
    with quiet_libraries():
        return _run(config, resume=resume, overwrite=overwrite, progress=progress)


def _accelerator(config: RunConfig) -> Accelerator:
    accelerator = Accelerator(
        cpu=not torch.accelerator.is_available(),  # lets torchrun start gloo processes on CPU-only hosts
        mixed_precision="no",  # autocast is applied explicitly below; weights stay fp32
        log_with=config.train.report_to or None,
        project_dir=config.output_dir,
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
    )
    if accelerator.num_processes > 1:  # whoever called run() (the CLI, a script under torchrun): tear gloo down at exit
        atexit.register(close_distributed)  # still ~1 abort in 10 under load: benchmarks/results/gloo_exit.txt
    return accelerator


def _context_length(config: RunConfig, n_positions: int | None) -> int:
    context = config.data.context_length or n_positions
    if context is None:
        raise RunError("this model has no maximum context length; set data.context_length")
    if n_positions is not None and context > n_positions:
        raise RunError(f"context_length {context} exceeds the model's n_positions {n_positions}")
    return context


def _prepare_model(model: nn.Module, config: RunConfig, eot_token_id: int, device: torch.device) -> nn.Module | None:
    """Install the fixed-scale norms (a removal run), set dropout, checkpointing and compilation, and
    move `model` to `device`; return the distillation teacher (None without distillation)."""
    removal, train = config.removal, config.train
    if removal.mode == "remove":
        surgery.install(model, special_pos0=removal.special_pos0, special_eot=removal.special_eot,
                        eot_token_id=eot_token_id)
    if train.dropout is not None:
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = train.dropout
    teacher = load_teacher(config.model, device, train.teacher_dtype) if train.distill_alpha > 0 else None
    if train.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    if train.compile:
        compile_blocks(model)
    return teacher


def _load_checkpoint_state(accelerator: Accelerator, out: Path, timeline: Timeline) -> tuple[Path, dict]:
    """Load the newest complete checkpoint of `out` into the prepared model, optimiser and RNGs, and
    into `timeline`; return it and its trainer state."""
    checkpoint = _resume_checkpoint(out)
    accelerator.load_state(str(checkpoint))
    state = json.loads((checkpoint / TRAINER_STATE).read_text())
    if "timeline" in state:
        timeline.load_state_dict(state["timeline"], accelerator.device)
    else:  # checkpoints of an older lnfree (fixed gaps only)
        timeline.skip_to(state["step"])
    return checkpoint, state


def _eval_record(bare: nn.Module, done: int, scored: int, ceiling_now: float | None, eval_ce, scales) -> dict:
    """The held-out CE and the massive-activation scales after `done` steps; under a scale ceiling
    (`ceiling_now` finite) also the number of activations it clipped and the model without it."""
    guarded = ceiling_now is not None and not math.isinf(ceiling_now)
    with watching(bare) as ceiling_hits:
        ce, scale_values = eval_ce().item(), scales()
        hits = ceiling_hits() if guarded else None
    record = {"event": "eval", "step": done, "held_out_ce": ce, "held_out_tokens": scored, **scale_values}
    if hits:  # what the model is without its guard
        set_ceiling(bare, math.inf)
        record.update(held_out_ce_unguarded=eval_ce().item(), **{f"{k}_unguarded": v for k, v in scales().items()})
        set_ceiling(bare, ceiling_now)
    elif hits == 0:  # the ceiling never engaged: those passes computed the unguarded model (up to rounding)
        record.update(held_out_ce_unguarded=ce, **{f"{k}_unguarded": v for k, v in scale_values.items()})
    if guarded:
        record["ceiling_hits"] = hits
    return record


def _run(config: RunConfig, *, resume: bool, overwrite: bool, progress: bool) -> RunResult:
    accelerator = _accelerator(config)
    set_seed(config.train.seed)
    on_cpu = accelerator.device.type == "cpu"
    steady = config.train.steady_allocator and on_cpu and steady_allocator()  # large vocabularies: lnfree.runtime
    model, tokenizer = load_base(config.model)
    arch = architecture(model)
    slots = [slot for site in arch.sites() for slot in site.slots]
    config, events = resolve_run(config, arch.n_layers, arch.stages, slots)
    train = config.train
    context = _context_length(config, arch.n_positions)
    world = accelerator.num_processes
    micro_batch, accumulation = micro_batches(train, context, world)
    with accelerator.main_process_first():
        data = prepare_data(config.data, tokenizer, context, model.config.vocab_size, bos_token(model, tokenizer))
    scored = data.scored_tokens(config.data.eval_sequences)
    if scored < config.data.min_held_out_tokens and accelerator.is_main_process:
        logger.warning(
            "the held-out CE averages only %s tokens (data.min_held_out_tokens = %s): it is noisy; raise "
            "data.val_fraction or data.eval_sequences", f"{scored:,}", f"{config.data.min_held_out_tokens:,}",
        )
    amended = []
    if accelerator.is_main_process:
        amended = _prepare_output_dir(config, resume, overwrite, arch.n_layers)
        if not resume:
            tokenizer.save_pretrained(Path(config.output_dir) / TOKENIZER)
    accelerator.wait_for_everyone()
    out = Path(config.output_dir)

    removing = config.removal.mode == "remove"
    teacher = _prepare_model(model, config, data.eot_token_id, accelerator.device)
    autocast, precision = _autocast_factory(config, accelerator.device)
    if accelerator.is_main_process:
        logger.info(describe_run(config, model.config, context, micro_batch, world, accelerator.device, precision != "no"))
    batches = StepBatches(data.train, micro_batch, accumulation, world, train.seed)
    loader = DeviceBatches(batches, accelerator.process_index, accelerator.device)
    momentum = train.sigma_momentum ** (batches.sequences_per_step / train.sigma_momentum_sequences)
    log_path = out / LOG

    def log(record: dict) -> None:
        if accelerator.is_main_process:
            with log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if train.report_to:
                accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record.get("step"))

    if train.report_to:
        accelerator.init_trackers("lnfree", config=json.loads(config.model_dump_json()))
    scale_probe = data.eval_batch(min(config.data.eval_sequences, SCALE_SEQUENCES))

    def scales() -> dict[str, float]:  # position 0's and the outlier token's scale at the norm inputs
        with autocast():
            return massive_scales(accelerator.unwrap_model(model), scale_probe.to(accelerator.device), forward=model)

    if not resume:  # measured on the plain module, before any DDP/FSDP wrapping
        ce_start = held_out_ce(model, data, config.data.eval_sequences, micro_batch, autocast).item()
        if removing:
            init = (batches.get(0, i % accumulation, accelerator.process_index).to(accelerator.device)
                    for i in range(train.sigma_init_batches))
            surgery.initialise_sigmas(model, init)
        if accelerator.is_main_process:
            (out / START).write_text(json.dumps({"held_out_ce": ce_start}))
        log({"event": "start", "step": 0, "held_out_ce": ce_start, "held_out_tokens": scored, "mode": config.removal.mode,
             "precision": precision, "processes": world, "micro_batch_size": micro_batch, "accumulation": accumulation,
             "data": data.description, "data_stats": data.stats, "sigma_momentum_per_step": momentum,
             "steady_allocator": steady, **scales()})

    damping = _damping(config, model, batches, out, resume, accelerator.is_main_process)
    if train.freeze_embeddings:
        freeze_token_embedding(model)
    optimizer = make_optimizer(model, config)
    model, optimizer = accelerator.prepare(model, optimizer)
    bare = accelerator.unwrap_model(model)
    eval_ce = lambda: held_out_ce(model, data, config.data.eval_sequences, micro_batch, autocast)  # noqa: E731
    start_step, seconds_before = 0, 0.0
    timeline = Timeline(events, config.removal.blend_steps, config.removal.adaptive)
    if resume:
        checkpoint, state = _load_checkpoint_state(accelerator, out, timeline)
        start_step, seconds_before = state["step"], state.get("seconds", 0.0)
        ce_start = json.loads((out / START).read_text())["held_out_ce"]
        if start_step >= train.max_steps:
            logger.info("%s finished at step %d already: nothing to resume", out, start_step)
            ce_end = state["held_out_ce"] if "held_out_ce" in state else eval_ce().item()  # older runs: measure
            records = [_event_record(e, bare) for e in timeline.applied]
            return RunResult(out, config, ce_start, ce_end, records, checkpoint, bare, scored, seconds_before,
                             already_finished=True)
        if accelerator.is_main_process:
            _truncate_log(log_path, start_step)
        log({"event": "resume", "step": start_step, "checkpoint": str(checkpoint)})
        if amended:
            log({"event": "amend", "step": start_step, "changed": amended})
    objective = Objective(bare, train, arch, teacher, data.eot_token_id, autocast)
    ceiling, ceiling_now = (config.removal.scale_ceiling if removing else None), None
    pending: list[torch.Tensor] = []  # per-step (TERMS, grad_norm), read once per log interval: no host sync
    bar = tqdm(range(start_step, train.max_steps), initial=start_step, total=train.max_steps,
               disable=not (progress and accelerator.is_main_process), desc=config.removal.mode)
    model.train()
    started = time.perf_counter()
    for step in bar:
        for event, fraction in timeline.actions(step):
            surgery.apply_event(bare, event, fraction)
            if event.step == step:
                log(_event_record(event, bare))
        if damping is not None and (factor := damping.apply(bare, step)) is not None:
            log({"event": "damp_massive_neurons", "step": step, "factor": factor})
        if ceiling is not None and (bound := ceiling.at(step, train.max_steps)) != ceiling_now:
            set_ceiling(bare, bound, ceiling.position0)
            if ceiling_now is None or math.isinf(bound):
                log({"event": "scale_ceiling", "step": step, "ceiling": "none" if math.isinf(bound) else bound})
            ceiling_now = bound
        lr = learning_rate(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        totals = torch.zeros(len(TERMS), device=accelerator.device)
        tails = objective.tails_at(step)
        for micro in range(accumulation):
            sync = contextlib.nullcontext() if micro == accumulation - 1 else accelerator.no_sync(model)
            with sync:
                loss, terms = objective(model, loader.get(step, micro), tails)
                accelerator.backward(loss / accumulation)
            totals += terms / accumulation
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if removing:
            surgery.update_sigmas(bare, momentum)
            if config.removal.adaptive:  # its decisions need the loss averaged over processes
                timeline.record(accelerator.reduce(totals[1], "mean") if world > 1 else totals[1])
        pending.append(torch.cat([totals, grad_norm.detach().reshape(1).to(totals)]))

        done = step + 1
        saving = train.save_every and done % train.save_every == 0 and done != train.max_steps
        if done % train.log_every == 0 or done == train.max_steps or saving:  # before a non-finite model is saved
            _stop_if_diverged(torch.stack(pending), done, timeline, out)
        if done % train.log_every == 0 or done == train.max_steps:
            record = objective.record(torch.stack(pending).mean(0).tolist())
            pending.clear()
            record.update(step=done, lr=lr, tokens=done * train.tokens_per_step,
                          seconds=round(seconds_before + time.perf_counter() - started, 2))
            log(record)
            bar.set_postfix(ce=f"{record['ce']:.3f}", aux=f"{record['aux']:.3g}")
        if train.eval_every and done % train.eval_every == 0 and done != train.max_steps:
            log(_eval_record(bare, done, scored, ceiling_now, eval_ce, scales))
        if saving:
            save_checkpoint(accelerator, bare, out, done, bare.config,
                            {"seconds": round(seconds_before + time.perf_counter() - started, 2),
                             "timeline": timeline.state_dict()}, train.keep_checkpoints)
    objective.remove()
    if damping is not None:  # the last optimiser step's momentum moved the zeroed neurons
        damping.apply(bare, train.max_steps)
    if ceiling is not None:
        set_ceiling(bare, math.inf)

    ce_end = eval_ce().item()
    seconds = round(seconds_before + time.perf_counter() - started, 2)
    log({"event": "end", "step": train.max_steps, "held_out_ce": ce_end, "held_out_tokens": scored, "seconds": seconds,
         **scales()})
    checkpoint = save_checkpoint(accelerator, bare, out, train.max_steps, bare.config,
                                 {"seconds": seconds, "held_out_ce": ce_end, "timeline": timeline.state_dict()},
                                 train.keep_checkpoints)
    if train.report_to:
        accelerator.end_training()
    records = [_event_record(e, bare) for e in timeline.applied]  # the same on every process
    probe = data.eval_batch(min(config.data.eval_sequences, 16))
    return RunResult(out, config, ce_start, ce_end, records, checkpoint, bare, scored, seconds, probe=probe)
